"""GEMM operands for the kernels' GEMM tests (test_gemm, test_grouped_gemm): seeded tensors, the reference
quantizers' copy a GEMM needs, and the float64 check of a product of dequantized operands."""

from __future__ import annotations

import torch

from fp8kernels import gemm_reference
from fp8kernels import reference as R

# layout -> ((tensor, columnwise) of A, (tensor, columnwise) of B)
LAYOUTS = {
    "fprop": (("x", False), ("w", False)),
    "dgrad": (("dy", False), ("w", True)),
    "wgrad": (("dy", True), ("x", True)),
}


def quantize(t: torch.Tensor, scheme: str, fmt: str, columnwise: bool, hadamard: bool = False) -> R.Quantized:
    """The copy a GEMM needs (only that one, so MXFP8/NVFP4 divisibility applies to it alone)."""
    roles = {"rowwise": not columnwise, "columnwise": columnwise}
    if scheme == "tensorwise":
        return R.quantize_tensorwise(t, fmt, **roles)
    if scheme.startswith("block"):
        return R.quantize_blockwise(t, fmt, R.SCHEME_BLOCKS[scheme], **roles)
    if scheme == "mxfp8":
        return R.quantize_mxfp8(t, fmt, **roles)
    return R.quantize_nvfp4(t, block=R.SCHEME_BLOCKS[scheme], hadamard=hadamard, **roles)


def dequantized_operand(q: R.Quantized, columnwise: bool) -> torch.Tensor:
    """[rows, K] in float64: x viewed as a matrix, transposed for a columnwise copy."""
    x = R.dequantize(q, columnwise=columnwise).double()
    x2d = x.reshape(-1, x.shape[-1])
    return x2d.T if columnwise else x2d


def accumulation_tolerance(device_type: str, scheme: str, k: int) -> float:
    """Allowed |error| per unit of sum |a||b|: fp32 sums on CPU and in bf16 dots; fp8 MMAs on CUDA sum a K
    tile (<= 128) in reduced precision before promoting to fp32 (2^-9 stays far below a misapplied scale)."""
    if device_type == "cuda" and gemm_reference.SCHEME_FAMILY[scheme] in ("tensorwise", "block"):
        return 2.0**-9
    return k * 2.0**-20  # 2^-24 per fp32 addition, with room


def assert_matches_float64(got, qa, a_columnwise, qb, b_columnwise, bias, out_dtype):
    """|got - exact| within the accumulation tolerance (of sum |a||b|) plus the output's rounding."""
    a_values, b_values = dequantized_operand(qa, a_columnwise).cpu(), dequantized_operand(qb, b_columnwise).cpu()
    expected = a_values @ b_values.T
    magnitude = a_values.abs() @ b_values.abs().T
    if bias is not None:
        expected = expected + bias.double().cpu()
        magnitude = magnitude + bias.double().cpu().abs()
    assert got.dtype == out_dtype and got.shape == expected.shape
    accumulation = accumulation_tolerance(got.device.type, qa.scheme, a_values.shape[1])
    got = got.cpu().double()
    assert torch.isfinite(got).all(), "non-finite output from finite operands"
    rounding = 2.0**-8 if out_dtype == torch.bfloat16 else 0.0
    bound = magnitude * accumulation + expected.abs() * rounding
    error = (got - expected).abs()
    worst = int((error - bound).argmax())
    row, col = divmod(worst, expected.shape[1])
    assert (error <= bound).all(), (
        f"{int((error > bound).sum())} of {error.numel()} outside; worst at [{row}, {col}]: "
        f"got {got[row, col].item()} want {expected[row, col].item()} bound {bound[row, col].item():.3g}"
    )


def seeded_tensors(tokens, d_in, d_out, device, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def sample(*shape):  # spread over a few binades, so scales differ between blocks
        return torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-3, 4, shape, generator=generator))

    tensors = {"x": sample(tokens, d_in), "w": sample(d_out, d_in), "dy": sample(tokens, d_out)}
    return {name: t.to(device) for name, t in tensors.items()}
