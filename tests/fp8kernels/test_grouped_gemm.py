"""fp8kernels.grouped_gemm: G groups of different sizes, against float64 per group and against its spec, the
loop of fp8kernels.gemm.scaled_mm (bit for bit where both run the same Triton tile math); both of its paths,
the one Triton launch and cuBLASLt per group, and the choice between them.

Groups differ the way MoE experts do: fprop and dgrad in M (the rows each expert got, 0 and 1
included), wgrad in K (the same counts, now the reduction length: a group of 0 rows writes zeros;
a K that is not a multiple of 16 goes through the zero-code padding).
Operands come from the reference quantizers, group by group, with tests/fp8kernels/test_gemm.py's helpers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8kernels import gemm, grouped_gemm
from fp8kernels import reference as R
from fp8kernels.gemm_reference import gemm_operand
from fp8kernels.grouped_gemm import grouped_scaled_mm, scaled_mm_loop
from tests.fp8kernels.devices import DEVICES
from tests.fp8kernels.gemm_operands import LAYOUTS, assert_matches_float64, quantize, seeded_tensors

# id: (layout, (A scheme, A format), (B scheme, B format), (I, O), rows per group, hadamard)
# MXFP8 and NVFP4 blocks must tile every operand row, so their sizes are multiples of 32 / 16.
ROWS = (37, 0, 1, 130)
CASES = {
    "tensorwise-fprop": ("fprop", ("tensorwise", "e4m3"), ("tensorwise", "e4m3"), (100, 37), ROWS, False),
    "tensorwise-dgrad-hybrid": ("dgrad", ("tensorwise", "e5m2"), ("tensorwise", "e4m3"), (100, 37), ROWS, False),
    "tensorwise-wgrad-hybrid": ("wgrad", ("tensorwise", "e5m2"), ("tensorwise", "e4m3"), (100, 37), ROWS, False),
    "block-fprop-1x128x128x128": ("fprop", ("block1x128", "e4m3"), ("block128x128", "e4m3"), (200, 37), ROWS, False),
    "block-wgrad-1x128x1x128": ("wgrad", ("block1x128", "e5m2"), ("block1x128", "e4m3"), (100, 37), ROWS, False),
    "mxfp8-dgrad-hybrid": ("dgrad", ("mxfp8", "e5m2"), ("mxfp8", "e4m3"), (96, 64), (32, 0, 96), False),
    "mxfp8-wgrad-hybrid": ("wgrad", ("mxfp8", "e5m2"), ("mxfp8", "e4m3"), (96, 64), (32, 0, 96), False),
    "nvfp4-fprop-1x16x16x16": ("fprop", ("nvfp4_1x16", "e2m1"), ("nvfp4_16x16", "e2m1"), (80, 48), (3, 0, 48), False),
    "nvfp4-wgrad-hadamard": ("wgrad", ("nvfp4_1x16", "e2m1"), ("nvfp4_1x16", "e2m1"), (80, 48), (16, 0, 48), True),
}  # fmt: skip
# The same layouts at sizes cuBLASLt takes (K and N multiples of 16; blocks: K in 512s, N in 128s, M in 4s),
# wgrad's K (the rows per group, 37 and 1 among them) once padded: on CUDA they run on cuBLASLt, group by group.
CUBLAS_CASES = {
    "tensorwise-fprop": ("fprop", ("tensorwise", "e4m3"), ("tensorwise", "e4m3"), (64, 48), ROWS, False),
    "tensorwise-dgrad-hybrid": ("dgrad", ("tensorwise", "e5m2"), ("tensorwise", "e4m3"), (64, 48), ROWS, False),
    "tensorwise-wgrad-hybrid": ("wgrad", ("tensorwise", "e5m2"), ("tensorwise", "e4m3"), (64, 48), ROWS, False),
    "block-fprop-1x128x128x128": (
        "fprop", ("block1x128", "e4m3"), ("block128x128", "e4m3"), (512, 128), (36, 0, 4, 132), False
    ),
}  # fmt: skip
EPILOGUES = {"fp32": (torch.float32, None), "bf16-bias": (torch.bfloat16, torch.bfloat16)}
CUDA_EPILOGUES = EPILOGUES | {"bf16": (torch.bfloat16, None)}  # GroupedLinear's block fprop: bf16, no bias


def _grouped_operands(case: tuple, device: str) -> tuple[list[R.Quantized], list[R.Quantized], bool, bool]:
    """Per group: fresh x [m, I], w [O, I], dy [m, O] (seeded by group), quantized as the layout needs."""
    layout, (a_scheme, a_fmt), (b_scheme, b_fmt), (d_in, d_out), rows, hadamard = case
    (a_name, a_columnwise), (b_name, b_columnwise) = LAYOUTS[layout]
    qa, qb = [], []
    for g, m in enumerate(rows):
        tensors = seeded_tensors(m, d_in, d_out, device, seed=g)
        qa.append(quantize(tensors[a_name], a_scheme, a_fmt, a_columnwise, hadamard))
        qb.append(quantize(tensors[b_name], b_scheme, b_fmt, b_columnwise, hadamard))
    return qa, qb, a_columnwise, b_columnwise


def _biases(qb: list[R.Quantized], b_columnwise: bool, dtype: torch.dtype | None, device: str) -> list | None:
    if dtype is None:
        return None
    n = qb[0].shape[-1] if b_columnwise else qb[0].shape[0]  # N: the rows of the B operand
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(n, generator=generator).to(device, dtype) for _ in qb]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("case", CASES)
def test_grouped_matches_float64_per_group(device, epilogue, case):
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(CASES[case], device)
    out_dtype, bias_dtype = EPILOGUES[epilogue]
    bias = _biases(qb, b_columnwise, bias_dtype, device)
    got = grouped_scaled_mm(
        qa, qb, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias
    )
    assert len(got) == len(qa)
    for g, out in enumerate(got):
        if out.numel() == 0:  # a group without rows in fprop/dgrad: an empty [0, N] result
            assert out.shape[0] == 0 and out.dtype == out_dtype
            continue
        bias_g = None if bias is None else bias[g]
        assert_matches_float64(out, qa[g], a_columnwise, qb[g], b_columnwise, bias_g, out_dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA's scaled_mm may take cuBLASLt: compared within tolerance")
@pytest.mark.parametrize("case", CASES)
def test_grouped_launch_equals_the_scaled_mm_loop_exact(case):
    """Under the interpreter both run the same tile math (fp8kernels.gemm's _operand_tile, same tiles): equal bits."""
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(CASES[case], "cpu")
    bias = _biases(qb, b_columnwise, torch.bfloat16, "cpu")
    kwargs = {"a_columnwise": a_columnwise, "b_columnwise": b_columnwise, "out_dtype": torch.bfloat16, "bias": bias}
    for got, want in zip(grouped_scaled_mm(qa, qb, **kwargs), scaled_mm_loop(qa, qb, **kwargs), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_out_rows_of_one_tensor_are_written_in_place(device):
    """The MoE fprop: every group writes its rows of one [T, O] output."""
    qa, qb, _, _ = _grouped_operands(CASES["tensorwise-fprop"], device)
    rows = [q.shape[0] for q in qa]
    y = torch.full((sum(rows), qb[0].shape[0]), float("nan"), device=device)
    returned = grouped_scaled_mm(qa, qb, out_dtype=torch.float32, out=list(y.split(rows)))
    assert all(r.data_ptr() == part.data_ptr() for r, part in zip(returned, y.split(rows), strict=True) if r.numel())
    assert torch.equal(y, torch.cat(grouped_scaled_mm(qa, qb, out_dtype=torch.float32)))


@pytest.mark.parametrize("device", DEVICES)
def test_row_slices_of_one_buffer_with_narrow_alignment(device):
    """The MoE layout: every group's A is a row slice of one quantized x and every output a row slice of one y.
    NVFP4 rows of 40 bytes and bf16 outputs of 12 columns put the groups 8 and 8 bytes apart, not 16:
    the launcher must address them in those smaller units."""
    rows, d_in, d_out = (3, 0, 1, 37), 80, 12
    tensors = seeded_tensors(sum(rows), d_in, d_out, device)
    x_q = quantize(tensors["x"], "nvfp4_1x16", "e2m1", False)
    starts = [sum(rows[:g]) for g in range(len(rows))]
    qa = [
        dataclasses.replace(x_q, shape=(m, d_in), data=x_q.data[r : r + m], scale_inv=x_q.scale_inv[r : r + m])
        for r, m in zip(starts, rows, strict=True)
    ]
    weights = [seeded_tensors(1, d_in, d_out, device, seed=g)["w"] for g in range(len(rows))]
    qb = [quantize(w, "nvfp4_1x16", "e2m1", False) for w in weights]
    y = torch.full((sum(rows), d_out), float("nan"), device=device, dtype=torch.bfloat16)
    grouped_scaled_mm(qa, qb, out=list(y.split(rows)))
    for g, part in enumerate(y.split(rows)):
        if len(part):
            assert_matches_float64(part, qa[g], False, qb[g], False, None, torch.bfloat16)


def _aligned_operands(qa, qb, a_columnwise: bool, b_columnwise: bool) -> tuple[list, list]:
    """Each group's GemmOperands with K padded as grouped_scaled_mm pads them before it picks a path."""
    pairs = [
        grouped_gemm._aligned_k(gemm_operand(qa_g, a_columnwise, "a"), gemm_operand(qb_g, b_columnwise, "b"))
        for qa_g, qb_g in zip(qa, qb, strict=True)
    ]
    return [a_op for a_op, _ in pairs], [b_op for _, b_op in pairs]


_BLOCK = (("block1x128", "e4m3"), ("block128x128", "e4m3"))
# id: (case, out_dtype, bias dtype, whether every group goes to cuBLASLt): fp8kernels.gemm's rules, group by group
DISPATCH = {
    "tensorwise-fprop-bf16-bias": (CUBLAS_CASES["tensorwise-fprop"], torch.bfloat16, torch.bfloat16, True),
    "tensorwise-dgrad-fp32": (CUBLAS_CASES["tensorwise-dgrad-hybrid"], torch.float32, None, True),
    "tensorwise-wgrad-k-padded": (CUBLAS_CASES["tensorwise-wgrad-hybrid"], torch.bfloat16, None, True),
    "block-fprop": (CUBLAS_CASES["block-fprop-1x128x128x128"], torch.bfloat16, None,
                    gemm.CUDA_PATHS["block"] == "cublaslt"),
    "fp32-out-with-bias": (CUBLAS_CASES["tensorwise-fprop"], torch.float32, torch.float32, False),
    "bf16-out-fp32-bias": (CUBLAS_CASES["tensorwise-fprop"], torch.bfloat16, torch.float32, False),
    "n-37": (("fprop", ("tensorwise", "e4m3"), ("tensorwise", "e4m3"), (64, 37), ROWS, False),
             torch.bfloat16, None, False),
    "e5m2-x-e5m2": (("dgrad", ("tensorwise", "e5m2"), ("tensorwise", "e5m2"), (64, 48), ROWS, False),
                    torch.bfloat16, None, False),
    "block-fprop-m-37": (("fprop", *_BLOCK, (512, 128), ROWS, False), torch.bfloat16, None, False),
    # the block modes take no bias: cuBLASLt writes fp32, fp8kernels.gemm's epilogue adds it
    "block-fprop-bias": (CUBLAS_CASES["block-fprop-1x128x128x128"], torch.bfloat16, torch.bfloat16,
                         gemm.CUDA_PATHS["block"] == "cublaslt"),
    "block-wgrad-1x128x1x128": (("wgrad", ("block1x128", "e4m3"), ("block1x128", "e4m3"), (512, 128),
                                 (512, 0, 1024), False), torch.bfloat16, None, gemm.CUDA_PATHS["block"] == "cublaslt"),
    "block-wgrad-partial-k-block": (("wgrad", ("block1x128", "e4m3"), ("block1x128", "e4m3"), (512, 128),
                                     (512, 37, 1024), False), torch.bfloat16, None, False),
    "mxfp8-dgrad": (CASES["mxfp8-dgrad-hybrid"], torch.bfloat16, None, False),
    "nvfp4-fprop": (CASES["nvfp4-fprop-1x16x16x16"], torch.bfloat16, None, False),
}  # fmt: skip


@pytest.mark.parametrize("case", DISPATCH)
def test_dispatch_to_cublas_per_group_follows_kernels_gemm_rules(case):
    """All groups or none; groups with no product do not count (wgrad's K = 0 group: its empty codes have no
    row stride cuBLASLt would take, yet it must not keep the others off)."""
    spec, out_dtype, bias_dtype, expected = DISPATCH[case]
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(spec, "cpu")
    a_ops, b_ops = _aligned_operands(qa, qb, a_columnwise, b_columnwise)
    bias = _biases(qb, b_columnwise, bias_dtype, "cpu")
    assert grouped_gemm._cublas_takes_every_group(a_ops, b_ops, out_dtype, bias) == expected


def test_zero_codes_appended_to_k_let_every_wgrad_group_onto_cublas(monkeypatch):
    """wgrad's K is each group's row count (37, 0, 1, 130): unpadded, the groups of 37 and 1 keep all four off
    cuBLASLt; padded (the codes kept, zeros after them, one copy per operand), all go; the switch turns it off."""
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(CUBLAS_CASES["tensorwise-wgrad-hybrid"], "cpu")
    raw = ([gemm_operand(q, a_columnwise, "a") for q in qa], [gemm_operand(q, b_columnwise, "b") for q in qb])
    assert not grouped_gemm._cublas_takes_every_group(*raw, torch.bfloat16, None)
    padded = _aligned_operands(qa, qb, a_columnwise, b_columnwise)
    assert grouped_gemm._cublas_takes_every_group(*padded, torch.bfloat16, None)
    for before, after in zip(raw[0] + raw[1], padded[0] + padded[1], strict=True):
        assert after.k == -(-before.k // 16) * 16 and after.data.shape == (before.rows, after.k)
        assert torch.equal(after.data[:, : before.k], before.data) and not after.data[:, before.k :].any()
    monkeypatch.setattr(grouped_gemm, "GROUPS_USE_TORCH_SCALED_MM", False)
    assert not grouped_gemm._cublas_takes_every_group(*padded, torch.bfloat16, None)


def _check_written_into_rows_of_one_tensor(case: tuple, epilogue: tuple, device: str, run) -> None:
    """run(qa, qb, aligned operands, kwargs of grouped_scaled_mm, out) writes each group into its rows of one
    NaN-filled tensor; every group's rows must match float64 (a group with K = 0: its bias, or zeros)."""
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(case, device)
    out_dtype, bias_dtype = epilogue
    bias = _biases(qb, b_columnwise, bias_dtype, device)
    a_ops, b_ops = _aligned_operands(qa, qb, a_columnwise, b_columnwise)
    rows = [a_op.rows for a_op in a_ops]
    y = torch.full((sum(rows), b_ops[0].rows), float("nan"), device=device, dtype=out_dtype)
    kwargs = {"a_columnwise": a_columnwise, "b_columnwise": b_columnwise, "out_dtype": out_dtype, "bias": bias}
    run(qa, qb, (a_ops, b_ops), kwargs, list(y.split(rows)))
    for g, part in enumerate(y.split(rows)):
        if part.numel():  # a group without rows in fprop/dgrad has nothing to write
            bias_g = None if bias is None else bias[g]
            assert_matches_float64(part, qa[g], a_columnwise, qb[g], b_columnwise, bias_g, out_dtype)


@pytest.mark.parametrize("epilogue", EPILOGUES)
@pytest.mark.parametrize("case", [case for case in CUBLAS_CASES if case.startswith("tensorwise")])
def test_cublas_path_on_cpu_scaled_mm_writes_float64_products(case, epilogue):
    """The per-group path's own code (fp8 views, scales, out= into rows of one tensor, K = 0) on torch._scaled_mm's
    CPU kernel, which takes per-tensor fp8 in cuBLASLt's layout; the CUDA test below runs it on cuBLASLt."""

    def run(qa, qb, operands, kwargs, out):
        grouped_gemm._cublas_per_group(*operands, kwargs["out_dtype"], kwargs["bias"], out)

    _check_written_into_rows_of_one_tensor(CUBLAS_CASES[case], EPILOGUES[epilogue], "cpu", run)


@pytest.mark.gpu
@pytest.mark.parametrize("epilogue", CUDA_EPILOGUES)
@pytest.mark.parametrize("case", CUBLAS_CASES)
def test_cuda_dispatch_to_cublas_per_group_matches_float64(monkeypatch, case, epilogue):
    """grouped_scaled_mm on CUDA: one torch._scaled_mm per group with a product, written in place (cuBLASLt's
    blockwise mode takes no bias: there an fp32 product, then fp8kernels.gemm's epilogue adds it)."""
    calls = []
    original = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))

    def run(qa, qb, operands, kwargs, out):
        returned = grouped_scaled_mm(qa, qb, **kwargs, out=out)
        assert all(r.data_ptr() == o.data_ptr() for r, o in zip(returned, out, strict=True) if o.numel())
        products = sum(min(a_op.rows, b_op.rows, a_op.k) > 0 for a_op, b_op in zip(*operands, strict=True))
        assert len(calls) == products

    _check_written_into_rows_of_one_tensor(CUBLAS_CASES[case], CUDA_EPILOGUES[epilogue], "cuda", run)


def test_bad_groups_raise_with_the_fix():
    qa, qb, _, _ = _grouped_operands(CASES["tensorwise-fprop"], "cpu")
    with pytest.raises(ValueError, match="same number"):
        grouped_scaled_mm(qa, qb[:-1])
    with pytest.raises(ValueError, match="same number"):
        grouped_scaled_mm(qa[0], qb[0])
    mixed = list(qb)
    mixed[2] = quantize(seeded_tensors(1, 100, 37, "cpu")["w"], "tensorwise", "e5m2", False)
    with pytest.raises(ValueError, match="group 2 .* one recipe"):
        grouped_scaled_mm(qa, mixed)
    with pytest.raises(ValueError, match=r"out\[0\] must be a torch.float32 tensor of shape \[37, 37\]"):
        grouped_scaled_mm(qa, qb, out_dtype=torch.float32, out=[torch.empty(37, 36)] + [None] * 3)
    with pytest.raises(ValueError, match=r"out\[0\] must be contiguous"):
        outs = [torch.empty(37, 74)[:, :37]] + [torch.empty(q.shape[0], 37) for q in qa[1:]]
        grouped_scaled_mm(qa, qb, out_dtype=torch.float32, out=outs)
    with pytest.raises(ValueError, match="list of 4 tensors"):
        grouped_scaled_mm(qa, qb, bias=torch.zeros(37))


# Compiles fp8kernels.gemm's dense kernel and the grouped one for sm_90 with one tile, as Triton specializes
# them for 16-byte aligned tensors and sizes that are multiples of 16; prints both PTX texts.
_COMPILE_FOR_SM90 = """
import json, triton
from triton.backends.compiler import GPUTarget
from fp8kernels._casts import format_constants
from fp8kernels.gemm import _FP8_TILES, _scaled_mm_kernel
from fp8kernels.grouped_gemm import _grouped_scaled_mm_kernel

tile = dict(_FP8_TILES[0])
options = {"num_warps": tile.pop("num_warps"), "num_stages": tile.pop("num_stages")}
constants = dict(SCALING="tensorwise", SCALE_K=0, A_SCALE_ROWS=1, B_SCALE_ROWS=1, HAS_BIAS=False, OUT_BF16=True,
                 DOT_IN_FP32=False, GROUP_M=8, **format_constants("e4m3", "A_"), **format_constants("e4m3", "B_"))
constants |= tile
pointers = {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
            "a_amax_ptr": "*fp32", "b_amax_ptr": "*fp32", "bias_ptr": "*i16", "out_ptr": "*i16", "table_ptr": "*i64"}

def ptx(kernel, constants):
    names = kernel.arg_names
    signature = {n: "constexpr" if n in constants else pointers.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n not in constants and n != "num_groups"}
    source = triton.compiler.ASTSource(kernel, signature, {(names.index(n),): v for n, v in constants.items()}, aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 128), options=options).asm["ptx"]

grouped = constants | {"A_UNIT": 16, "B_UNIT": 16, "OUT_UNIT": 8}
print(json.dumps({"dense": ptx(_scaled_mm_kernel, constants), "grouped": ptx(_grouped_scaled_mm_kernel, grouped)}))
"""
_PTX_FEATURES = {  # what makes the dense kernel fast, as PTX spells it
    "16-byte cp.async loads": r"cp\.async\.cg\.shared\.global.*0x10",
    "wgmma instructions": r"wgmma\.mma_async",
    "16-byte stores": r"st\.global\.v4",
    "byte loads": r"ld\.global(\.\w+)*\.[bu]8\b",
}


def test_grouped_kernel_compiles_to_the_dense_kernels_loads_dots_and_stores():
    """Offline sm_90 compile (no GPU needed): the grouped launch must not lose what the dense kernel's
    specialization gives it (Triton 3.6 once compiled it to byte loads without cp.async: 20x slower)."""
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).parents[2])
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_SM90], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ptx = json.loads(done.stdout)
    counts = {kind: {name: len(re.findall(pattern, text)) for name, pattern in _PTX_FEATURES.items()}
              for kind, text in ptx.items()}  # fmt: skip
    assert counts["dense"]["16-byte cp.async loads"] > 0 and counts["dense"]["byte loads"] == 0, counts
    assert counts["grouped"] == counts["dense"], counts
