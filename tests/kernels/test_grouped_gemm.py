"""kernels.grouped_gemm: one launch for G groups of different sizes, against float64 per group and against
its spec, the loop of kernels.gemm.scaled_mm (bit for bit where both run the same Triton tile math).

Groups differ the way MoE experts do: fprop and dgrad in M (the rows each expert got, 0 and 1
included), wgrad in K (the same counts, now the reduction length: a group of 0 rows writes zeros;
a K that is not a multiple of 16 goes through the launcher's zero-code padding).
Operands come from the reference quantizers, group by group, with tests/kernels/test_gemm.py's helpers.
"""

from __future__ import annotations

import pytest
import torch

from kernels import reference as R
from kernels.grouped_gemm import grouped_scaled_mm, scaled_mm_loop
from tests.kernels.devices import DEVICES
from tests.kernels.test_gemm import LAYOUTS, _tensors, assert_matches_float64, quantize

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
EPILOGUES = {"fp32": (torch.float32, None), "bf16-bias": (torch.bfloat16, torch.bfloat16)}


def _grouped_operands(case: str, device: str) -> tuple[list[R.Quantized], list[R.Quantized], bool, bool]:
    """Per group: fresh x [m, I], w [O, I], dy [m, O] (seeded by group), quantized as the layout needs."""
    layout, (a_scheme, a_fmt), (b_scheme, b_fmt), (d_in, d_out), rows, hadamard = CASES[case]
    (a_name, a_columnwise), (b_name, b_columnwise) = LAYOUTS[layout]
    qa, qb = [], []
    for g, m in enumerate(rows):
        tensors = _tensors(m, d_in, d_out, device, seed=g)
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
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(case, device)
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
    """Under the interpreter both run the same tile math (kernels.gemm's _operand_tile, same tiles): equal bits."""
    qa, qb, a_columnwise, b_columnwise = _grouped_operands(case, "cpu")
    bias = _biases(qb, b_columnwise, torch.bfloat16, "cpu")
    kwargs = {"a_columnwise": a_columnwise, "b_columnwise": b_columnwise, "out_dtype": torch.bfloat16, "bias": bias}
    for got, want in zip(grouped_scaled_mm(qa, qb, **kwargs), scaled_mm_loop(qa, qb, **kwargs), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_out_rows_of_one_tensor_are_written_in_place(device):
    """The MoE fprop: every group writes its rows of one [T, O] output."""
    qa, qb, _, _ = _grouped_operands("tensorwise-fprop", device)
    rows = [q.shape[0] for q in qa]
    y = torch.full((sum(rows), qb[0].shape[0]), float("nan"), device=device)
    returned = grouped_scaled_mm(qa, qb, out_dtype=torch.float32, out=list(y.split(rows)))
    assert all(r.data_ptr() == part.data_ptr() for r, part in zip(returned, y.split(rows), strict=True) if r.numel())
    assert torch.equal(y, torch.cat(grouped_scaled_mm(qa, qb, out_dtype=torch.float32)))


def test_bad_groups_raise_with_the_fix():
    qa, qb, _, _ = _grouped_operands("tensorwise-fprop", "cpu")
    with pytest.raises(ValueError, match="same number"):
        grouped_scaled_mm(qa, qb[:-1])
    with pytest.raises(ValueError, match="same number"):
        grouped_scaled_mm(qa[0], qb[0])
    mixed = list(qb)
    mixed[2] = quantize(_tensors(1, 100, 37, "cpu")["w"], "tensorwise", "e5m2", False)
    with pytest.raises(ValueError, match="group 2 .* one recipe"):
        grouped_scaled_mm(qa, mixed)
    with pytest.raises(ValueError, match=r"out\[0\] must be a torch.float32 tensor of shape \[37, 37\]"):
        grouped_scaled_mm(qa, qb, out_dtype=torch.float32, out=[torch.empty(37, 36)] + [None] * 3)
    with pytest.raises(ValueError, match=r"out\[0\] must be contiguous"):
        outs = [torch.empty(37, 74)[:, :37]] + [torch.empty(q.shape[0], 37) for q in qa[1:]]
        grouped_scaled_mm(qa, qb, out_dtype=torch.float32, out=outs)
    with pytest.raises(ValueError, match="list of 4 tensors"):
        grouped_scaled_mm(qa, qb, bias=torch.zeros(37))
