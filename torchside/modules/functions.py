"""The modules' autograd functions: FP8 linear (fprop, dgrad, wgrad), normalization, FP8-weight dequantize.

Shape legend: T tokens (all leading dims of the input, flattened), I in features, O out features.

FP8 linear y = x @ w.T + b, three GEMMs through `fp8kernels.gemm.scaled_mm` (out = A @ B^T, TN layout):

    fprop  y_TO  = x rowwise [T, I]      @ (w rowwise [O, I])^T       (bias in the epilogue)
    dgrad  dx_TI = dy rowwise [T, O]     @ (w columnwise [I, O])^T
    wgrad  dw_OI = dy columnwise [O, T]  @ (x columnwise [I, T])^T

y and dx are written in the activation dtype, dw in the weight's dtype, the bias grad is summed in
fp32. The forward keeps only the columnwise copies the backward reads (FP8 bytes, never x itself).
With FP8 off the modules call `torch.nn.functional.linear`: a plain matmul.

`on_backward_done` is how the first FP8 module of an fp8_autocast region runs the region's
backward DelayedScaling update: the module's first function in forward order calls it last.

Tensor parallelism (`LinearParallelism`, collectives from `torchside.parallel.tp_comm`):

    column  x -> [gather tokens (SP) | all-reduce dx (no SP)] -> GEMM with the local rows of w (+ local bias)
    row     GEMM with the local columns of w -> [reduce-scatter tokens (SP) | all-reduce] -> + bias

A column GEMM under sequence parallelism with a per-tensor recipe casts its local tokens (scale
from the amax reduced over the TP group) and all-gathers the FP8 bytes inside `_FP8Linear`; its
backward reduce-scatters dx. Other recipes gather in high precision and cast the full input.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fp8kernels.ops import norm_backward, norm_forward, scaled_mm
from fp8kernels.gemm_reference import OUT_DTYPES
from torchside.parallel.tp_comm import LinearParallelism, TPComm, has_per_tensor_scale, reduce_scatter_dim0
from torchside.quantization import QuantizedStorage, QuantizedTensor, Quantizer, reduce_amaxes
from torchside.recipe import Recipe

BackwardHook = Callable[[], None] | None
GradAmaxHook = Callable[[Tensor], None] | None


@dataclass(frozen=True)
class GemmQuantizers:
    """The quantizers of one GEMM's operands; `weight` is None when the weight is already an FP8 parameter.

    `record_grad_amax`: under torch.compile with DelayedScaling, called with dy's amax at the end of the GEMM's
    backward to record it and update the grad scale by tensor ops (the grad quantizer then records none).
    """

    input: Quantizer
    weight: Quantizer | None
    grad_output: Quantizer
    record_grad_amax: GradAmaxHook = None


def _columnwise_only(storage: QuantizedStorage) -> QuantizedStorage | None:
    """The columnwise copy (what dgrad/wgrad read) without the rowwise bytes, or None if there is none."""
    if not storage.columnwise:
        return None
    return dataclasses.replace(storage, rowwise_data=None, rowwise_scale_inv=None)


def _quantized(weight: Tensor, quantizer: Quantizer | None) -> QuantizedStorage:
    if isinstance(weight, QuantizedTensor):
        return weight.quantized_storage
    return quantizer.quantize_storage(weight)


def _quantize_operands(
    x_TI: Tensor, weight: Tensor, quantizers: GemmQuantizers
) -> tuple[QuantizedStorage, QuantizedStorage]:
    """(x, w) in FP8; where both amaxes are reduced over TP, one all-reduce carries the two."""
    if isinstance(weight, QuantizedTensor):  # an FP8 parameter: cast already
        return quantizers.input.quantize_storage(x_TI), weight.quantized_storage
    x_amax, w_amax = reduce_amaxes([(quantizers.input, x_TI), (quantizers.weight, weight)])
    x_fp8 = quantizers.input.quantize_storage(x_TI, amax=x_amax)
    return x_fp8, quantizers.weight.quantize_storage(weight, amax=w_amax)


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x, weight, bias, quantizers: GemmQuantizers, on_backward_done: BackwardHook, gather: TPComm | None
    ):
        x_TI = x.reshape(-1, x.shape[-1])
        x_fp8, w_fp8 = _quantize_operands(x_TI, weight, quantizers)
        x_shape = x.shape
        if gather is not None:  # x holds this rank's tokens: gather every rank's FP8 bytes
            x_fp8 = gather.gather_quantized_rows(x_fp8, columnwise=ctx.needs_input_grad[1])
            x_shape = (x.shape[0] * gather.size, *x.shape[1:])
        y_TO = scaled_mm(x_fp8.to_quantized(), w_fp8.to_quantized(), out_dtype=x.dtype, bias=bias)
        # Keep only what the backward reads: x for wgrad, w for dgrad.
        ctx.x_columnwise = _columnwise_only(x_fp8) if ctx.needs_input_grad[1] else None
        ctx.w_columnwise = _columnwise_only(w_fp8) if ctx.needs_input_grad[0] else None
        ctx.quantizers, ctx.on_backward_done, ctx.gather = quantizers, on_backward_done, gather
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x_shape, x.dtype, weight.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y_TO.reshape(*x_shape[:-1], y_TO.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        # ctx attributes, unlike saved tensors, live as long as the graph: drop them here so the FP8
        # copies are freed as soon as this GEMM's backward ends, not when the output is deleted.
        x_saved, w_saved, ctx.x_columnwise, ctx.w_columnwise = ctx.x_columnwise, ctx.w_columnwise, None, None
        dy_TO = dy.reshape(-1, dy.shape[-1])
        dy_fp8 = ctx.quantizers.grad_output.quantize_storage(dy_TO).to_quantized()
        dx = dw = dbias = None
        if ctx.needs_input_grad[0]:
            w_columnwise = w_saved.to_quantized()
            dx = scaled_mm(dy_fp8, w_columnwise, b_columnwise=True, out_dtype=ctx.x_dtype).reshape(ctx.x_shape)
            if ctx.gather is not None:
                dx = reduce_scatter_dim0(dx, ctx.gather.group)
        if ctx.needs_input_grad[1]:
            x_columnwise = x_saved.to_quantized()
            dw = scaled_mm(dy_fp8, x_columnwise, a_columnwise=True, b_columnwise=True, out_dtype=ctx.w_dtype)
        if ctx.needs_input_grad[2]:
            dbias = dy_TO.sum(dim=0, dtype=torch.float32).to(ctx.bias_dtype)
        if ctx.quantizers.record_grad_amax is not None:
            ctx.quantizers.record_grad_amax(dy_fp8.amax)
        if ctx.on_backward_done is not None:
            ctx.on_backward_done()
        return dx, dw, dbias, None, None, None


class _DequantizeWeight(torch.autograd.Function):
    """An FP8 parameter's values with FP8 off; its gradient passes straight to the parameter."""

    @staticmethod
    def forward(ctx, weight: QuantizedTensor):
        return weight.dequantize()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _local_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    quantizers: GemmQuantizers | None,
    on_backward_done: BackwardHook,
    gather: TPComm | None = None,
) -> Tensor:
    if quantizers is None:
        if isinstance(weight, QuantizedTensor):
            weight = _DequantizeWeight.apply(weight)
        return F.linear(x, weight, bias)
    if x.dtype not in OUT_DTYPES:
        raise TypeError(f"an FP8 linear writes float32 or bfloat16; got an input of {x.dtype}: cast the input")
    return _FP8Linear.apply(x, weight, bias, quantizers, on_backward_done, gather)


