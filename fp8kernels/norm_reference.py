"""The pure-torch spec of fp8kernels.norm: LayerNorm and RMSNorm, forward (with an optional fused FP8 cast), backward.

Over the last dim H of x, in fp32 whatever x's dtype (x is viewed as [R, H]):

    LayerNorm: mean = sum(x) / H,  rstd = 1 / sqrt(sum((x - mean)^2) / H + eps),  y = (x - mean) * rstd * g + b
    RMSNorm:   rstd = 1 / sqrt(sum(x^2) / H + eps),                               y = x * rstd * g

with g = weight, or weight + 1 when zero_centered_gamma (the stored weight is gamma - 1).
Backward, with xhat = (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm) and gdy = g * dy:

    dx = rstd * (gdy - xhat * mean(xhat * gdy) - mean(gdy))       (RMSNorm: without the last term)
    dweight = sum over rows of dy * xhat,  dbias = sum over rows of dy

The fused FP8 cast quantizes the fp32 y (before any rounding to out_dtype) for the next GEMM's
rowwise operand, with the bytes of fp8kernels.reference.quantize_tensorwise (a given delayed-scaling
scale) or quantize_blockwise (1x128). Current scaling cannot be fused into one pass: its scale
needs the amax of the whole output, known only after every row is normalized; the forward
returns the output and its amax instead, and the caller casts with scale_from_amax(amax).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from fp8kernels.reference import Quantized, quantize_blockwise, quantize_tensorwise, tensor_amax
from twinspec.checks import element_format
from twinspec.formats import FP8_FORMATS

NORM_DTYPES = (torch.float32, torch.bfloat16)
FUSED_CAST_SCHEMES = ("tensorwise", "block1x128")


@dataclass(frozen=True, eq=False)
class FusedCast:
    """The FP8 cast of the norm's fp32 output written in the same pass (the next GEMM's rowwise operand)."""

    fmt: str = "e4m3"  # "e4m3" | "e5m2"
    scheme: str = "tensorwise"  # "tensorwise": with `scale` (delayed scaling); "block1x128": scales per 128
    scale: Tensor | None = None  # fp32, one element: the delayed-scaling scale (tensorwise only)
    power_2_scale: bool = True  # block1x128 scales, as quantize_blockwise
    keep_output: bool = False  # also write the high-precision output


@dataclass
class NormForward:
    """What a norm forward returns; mean and rstd (fp32 [R]) are what the backward needs."""

    out: Tensor | None  # x's shape, out_dtype; None when a fused cast without keep_output replaced it
    mean: Tensor | None  # LayerNorm only
    rstd: Tensor
    # fp32 (1,), with return_amax or a tensorwise cast: the amax of what is (to be) cast, i.e. of fp32 y
    # for a fused tensorwise cast, else of `out` as stored (y itself when no output is written)
    amax: Tensor | None
    quantized: Quantized | None  # the fused cast's result


@dataclass
class NormBackward:
    """The gradients of a norm with respect to its input and parameters."""

    dx: Tensor  # x's shape and dtype
    dweight: Tensor  # weight's dtype
    dbias: Tensor | None  # LayerNorm only, weight's dtype


def check_norm_inputs(
    x: Tensor, weight: Tensor, bias: Tensor | None, out_dtype: torch.dtype | None, cast: FusedCast | None
) -> torch.dtype:
    """The checks both implementations make; returns the output dtype."""
    if not isinstance(x, Tensor) or x.dtype not in NORM_DTYPES or x.dim() == 0:
        got = f"{x.dtype} with {x.dim()} dims" if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32 or bfloat16 tensor with at least one dim, got {got}")
    hidden = x.shape[-1]
    for name, param in (("weight", weight), ("bias", bias)):
        if param is None and name == "bias":
            continue
        if not isinstance(param, Tensor) or param.dtype not in NORM_DTYPES:
            raise TypeError(f"{name} must be a float32 or bfloat16 tensor, got {param!r}")
        if tuple(param.shape) != (hidden,) or param.device != x.device:
            raise ValueError(
                f"{name} must have shape ({hidden},) (x's last dim) on {x.device}, "
                f"got {tuple(param.shape)} on {param.device}"
            )
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in NORM_DTYPES:
        raise TypeError(f"out_dtype={out_dtype} is not supported; use torch.float32 or torch.bfloat16")
    if cast is not None:
        element_format(cast.fmt, FP8_FORMATS)
        if cast.scheme not in FUSED_CAST_SCHEMES:
            raise ValueError(f"FusedCast scheme={cast.scheme!r}: use one of {FUSED_CAST_SCHEMES}")
        if (cast.scale is not None) != (cast.scheme == "tensorwise"):
            raise ValueError(
                "a tensorwise FusedCast needs scale= (delayed scaling; for current scaling call the norm with "
                "return_amax=True and quantize its output), and block1x128 takes no scale"
            )
        if cast.scale is not None and (cast.scale.dtype != torch.float32 or cast.scale.numel() != 1):
            raise TypeError(f"FusedCast scale must be an fp32 tensor of one element, got {cast.scale!r}")
    return out_dtype


def _effective_weight(weight: Tensor, zero_centered_gamma: bool) -> Tensor:
    return weight.float() + 1.0 if zero_centered_gamma else weight.float()


def _norm_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered_gamma: bool,
    out_dtype: torch.dtype | None, return_amax: bool, cast: FusedCast | None, rms: bool,
) -> NormForward:  # fmt: skip
    out_dtype = check_norm_inputs(x, weight, bias, out_dtype, cast)
    x2d = x.reshape(-1, x.shape[-1]).float()
    mean = None if rms else x2d.mean(dim=1)
    centered = x2d if rms else x2d - mean[:, None]
    rstd = torch.rsqrt((centered * centered).mean(dim=1) + eps)
    y = centered * rstd[:, None] * _effective_weight(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.float()
    y = y.reshape(x.shape)
    out = y.to(out_dtype) if cast is None or cast.keep_output else None
    quantized = amax = None
    if cast is not None and cast.scheme == "tensorwise":
        quantized = quantize_tensorwise(y, cast.fmt, scale=cast.scale)
        amax = quantized.amax
    elif cast is not None:
        quantized = quantize_blockwise(y, cast.fmt, (1, 128), power_2_scale=cast.power_2_scale)
    if return_amax and amax is None:
        amax = tensor_amax(y if out is None else out.float())
    return NormForward(out, mean, rstd, amax, quantized)


def layer_norm_forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    out_dtype: torch.dtype | None = None,
    return_amax: bool = False,
    cast: FusedCast | None = None,
) -> NormForward:
    """LayerNorm over the last dim, optionally with its amax (current scaling) or a fused FP8 cast."""
    return _norm_forward(x, weight, bias, eps, zero_centered_gamma, out_dtype, return_amax, cast, rms=False)


def rms_norm_forward(
    x: Tensor,
    weight: Tensor,
    *,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    out_dtype: torch.dtype | None = None,
    return_amax: bool = False,
    cast: FusedCast | None = None,
) -> NormForward:
    """RMSNorm over the last dim, optionally with its amax (current scaling) or a fused FP8 cast."""
    return _norm_forward(x, weight, None, eps, zero_centered_gamma, out_dtype, return_amax, cast, rms=True)


def check_backward_inputs(dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor) -> None:
    """dy shaped like x; mean and rstd fp32 with one value per row of x."""
    check_norm_inputs(x, weight, None, None, None)
    if not isinstance(dy, Tensor) or dy.dtype not in NORM_DTYPES or dy.shape != x.shape:
        raise ValueError(f"dy must be a float32 or bfloat16 tensor shaped like x {tuple(x.shape)}, got {dy!r:.80}")
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    for name, stat in (("mean", mean), ("rstd", rstd)):
        if stat is not None and (stat.dtype != torch.float32 or tuple(stat.shape) != (rows,)):
            raise ValueError(
                f"{name} must be the forward's fp32 [{rows}] statistics, got {stat.dtype} {tuple(stat.shape)}"
            )


def _norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor, zero_centered_gamma: bool
) -> NormBackward:
    check_backward_inputs(dy, x, weight, mean, rstd)
    x2d, dy2d = x.reshape(-1, x.shape[-1]).float(), dy.reshape(-1, x.shape[-1]).float()
    xhat = (x2d if mean is None else x2d - mean[:, None]) * rstd[:, None]
    gdy = _effective_weight(weight, zero_centered_gamma) * dy2d
    inner = gdy - xhat * (xhat * gdy).mean(dim=1, keepdim=True)
    if mean is not None:
        inner = inner - gdy.mean(dim=1, keepdim=True)
    dx = (inner * rstd[:, None]).reshape(x.shape).to(x.dtype)
    dweight = (dy2d * xhat).sum(dim=0).to(weight.dtype)
    dbias = None if mean is None else dy2d.sum(dim=0).to(weight.dtype)
    return NormBackward(dx, dweight, dbias)


def layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, *, zero_centered_gamma: bool = False
) -> NormBackward:
    """dx, dweight and dbias of LayerNorm from the forward's mean and rstd."""
    return _norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma)


def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, *, zero_centered_gamma: bool = False
) -> NormBackward:
    """dx and dweight of RMSNorm from the forward's rstd."""
    return _norm_backward(dy, x, weight, None, rstd, zero_centered_gamma)


__all__ = [
    "FusedCast",
    "NormBackward",
    "NormForward",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm_backward",
    "rms_norm_forward",
]
