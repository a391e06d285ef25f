"""fp8kernels.gemm (Triton: interpreted on CPU, compiled with `-m gpu`) and its spec fp8kernels.gemm_reference,
each against a float64 matmul of the operands as fp8kernels.reference.dequantize gives them.

The operands come from the reference quantizers (their bytes are the Triton quantizers' bytes) for
the three GEMMs of a linear layer, x [T, I], w [O, I], dy [T, O]:
fprop x @ w.T, dgrad dy @ w, wgrad dy.T @ x. Shapes are awkward on purpose: K not a multiple of
the tile, M = 1, N prime, partial scale blocks.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fp8kernels import gemm, gemm_reference
from fp8kernels import reference as R
from tests.fp8kernels.devices import DEVICES
from tests.fp8kernels.gemm_operands import LAYOUTS, assert_matches_float64, dequantized_operand, quantize, seeded_tensors

IMPLEMENTATIONS = {"scaled_mm": gemm.scaled_mm, "reference": gemm_reference.scaled_mm}

# id: (layout, (A scheme, A format), (B scheme, B format), (T, I, O), hadamard)
CASES = {
    "tensorwise-fprop-M1": ("fprop", ("tensorwise", "e4m3"), ("tensorwise", "e4m3"), (1, 200, 37), False),
    "tensorwise-fprop": ("fprop", ("tensorwise", "e4m3"), ("tensorwise", "e4m3"), (130, 200, 37), False),
    "tensorwise-dgrad-hybrid": ("dgrad", ("tensorwise", "e5m2"), ("tensorwise", "e4m3"), (96, 100, 72), False),
    "tensorwise-wgrad-hybrid": ("wgrad", ("tensorwise", "e5m2"), ("tensorwise", "e4m3"), (72, 40, 37), False),
    "block-fprop-1x128x128x128": ("fprop", ("block1x128", "e4m3"), ("block128x128", "e4m3"), (130, 200, 37), False),
    "block-dgrad-1x128x128x128": ("dgrad", ("block1x128", "e5m2"), ("block128x128", "e4m3"), (33, 150, 260), False),
    "block-wgrad-1x128x1x128": ("wgrad", ("block1x128", "e5m2"), ("block1x128", "e4m3"), (200, 40, 37), False),
    "mxfp8-fprop": ("fprop", ("mxfp8", "e4m3"), ("mxfp8", "e4m3"), (5, 96, 37), False),
    "mxfp8-dgrad-hybrid": ("dgrad", ("mxfp8", "e5m2"), ("mxfp8", "e4m3"), (20, 50, 64), False),
    "mxfp8-wgrad-hybrid": ("wgrad", ("mxfp8", "e5m2"), ("mxfp8", "e4m3"), (64, 40, 37), False),
    "nvfp4-fprop-1x16x16x16": ("fprop", ("nvfp4_1x16", "e2m1"), ("nvfp4_16x16", "e2m1"), (3, 80, 37), False),
    "nvfp4-dgrad-1x16x16x16": ("dgrad", ("nvfp4_1x16", "e2m1"), ("nvfp4_16x16", "e2m1"), (20, 45, 48), False),
    "nvfp4-wgrad-hadamard": ("wgrad", ("nvfp4_1x16", "e2m1"), ("nvfp4_1x16", "e2m1"), (64, 40, 37), True),
}
# (out_dtype, bias dtype or None)
EPILOGUES = [(torch.float32, None), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)]


def _case_operands(case, device):
    layout, (a_scheme, a_fmt), (b_scheme, b_fmt), shape, hadamard = CASES[case]
    (a_name, a_columnwise), (b_name, b_columnwise) = LAYOUTS[layout]
    tensors = seeded_tensors(*shape, device)
    qa = quantize(tensors[a_name], a_scheme, a_fmt, a_columnwise, hadamard)
    qb = quantize(tensors[b_name], b_scheme, b_fmt, b_columnwise, hadamard)
    return qa, qb, a_columnwise, b_columnwise


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("out_dtype, bias_dtype", EPILOGUES, ids=["fp32", "bf16-bias", "fp32-bias"])
@pytest.mark.parametrize("case", CASES)
def test_scaled_mm_matches_float64_of_dequantized_operands(device, implementation, out_dtype, bias_dtype, case):
    qa, qb, a_columnwise, b_columnwise = _case_operands(case, device)
    bias = None
    if bias_dtype is not None:
        n = dequantized_operand(qb, b_columnwise).shape[0]
        bias = torch.randn(n, generator=torch.Generator().manual_seed(1)).to(device, bias_dtype)
    got = IMPLEMENTATIONS[implementation](
        qa, qb, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias
    )
    assert_matches_float64(got, qa, a_columnwise, qb, b_columnwise, bias, out_dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme, fmt", [("tensorwise", "e4m3"), ("block1x128", "e4m3"), ("mxfp8", "e5m2")])
def test_nan_in_a_row_poisons_that_row_only(device, scheme, fmt):
    x = seeded_tensors(40, 64, 40, "cpu")["x"]
    x[3, 5] = float("nan")
    qx = quantize(x.to(device), scheme, fmt, columnwise=False)
    qw = quantize(seeded_tensors(40, 64, 40, "cpu", seed=2)["w"].to(device), scheme, "e4m3", columnwise=False)
    got = gemm.scaled_mm(qx, qw, out_dtype=torch.float32).cpu()
    assert torch.isnan(got[3]).all()
    assert torch.isfinite(torch.cat([got[:3], got[4:]])).all()


def _gemm_operands(a_fmt="e4m3", b_fmt="e4m3", d_in=48, d_out=32, scheme="tensorwise"):
    tensors = seeded_tensors(32, d_in, d_out, "cpu")
    a = gemm_reference.gemm_operand(quantize(tensors["x"], scheme, a_fmt, False), False, "a")
    b = gemm_reference.gemm_operand(quantize(tensors["w"], scheme, b_fmt, False), False, "b")
    return a, b


def test_dispatch_to_torch_scaled_mm_follows_cudas_rules():
    """CUDA's _scaled_mm needs K and N multiples of 16, no e5m2 x e5m2, a bf16 bias with bf16 out (CPU's is lenient)."""
    takes = gemm._torch_scaled_mm_takes
    assert takes(*_gemm_operands(), torch.bfloat16, None)
    assert takes(*_gemm_operands("e5m2", "e4m3"), torch.float32, None)
    assert takes(*_gemm_operands(), torch.bfloat16, torch.zeros(32, dtype=torch.bfloat16))
    assert not takes(*_gemm_operands(d_in=40), torch.bfloat16, None)  # K = 40: CPU's _scaled_mm accepts it
    assert not takes(*_gemm_operands(d_out=37), torch.bfloat16, None)  # N = 37
    assert not takes(*_gemm_operands("e5m2", "e5m2"), torch.bfloat16, None)
    assert not takes(*_gemm_operands(), torch.float32, torch.zeros(32))  # no bias with an fp32 output
    assert not takes(*_gemm_operands(), torch.bfloat16, torch.zeros(32))  # an fp32 bias with a bf16 output
    assert not takes(*_gemm_operands(scheme="block1x128"), torch.bfloat16, None)  # 1x128 x 1x128, K = 48: partial block


def test_blockwise_dispatch_takes_whole_1x128_by_128x128_blocks_only():
    def operands(d_in, d_out):
        tensors = seeded_tensors(32, d_in, d_out, "cpu")
        a = gemm_reference.gemm_operand(quantize(tensors["x"], "block1x128", "e4m3", False), False, "a")
        b = gemm_reference.gemm_operand(quantize(tensors["w"], "block128x128", "e4m3", False), False, "b")
        return a, b

    takes = gemm._torch_scaled_mm_takes
    assert takes(*operands(512, 128), torch.bfloat16, None) == (gemm.CUDA_PATHS["block"] == "cublaslt")
    assert not takes(*operands(192, 128), torch.bfloat16, None)  # K = 192: a partial K block
    assert not takes(*operands(768, 128), torch.bfloat16, None)  # K/128 = 6: cuBLASLt misreads the scales
    assert not takes(*operands(256, 96), torch.bfloat16, None)  # N = 96: a partial weight block
    # the block modes take no bias: cuBLASLt writes fp32 and our epilogue adds it (GPU test below)
    bias = torch.zeros(128, dtype=torch.bfloat16)
    assert takes(*operands(512, 128), torch.bfloat16, bias) == (gemm.CUDA_PATHS["block"] == "cublaslt")


def test_wgrad_dispatch_takes_whole_1x128_by_1x128_blocks_with_aligned_scales():
    """wgrad's pair (both 1x128 along K = tokens): cuBLASLt reads each operand's scales M- (N-) major."""

    def operands(tokens, d_in, d_out):
        tensors = seeded_tensors(tokens, d_in, d_out, "cpu")
        a = gemm_reference.gemm_operand(quantize(tensors["dy"], "block1x128", "e4m3", True), True, "a")
        b = gemm_reference.gemm_operand(quantize(tensors["x"], "block1x128", "e4m3", True), True, "b")
        return a, b

    takes = gemm._torch_scaled_mm_takes
    assert takes(*operands(768, 64, 128), torch.bfloat16, None) == (gemm.CUDA_PATHS["block"] == "cublaslt")
    assert not takes(*operands(200, 64, 128), torch.bfloat16, None)  # K = 200 tokens: a partial K block
    assert not takes(*operands(256, 64, 130), torch.bfloat16, None)  # M = 130: scale leading dim not 16-byte aligned
    assert not takes(*operands(256, 40, 128), torch.bfloat16, None)  # N = 40: not a multiple of 16
    a, b = operands(768, 64, 128)
    e5m2_dy = dataclasses.replace(a, fmt="e5m2")
    assert not takes(e5m2_dy, b, torch.bfloat16, None)  # torch's block modes take e4m3 x e4m3 only


def test_emulated_families_take_the_dequantize_path():
    """MXFP8 and NVFP4 go where CUDA_PATHS says, whatever the shape (the path has no shape rule)."""
    for scheme, fmt in (("mxfp8", "e4m3"), ("nvfp4_1x16", "e2m1")):
        tensors = seeded_tensors(32, 64, 37, "cpu")
        a = gemm_reference.gemm_operand(quantize(tensors["x"], scheme, fmt, False), False, "a")
        b = gemm_reference.gemm_operand(quantize(tensors["w"], scheme, fmt, False), False, "b")
        assert gemm.cuda_path(a, b, torch.bfloat16, None) == gemm.CUDA_PATHS[a.family]


@pytest.mark.gpu
@pytest.mark.parametrize("d_in", [256, 512, 768, 1280, 3072])  # 768 and 1280: wrong from cuBLASLt before the rule
@pytest.mark.parametrize("tokens, d_out", [(256, 128), (512, 768)])
def test_cuda_blockwise_dispatch_matches_float64(tokens, d_in, d_out):
    tensors = seeded_tensors(tokens, d_in, d_out, "cuda")
    qx, qw = quantize(tensors["x"], "block1x128", "e4m3", False), quantize(tensors["w"], "block128x128", "e4m3", False)
    got = gemm.scaled_mm(qx, qw, out_dtype=torch.bfloat16)
    assert_matches_float64(got, qx, False, qw, False, None, torch.bfloat16)
    bias = torch.randn(d_out, device="cuda").to(torch.bfloat16)  # cuBLASLt's fp32 product, then our epilogue
    got = gemm.scaled_mm(qx, qw, out_dtype=torch.bfloat16, bias=bias)
    assert_matches_float64(got, qx, False, qw, False, bias, torch.bfloat16)
    # wgrad's 1x128 x 1x128 pair, K = tokens (768 and 1280 tokens: the K/128 that broke the 128x128 scales)
    tensors = seeded_tensors(d_in, tokens, d_out, "cuda")
    qdy, qx = (quantize(tensors[name], "block1x128", "e4m3", True) for name in ("dy", "x"))
    a, b = gemm_reference.gemm_operand(qdy, True, "a"), gemm_reference.gemm_operand(qx, True, "b")
    assert gemm.cuda_path(a, b, torch.bfloat16, None) == gemm.CUDA_PATHS["block"]
    got = gemm.scaled_mm(qdy, qx, a_columnwise=True, b_columnwise=True, out_dtype=torch.bfloat16)
    assert_matches_float64(got, qdy, True, qx, True, None, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("d_in, expect_cublas", [(64, True), (40, False)])
def test_cuda_tensorwise_uses_torch_scaled_mm_only_where_it_can(monkeypatch, d_in, expect_cublas):
    calls = []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    tensors = seeded_tensors(48, d_in, 32, "cuda")
    qx, qw = quantize(tensors["x"], "tensorwise", "e4m3", False), quantize(tensors["w"], "tensorwise", "e4m3", False)
    got = gemm.scaled_mm(qx, qw, out_dtype=torch.bfloat16)
    assert len(calls) == (1 if expect_cublas and gemm.CUDA_PATHS["tensorwise"] == "cublaslt" else 0)
    assert_matches_float64(got, qx, False, qw, False, None, torch.bfloat16)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "case", ["tensorwise-dgrad-hybrid", "block-dgrad-1x128x128x128", "mxfp8-dgrad-hybrid", "nvfp4-dgrad-1x16x16x16"]
)
def test_every_autotune_candidate_computes_the_same_product(device, case):
    """Autotuning may pick any tile: each must be right (BLOCK_K 64 splits a 128-wide scale block in two)."""
    qa, qb, a_columnwise, b_columnwise = _case_operands(case, device)
    a, b = gemm_reference.gemm_operand(qa, a_columnwise, "a"), gemm_reference.gemm_operand(qb, b_columnwise, "b")
    for tile in gemm._TILES[a.family]:
        got = gemm._scaled_mm_triton(a, b, torch.float32, None, tile=tile)
        assert_matches_float64(got, qa, a_columnwise, qb, b_columnwise, None, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("entry", ["triton-kernel", "scaled_mm"])
@pytest.mark.parametrize("case", [case for case, (layout, *_) in CASES.items() if layout == "fprop"])
def test_cuda_gemm_on_many_tiles(case, entry):
    """A shape of several tiles each way, through the compiled kernel itself and through the path scaled_mm picks."""
    _, (a_scheme, a_fmt), (b_scheme, b_fmt), _, _ = CASES[case]
    tensors = seeded_tensors(520, 384, 650, "cuda")
    qa, qb = quantize(tensors["x"], a_scheme, a_fmt, False), quantize(tensors["w"], b_scheme, b_fmt, False)
    a, b = gemm_reference.gemm_operand(qa, False, "a"), gemm_reference.gemm_operand(qb, False, "b")
    bias = torch.randn(650, device="cuda").to(torch.bfloat16)
    if entry == "triton-kernel":
        got = gemm._scaled_mm_triton(a, b, torch.bfloat16, bias)
    else:
        got = gemm.scaled_mm(qa, qb, out_dtype=torch.bfloat16, bias=bias)
    assert_matches_float64(got, qa, False, qb, False, bias, torch.bfloat16)


def test_autotune_pruning_reads_arguments_the_kernel_has():
    """The pruner runs only on CUDA (the interpreter gets one config): check its logic and names here."""
    configs = ["first", "second"]
    assert gemm._tune_big_problems_only(configs, {"M": 1, "N": 8192}) == ["first"]
    assert gemm._tune_big_problems_only(configs, {"M": 2048, "N": 2048}) == configs
    assert {"M", "N"} <= set(gemm._scaled_mm_kernel.arg_names)


def _plain(shape=(32, 64), scheme="tensorwise"):
    return quantize(seeded_tensors(shape[0], shape[1], 8, "cpu")["x"], scheme, "e4m3", columnwise=False)


@pytest.mark.parametrize(
    "make_call, error, match",
    [
        (lambda: gemm.scaled_mm(_plain(), _plain(scheme="mxfp8")), ValueError, "same scaling family"),
        (lambda: gemm.scaled_mm(_plain((32, 64)), _plain((32, 96))), ValueError, "K differ"),
        (lambda: gemm.scaled_mm(_plain(), _plain(), b_columnwise=True), ValueError, "no columnwise copy"),
        (lambda: gemm.scaled_mm(_plain(), _plain(), out_dtype=torch.float16), TypeError, "out_dtype"),
        (lambda: gemm.scaled_mm(_plain(), _plain(), bias=torch.zeros(31)), ValueError, r"shape \(32,\)"),
        (lambda: gemm.scaled_mm(_plain(), torch.zeros(32, 64)), TypeError, "Quantized"),
        (
            lambda: gemm.scaled_mm(
                R.quantize_nvfp4(torch.randn(32, 48), hadamard=True, rowwise=False, columnwise=True),
                R.quantize_nvfp4(torch.randn(32, 40), hadamard=False, rowwise=False, columnwise=True),
                a_columnwise=True, b_columnwise=True,
            ),
            ValueError, "Hadamard",
        ),
    ],
    ids=["family", "k", "missing-copy", "out-dtype", "bias-shape", "not-quantized", "one-hadamard"],
)
def test_user_errors_name_the_fix(make_call, error, match):
    with pytest.raises(error, match=match):
        make_call()