def gathers_fp8(parallel: LinearParallelism | None, recipe: Recipe) -> bool:
    """Whether this GEMM all-gathers its sequence-parallel input as FP8 bytes under `recipe`."""
    return (
        parallel is not None
        and parallel.mode == "column"
        and parallel.sequence_parallel
        and parallel.fp8_all_gather
        and has_per_tensor_scale(recipe)
    )


def linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    quantizers: GemmQuantizers | None,
    on_backward_done: BackwardHook = None,
    parallel: LinearParallelism | None = None,
) -> Tensor:
    """x @ weight.T + bias: FP8 GEMMs with `quantizers` (F.linear when None), split over TP by `parallel`."""
    if parallel is None:
        return _local_linear(x, weight, bias, quantizers, on_backward_done)
    comm = parallel.comm
    if parallel.mode == "column":
        if quantizers is not None and gathers_fp8(parallel, quantizers.input.recipe):
            return _local_linear(x, weight, bias, quantizers, on_backward_done, gather=comm)
        x = comm.gather_tokens(x) if parallel.sequence_parallel else comm.all_reduce_grad(x)
        return _local_linear(x, weight, bias, quantizers, on_backward_done)
    y = _local_linear(x, weight, None, quantizers, on_backward_done)  # partial sums over the split in-features
    y = comm.reduce_scatter_tokens(y) if parallel.sequence_parallel else comm.all_reduce(y)
    return y if bias is None else y + bias  # once, after the sum


class _Normalization(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, rms: bool, eps: float, zero_centered_gamma: bool, on_backward_done: BackwardHook):
        out, mean, rstd = norm_forward(x, weight, bias, rms=rms, eps=eps, zero_centered_gamma=zero_centered_gamma)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.zero_centered_gamma, ctx.on_backward_done = zero_centered_gamma, on_backward_done
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors  # mean: None for RMSNorm
        dx, dweight, dbias = norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma=ctx.zero_centered_gamma)
        if ctx.on_backward_done is not None:
            ctx.on_backward_done()
        return dx, dweight, dbias, None, None, None, None


def normalize(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    *,
    rms: bool,
    eps: float,
    zero_centered_gamma: bool,
    on_backward_done: BackwardHook = None,
) -> Tensor:
    """LayerNorm (or RMSNorm when `rms`) over the last dim through fp8kernels.norm, in x's dtype."""
    return _Normalization.apply(x, weight, bias, rms, eps, zero_centered_gamma, on_backward_done)


__all__ = ["BackwardHook", "GemmQuantizers", "GradAmaxHook", "gathers_fp8", "linear", "normalize"]
