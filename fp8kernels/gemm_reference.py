"""The pure-torch spec of fp8kernels.gemm: out[M, N] = A[M, K] @ B[N, K]^T of the dequantized operands.

Both operands are "TN": row-major with K contiguous, which is what the quantizers' buffers are
(docs/quantization.md). An operand is a quantized tensor's rowwise copy (x viewed as
[prod(leading dims), last dim]) or its columnwise copy (the rowwise quantization of x.T), picked
by a flag. The three GEMMs of a linear layer y = x @ w.T (x [T, I], w [O, I], dy [T, O]):

| GEMM  | A                       | B                       | out          |
|-------|-------------------------|-------------------------|--------------|
| fprop | x rowwise [T, I]        | w rowwise [O, I]        | y [T, O]     |
| dgrad | dy rowwise [T, O]       | w columnwise [I, O]     | dx [T, I]    |
| wgrad | dy columnwise [O, T]    | x columnwise [I, T]     | dw [O, I]    |

Both operands use one scaling family (`SCHEME_FAMILY`): per tensor; fp32 scales per 128 elements of
K (1x128 or 128x128 blocks, mixed freely); MXFP8; NVFP4. Formats may differ (HYBRID: e5m2 x e4m3).
NVFP4 columnwise copies made with the random Hadamard transform are rotated along K: the product
of two rotated operands equals the unrotated one, so both or neither must be rotated.
The spec: dequantize each operand to fp32, multiply with fp32 accumulation, add the bias in fp32,
round once to out_dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from twinspec.formats import SCHEME_BLOCKS
from fp8kernels.reference import Quantized, dequantize

OUT_DTYPES = (torch.bfloat16, torch.float32)

# scheme -> scaling family; operands of one GEMM share a family
SCHEME_FAMILY = {
    "tensorwise": "tensorwise",
    "block1x128": "block",
    "block128x128": "block",
    "mxfp8": "mxfp8",
    "nvfp4_1x16": "nvfp4",
    "nvfp4_16x16": "nvfp4",
}


@dataclass(frozen=True)
class GemmOperand:
    """One side of the GEMM: the [rows, K] buffers of a quantized tensor's rowwise or columnwise copy."""

    data: Tensor  # uint8 [rows, K] (nvfp4: [rows, K // 2])
    scale_inv: Tensor  # the copy's scale_inv, laid out for [rows, K] (docs/quantization.md)
    global_amax: Tensor | None  # nvfp4: the copy's global amax (fp32 (1,)); else None
    scheme: str
    fmt: str
    rows: int
    k: int
    rotated: bool  # nvfp4 columnwise copy made with the Hadamard transform (along K)

    @property
    def family(self) -> str:
        return SCHEME_FAMILY[self.scheme]

    @property
    def scale_rows(self) -> int:
        """Operand rows sharing one scale (1, 16 or 128; 0 for a per-tensor scale)."""
        block = SCHEME_BLOCKS[self.scheme]
        return 0 if block is None else block[0]


def gemm_operand(q: Quantized, columnwise: bool, name: str) -> GemmOperand:
    """The operand a GEMM reads from `q`: its rowwise copy, or its columnwise one (the quantized x.T)."""
    if not isinstance(q, Quantized):
        raise TypeError(f"{name} must be a fp8kernels.reference.Quantized, got {type(q).__name__}; quantize it first")
    data = q.columnwise_data if columnwise else q.data
    if data is None:
        have, want = ("rowwise", "columnwise") if columnwise else ("columnwise", "rowwise")
        raise ValueError(
            f"{name} has no {want} copy ({name}_columnwise={columnwise}); quantize it with {want}=True "
            f"or use its {have} copy"
        )
    leading, last = math.prod(q.shape[:-1]), q.shape[-1]
    rows, k = (last, leading) if columnwise else (leading, last)
    scale_inv = q.columnwise_scale_inv if columnwise else q.scale_inv
    return GemmOperand(
        data=data.contiguous(),  # row-major whatever strides the quantizer left (kernels read [rows, K])
        scale_inv=scale_inv.contiguous(),
        global_amax=(q.columnwise_amax if columnwise else q.amax) if q.fmt == "e2m1" else None,
        scheme=q.scheme,
        fmt=q.fmt,
        rows=rows,
        k=k,
        rotated=columnwise and q.hadamard,
    )


def check_gemm(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: Tensor | None) -> None:
    """The checks every scaled_mm implementation makes, with the same messages."""
    if a.family != b.family:
        raise ValueError(
            f"a is {a.scheme!r} and b is {b.scheme!r}: both operands of one GEMM need the same scaling family "
            f"(tensorwise, block1x128/block128x128, mxfp8 or nvfp4); quantize them with one recipe"
        )
    if a.k != b.k:
        raise ValueError(f"the operands' K differ: a is [{a.rows}, {a.k}], b is [{b.rows}, {b.k}] (out = A @ B^T)")
    if a.rotated != b.rotated:
        raise ValueError(
            "only one operand is Hadamard-rotated along K, so A @ B^T would be wrong; quantize both wgrad "
            "operands with hadamard=True, or neither"
        )
    if a.data.device != b.data.device:
        raise ValueError(f"the operands are on {a.data.device} and {b.data.device}; move them to one device")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported; use torch.bfloat16 or torch.float32")
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            raise TypeError(f"bias must be a floating-point tensor of shape ({b.rows},), got {bias!r}")
        if tuple(bias.shape) != (b.rows,) or bias.device != b.data.device:
            raise ValueError(
                f"bias must have shape ({b.rows},) (N, the rows of B) on {b.data.device}, "
                f"got {tuple(bias.shape)} on {bias.device}"
            )


def operand_values(q: Quantized, columnwise: bool) -> Tensor:
    """The operand as fp32 [rows, K], from fp8kernels.reference.dequantize (a rotated copy comes back unrotated)."""
    x = dequantize(q, columnwise=columnwise)
    x2d = x.reshape(-1, x.shape[-1])
    return x2d.T if columnwise else x2d


def scaled_mm(
    a: Quantized,
    b: Quantized,
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Tensor | None = None,
) -> Tensor:
    """out[M, N] = A @ B^T (+ bias) on dequantized values, accumulated in fp32, rounded once to out_dtype."""
    a_operand, b_operand = gemm_operand(a, a_columnwise, "a"), gemm_operand(b, b_columnwise, "b")
    check_gemm(a_operand, b_operand, out_dtype, bias)
    out = operand_values(a, a_columnwise) @ operand_values(b, b_columnwise).T
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


__all__ = ["OUT_DTYPES", "SCHEME_FAMILY", "GemmOperand", "check_gemm", "gemm_operand", "operand_values", "scaled_mm"]
