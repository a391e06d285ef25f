"""The quantize, scaled-GEMM and norm entry points as torch.library custom ops: torch.compile sees one op per kernel.

`quantize(name, x, backend, **kwargs)`, `quantize_tensorwise_split`, `scaled_mm(a, b, ...)`, `grouped_scaled_mm`,
`norm_forward` and `norm_backward` take and
return what the kernel functions do (`fp8kernels.reference.Quantized` for the quantized tensors). Eagerly they
call those functions directly: the same bytes, and no custom-op dispatch on the host (an eager FP8 step is
host-bound already, issue 32). While torch.compile traces (`torch.compiler.is_compiling()`) they call the ops
`shardbridge::quantize_tensorwise`, `quantize_tensorwise_split`, `quantize_blockwise`, `quantize_mxfp8`,
`quantize_nvfp4`, `scaled_mm`, `grouped_scaled_mm`, `norm_forward` and `norm_backward`, whose implementations
call the same functions. Quantized operands cross an op boundary as plain tensors (data, scale_inv, the
columnwise copies, amax) plus constant metadata (scheme, format, shape); the Quantized objects are built on the
traced side. Which backend runs an op (Triton, the interpreter, the torch
reference) is decided when it runs, as eagerly.

An op's fake implementation is its `*_layout` function: every output's shape, dtype and strides. The real
implementation returns its outputs so laid out (Inductor asserts both; the layout is computed on meta tensors,
allocating nothing): an absent buffer is an empty placeholder (an op returns tensors, never None), and a
reference result that is a transposed view, or one sharing memory with an input, is copied into the layout the
fake promises (the Triton kernels write it already).
"""

from __future__ import annotations

import functools
import importlib
import math
from types import ModuleType

import torch
from torch import Tensor

from fp8kernels import gemm, grouped_gemm, norm
from fp8kernels._backend import Backend, backend_for
from fp8kernels.formats import row_block_scales
from fp8kernels.reference import Quantized

QuantizeOutputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]  # data, scale_inv, columnwise ones, amax
_BUFFERS = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax")
NVFP4Outputs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]  # QuantizeOutputs, then columnwise_amax
_NVFP4_BUFFERS = (*_BUFFERS, "columnwise_amax")


@functools.cache
def implementation(backend: Backend) -> ModuleType:
    """The module whose quantize functions run on `backend` (they share names and signatures)."""
    return importlib.import_module("fp8kernels.reference" if backend is Backend.REFERENCE else "fp8kernels.quantize")


def _backend(name: str, device: torch.device) -> Backend:
    """An op's `backend` argument: a Backend value, or "" for the device's, read when the op runs."""
    return Backend(name) if name else backend_for(device)


# ----------------------------------------------------------------------------- output layouts


def _absent(device: torch.device) -> Tensor:
    """The placeholder of a buffer nobody asked for (an op returns tensors, never None)."""
    return torch.empty(0, dtype=torch.uint8, device=device)


def _buffer(wanted: bool, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=device) if wanted else _absent(device)


def _matrix(x: Tensor) -> tuple[int, int]:
    return math.prod(x.shape[:-1]), x.shape[-1]


def _tensorwise_layout(x: Tensor, rowwise: bool, columnwise: bool) -> QuantizeOutputs:
    (M, K), device = _matrix(x), x.device
    return (
        _buffer(rowwise, (M, K), torch.uint8, device),
        _buffer(rowwise, (1,), torch.float32, device),
        _buffer(columnwise, (K, M), torch.uint8, device),
        _buffer(columnwise, (1,), torch.float32, device),
        _buffer(True, (1,), torch.float32, device),
    )


def _blockwise_layout(
    x: Tensor, block: list[int], rowwise: bool, columnwise: bool, backend: Backend
) -> QuantizeOutputs:
    (M, K), device = _matrix(x), x.device

    def scales(wanted: bool, rows: int, cols: int) -> Tensor:
        blocks = math.ceil(cols / 128)
        if not wanted:
            return _absent(device)
        if tuple(block) == (128, 128):
            return torch.empty(math.ceil(rows / 128), blocks, device=device)
        if backend is Backend.REFERENCE:  # row-major; the Triton kernel writes 1x128 scales rows-contiguous
            return torch.empty(rows, blocks, device=device)
        return row_block_scales(rows, blocks, device)

    return (
        _buffer(rowwise, (M, K), torch.uint8, device),
        scales(rowwise, M, K),
        _buffer(columnwise, (K, M), torch.uint8, device),
        scales(columnwise, K, M),
        _absent(device),
    )


def _mxfp8_layout(x: Tensor, rowwise: bool, columnwise: bool) -> QuantizeOutputs:
    (M, K), device = _matrix(x), x.device
    return (
        _buffer(rowwise, (M, K), torch.uint8, device),
        _buffer(rowwise, (M, K // 32), torch.uint8, device),
        _buffer(columnwise, (K, M), torch.uint8, device),
        _buffer(columnwise, (K, M // 32), torch.uint8, device),
        _absent(device),
    )


def _nvfp4_layout(x: Tensor, block: list[int], rowwise: bool, columnwise: bool) -> NVFP4Outputs:
    """Two e2m1 codes a byte; an e4m3 scale per 1x16 block, or per 16x16 block ([16, 16])."""
    (M, K), device = _matrix(x), x.device

    def scale_rows(rows: int) -> int:
        return math.ceil(rows / 16) if block[0] == 16 else rows

    return (
        _buffer(rowwise, (M, K // 2), torch.uint8, device),
        _buffer(rowwise, (scale_rows(M), K // 16), torch.uint8, device),
        _buffer(columnwise, (K, M // 2), torch.uint8, device),
        _buffer(columnwise, (scale_rows(K), M // 16), torch.uint8, device),
        _buffer(True, (1,), torch.float32, device),
        _buffer(columnwise, (1,), torch.float32, device),
    )


def _shares_memory(a: Tensor, b: Tensor) -> bool:
    return b.numel() > 0 and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _conform(
    results: list[Tensor | None],
    layout: tuple[Tensor, ...],
    device: torch.device,
    inputs: tuple[Tensor | None, ...] = (),
) -> tuple[Tensor, ...]:
    """A kernel's results on `device` as an op's outputs: each in the strides of its `layout` (meta tensors), at
    the start of memory of its own (no other output's, no input's); a placeholder where the layout has none."""
    outputs: list[Tensor] = []
    for result, like in zip(results, layout, strict=True):
        laid_out = result is not None and (result.stride(), result.storage_offset()) == (like.stride(), 0)
        if not laid_out or like.numel() == 0 or any(
            _shares_memory(result, t) for t in (*outputs, *inputs) if t is not None
        ):
            copy = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=device)
            result = copy if like.numel() == 0 else copy.copy_(result)
        outputs.append(result)
    return tuple(outputs)


def _as_outputs(q: Quantized, layout: QuantizeOutputs, device: torch.device) -> QuantizeOutputs:
    return _conform([getattr(q, name) for name in _BUFFERS], layout, device)


def _as_quantized(scheme: str, fmt: str, shape: tuple[int, ...], outputs: QuantizeOutputs | NVFP4Outputs,
                  rowwise: bool, columnwise: bool, has_amax: bool, hadamard: bool = False) -> Quantized:  # fmt: skip
    """An op's outputs as the kernel functions' result: None for the placeholders."""
    data, scale_inv, columnwise_data, columnwise_scale_inv, amax, *nvfp4_columnwise_amax = outputs
    return Quantized(
        scheme, fmt, shape,
        data=data if rowwise else None, scale_inv=scale_inv if rowwise else None,
        columnwise_data=columnwise_data if columnwise else None,
        columnwise_scale_inv=columnwise_scale_inv if columnwise else None,
        amax=amax if has_amax else None,
        columnwise_amax=nvfp4_columnwise_amax[0] if nvfp4_columnwise_amax and columnwise else None,
        hadamard=hadamard,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the ops


@torch.library.custom_op("shardbridge::quantize_tensorwise", mutates_args=())
def _quantize_tensorwise(
    x: Tensor, fmt: str, scale: Tensor | None, amax: Tensor | None, power_2_scale: bool, amax_epsilon: float,
    rowwise: bool, columnwise: bool, backend: str,
) -> QuantizeOutputs:  # fmt: skip
    q = implementation(_backend(backend, x.device)).quantize_tensorwise(
        x, fmt, scale, amax=amax, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
        rowwise=rowwise, columnwise=columnwise,
    )  # fmt: skip
    return _as_outputs(q, _tensorwise_layout(x.to("meta"), rowwise, columnwise), x.device)


@_quantize_tensorwise.register_fake
def _(x, fmt, scale, amax, power_2_scale, amax_epsilon, rowwise, columnwise, backend):
    return _tensorwise_layout(x, rowwise, columnwise)


def _tensorwise_split_layout(x: Tensor, splits: list[int], rowwise: bool, columnwise: bool) -> list[Tensor]:
    """Every group's _tensorwise_layout, one after the other (an op returns one flat list)."""
    groups = x.reshape(-1, x.shape[-1]).split(splits)
    return [t for part in groups for t in _tensorwise_layout(part, rowwise, columnwise)]


@torch.library.custom_op("shardbridge::quantize_tensorwise_split", mutates_args=())
def _quantize_tensorwise_split(
    x: Tensor, splits: list[int], fmt: str, scales: Tensor | None, amaxes: Tensor | None, power_2_scale: bool,
    amax_epsilon: float, rowwise: bool, columnwise: bool, backend: str,
) -> list[Tensor]:  # fmt: skip
    """The buffers of each group's quantize_tensorwise, in order; the kernel's groups share buffers: copied apart."""
    results = implementation(_backend(backend, x.device)).quantize_tensorwise_split(
        x, splits, fmt, scales, amaxes=amaxes, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
        rowwise=rowwise, columnwise=columnwise,
    )  # fmt: skip
    buffers = [getattr(q, name) for q in results for name in _BUFFERS]
    layout = _tensorwise_split_layout(x.to("meta"), splits, rowwise, columnwise)
    return list(_conform(buffers, tuple(layout), x.device, (x, scales, amaxes)))


@_quantize_tensorwise_split.register_fake
def _(x, splits, fmt, scales, amaxes, power_2_scale, amax_epsilon, rowwise, columnwise, backend):
    return _tensorwise_split_layout(x, splits, rowwise, columnwise)


@torch.library.custom_op("shardbridge::quantize_blockwise", mutates_args=())
def _quantize_blockwise(
    x: Tensor, fmt: str, block: list[int], power_2_scale: bool, rowwise: bool, columnwise: bool, backend: str
) -> QuantizeOutputs:
    chosen = _backend(backend, x.device)
    q = implementation(chosen).quantize_blockwise(
        x, fmt, tuple(block), power_2_scale=power_2_scale, rowwise=rowwise, columnwise=columnwise
    )
    return _as_outputs(q, _blockwise_layout(x.to("meta"), block, rowwise, columnwise, chosen), x.device)


@_quantize_blockwise.register_fake
def _(x, fmt, block, power_2_scale, rowwise, columnwise, backend):
    return _blockwise_layout(x, block, rowwise, columnwise, _backend(backend, x.device))


@torch.library.custom_op("shardbridge::quantize_mxfp8", mutates_args=())
def _quantize_mxfp8(
    x: Tensor, fmt: str, scale_rounding: str, rowwise: bool, columnwise: bool, backend: str
) -> QuantizeOutputs:
    q = implementation(_backend(backend, x.device)).quantize_mxfp8(
        x, fmt, scale_rounding=scale_rounding, rowwise=rowwise, columnwise=columnwise
    )
    return _as_outputs(q, _mxfp8_layout(x.to("meta"), rowwise, columnwise), x.device)


@_quantize_mxfp8.register_fake
def _(x, fmt, scale_rounding, rowwise, columnwise, backend):
    return _mxfp8_layout(x, rowwise, columnwise)


@torch.library.custom_op("shardbridge::quantize_nvfp4", mutates_args=())
def _quantize_nvfp4(
    x: Tensor, block: list[int], hadamard: bool, stochastic_seed: Tensor | None, global_amax: Tensor | None,
    rowwise: bool, columnwise: bool, backend: str,
) -> NVFP4Outputs:  # fmt: skip
    q = implementation(_backend(backend, x.device)).quantize_nvfp4(
        x, block=tuple(block), hadamard=hadamard, stochastic_seed=stochastic_seed, rowwise=rowwise,
        columnwise=columnwise, global_amax=global_amax,
    )  # fmt: skip
    layout = _nvfp4_layout(x.to("meta"), block, rowwise, columnwise)
    return _conform([getattr(q, name) for name in _NVFP4_BUFFERS], layout, x.device, (global_amax,))


@_quantize_nvfp4.register_fake
def _(x, block, hadamard, stochastic_seed, global_amax, rowwise, columnwise, backend):
    return _nvfp4_layout(x, block, rowwise, columnwise)


def _operand(data: Tensor, scale_inv: Tensor, amax: Tensor | None, scheme: str, fmt: str, shape: list[int],
             columnwise: bool, hadamard: bool) -> Quantized:  # fmt: skip
    """One GEMM operand as a Quantized holding only the copy the GEMM reads."""
    read, unread = ("columnwise_", "") if columnwise else ("", "columnwise_")
    buffers = {f"{read}data": data, f"{read}scale_inv": scale_inv, f"{unread}data": None, f"{unread}scale_inv": None}
    return Quantized(
        scheme, fmt, tuple(shape), **buffers, amax=None if columnwise else amax,
        columnwise_amax=amax if columnwise else None, hadamard=hadamard,
    )  # fmt: skip


@torch.library.custom_op("shardbridge::scaled_mm", mutates_args=())
def _scaled_mm(
    a_data: Tensor, a_scale_inv: Tensor, a_amax: Tensor | None, a_scheme: str, a_fmt: str, a_shape: list[int],
    a_columnwise: bool, a_hadamard: bool,
    b_data: Tensor, b_scale_inv: Tensor, b_amax: Tensor | None, b_scheme: str, b_fmt: str, b_shape: list[int],
    b_columnwise: bool, b_hadamard: bool,
    out_dtype: torch.dtype, bias: Tensor | None,
) -> Tensor:  # fmt: skip
    a = _operand(a_data, a_scale_inv, a_amax, a_scheme, a_fmt, a_shape, a_columnwise, a_hadamard)
    b = _operand(b_data, b_scale_inv, b_amax, b_scheme, b_fmt, b_shape, b_columnwise, b_hadamard)
    return gemm.scaled_mm(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias)


def _operand_rows(shape: list[int], columnwise: bool) -> int:
    return shape[-1] if columnwise else math.prod(shape[:-1])


@_scaled_mm.register_fake
def _(a_data, a_scale_inv, a_amax, a_scheme, a_fmt, a_shape, a_columnwise, a_hadamard,
      b_data, b_scale_inv, b_amax, b_scheme, b_fmt, b_shape, b_columnwise, b_hadamard, out_dtype, bias):  # fmt: skip
    rows = (_operand_rows(a_shape, a_columnwise), _operand_rows(b_shape, b_columnwise))
    return torch.empty(rows, dtype=out_dtype, device=a_data.device)


def _operands(data: list[Tensor], scale_inv: list[Tensor], amax: list[Tensor], scheme: str, fmt: str,
              shapes: list[int], columnwise: bool, hadamard: bool) -> list[Quantized]:  # fmt: skip
    """The groups' operands of grouped_scaled_mm: `shapes` holds each group's 2-D shape, `amax` empty placeholders
    where a scheme has none."""
    return [
        _operand(d, s, a if a.numel() else None, scheme, fmt, shapes[2 * g : 2 * g + 2], columnwise, hadamard)
        for g, (d, s, a) in enumerate(zip(data, scale_inv, amax, strict=True))
    ]


def _grouped_layout(a_shapes: list[int], a_columnwise: bool, b_shapes: list[int], b_columnwise: bool,
                    out_dtype: torch.dtype, device: torch.device) -> list[Tensor]:  # fmt: skip
    rows = [
        (_operand_rows(a_shapes[i : i + 2], a_columnwise), _operand_rows(b_shapes[i : i + 2], b_columnwise))
        for i in range(0, len(a_shapes), 2)
    ]
    return [torch.empty(shape, dtype=out_dtype, device=device) for shape in rows]


@torch.library.custom_op("shardbridge::grouped_scaled_mm", mutates_args=())
def _grouped_scaled_mm(
    a_data: list[Tensor], a_scale_inv: list[Tensor], a_amax: list[Tensor], a_scheme: str, a_fmt: str,
    a_shapes: list[int], a_columnwise: bool, a_hadamard: bool,
    b_data: list[Tensor], b_scale_inv: list[Tensor], b_amax: list[Tensor], b_scheme: str, b_fmt: str,
    b_shapes: list[int], b_columnwise: bool, b_hadamard: bool,
    out_dtype: torch.dtype, bias: list[Tensor],
) -> list[Tensor]:  # fmt: skip
    """fp8kernels.grouped_gemm.grouped_scaled_mm of each group's operands (shapes: [rows, cols] per group; bias:
    one per group, or none)."""
    a = _operands(a_data, a_scale_inv, a_amax, a_scheme, a_fmt, a_shapes, a_columnwise, a_hadamard)
    b = _operands(b_data, b_scale_inv, b_amax, b_scheme, b_fmt, b_shapes, b_columnwise, b_hadamard)
    results = grouped_gemm.grouped_scaled_mm(
        a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias or None
    )
    device = a_data[0].device
    layout = _grouped_layout(a_shapes, a_columnwise, b_shapes, b_columnwise, out_dtype, torch.device("meta"))
    return list(_conform(results, tuple(layout), device))


@_grouped_scaled_mm.register_fake
def _(a_data, a_scale_inv, a_amax, a_scheme, a_fmt, a_shapes, a_columnwise, a_hadamard,
      b_data, b_scale_inv, b_amax, b_scheme, b_fmt, b_shapes, b_columnwise, b_hadamard, out_dtype, bias):  # fmt: skip
    return _grouped_layout(a_shapes, a_columnwise, b_shapes, b_columnwise, out_dtype, a_data[0].device)


def _run_norm_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, rms: bool, eps: float, zero_centered_gamma: bool
) -> norm.NormForward:
    if rms:
        return norm.rms_norm_forward(x, weight, eps=eps, zero_centered_gamma=zero_centered_gamma)
    return norm.layer_norm_forward(x, weight, bias, eps=eps, zero_centered_gamma=zero_centered_gamma)


def _run_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor, zero_centered_gamma: bool
) -> norm.NormBackward:
    if mean is None:
        return norm.rms_norm_backward(dy, x, weight, rstd, zero_centered_gamma=zero_centered_gamma)
    return norm.layer_norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma=zero_centered_gamma)


def _norm_forward_layout(x: Tensor, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    rows, device = _matrix(x)[0], x.device
    return (
        torch.empty(x.shape, dtype=x.dtype, device=device),
        _buffer(not rms, (rows,), torch.float32, device),
        torch.empty(rows, dtype=torch.float32, device=device),
    )


@torch.library.custom_op("shardbridge::norm_forward", mutates_args=())
def _norm_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, rms: bool, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, mean (a placeholder for RMSNorm), rstd) of fp8kernels.norm's layer_norm_forward / rms_norm_forward."""
    result = _run_norm_forward(x, weight, bias, rms, eps, zero_centered_gamma)
    return _conform([result.out, result.mean, result.rstd], _norm_forward_layout(x.to("meta"), rms), x.device)


@_norm_forward.register_fake
def _(x, weight, bias, rms, eps, zero_centered_gamma):
    return _norm_forward_layout(x, rms)


def _norm_backward_layout(x: Tensor, weight: Tensor, rms: bool) -> tuple[Tensor, Tensor, Tensor]:
    return (
        torch.empty(x.shape, dtype=x.dtype, device=x.device),
        torch.empty(weight.shape, dtype=weight.dtype, device=x.device),
        _buffer(not rms, tuple(weight.shape), weight.dtype, x.device),
    )


@torch.library.custom_op("shardbridge::norm_backward", mutates_args=())
def _norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dweight, dbias (a placeholder for RMSNorm, mean None)) of fp8kernels.norm's backward functions."""
    grads = _run_norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma)
    layout = _norm_backward_layout(x.to("meta"), weight.to("meta"), mean is None)
    return _conform([grads.dx, grads.dweight, grads.dbias], layout, x.device)


@_norm_backward.register_fake
def _(dy, x, weight, mean, rstd, zero_centered_gamma):
    return _norm_backward_layout(x, weight, mean is None)


# ----------------------------------------------------------------------------- what the callers call


def quantize(name: str, x: Tensor, backend: Backend | None = None, **kwargs) -> Quantized:
    """`fp8kernels.<reference|quantize>.<name>(x, **kwargs)` on `backend` (default: x's device's); an op
    while torch.compile traces."""
    if not torch.compiler.is_compiling():
        return getattr(implementation(backend or backend_for(x.device)), name)(x, **kwargs)
    chosen = "" if backend is None else backend.value
    rowwise, columnwise = kwargs.get("rowwise", True), kwargs.get("columnwise", False)
    fmt, shape = kwargs.get("fmt", "e4m3"), tuple(x.shape)
    if name == "quantize_tensorwise":
        outputs = _quantize_tensorwise(
            x, fmt, kwargs.get("scale"), kwargs.get("amax"), kwargs.get("power_2_scale", False),
            kwargs.get("amax_epsilon", 0.0), rowwise, columnwise, chosen,
        )  # fmt: skip
        return _as_quantized("tensorwise", fmt, shape, outputs, rowwise, columnwise, has_amax=True)
    if name == "quantize_blockwise":
        block = list(kwargs.get("block", (1, 128)))
        outputs = _quantize_blockwise(x, fmt, block, kwargs.get("power_2_scale", True), rowwise, columnwise, chosen)
        return _as_quantized(f"block{block[0]}x{block[1]}", fmt, shape, outputs, rowwise, columnwise, has_amax=False)
    if name == "quantize_mxfp8":
        outputs = _quantize_mxfp8(x, fmt, kwargs.get("scale_rounding", "up"), rowwise, columnwise, chosen)
        return _as_quantized("mxfp8", fmt, shape, outputs, rowwise, columnwise, has_amax=False)
    if name == "quantize_nvfp4":
        block, hadamard = list(kwargs.get("block", (1, 16))), kwargs.get("hadamard", False)
        seed = kwargs.get("stochastic_seed")
        if isinstance(seed, int):  # the op takes a tensor; the kernels read an int mod 2^32 (formats.stochastic_key)
            seed = torch.full((1,), seed & 0xFFFFFFFF, dtype=torch.int64, device=x.device)
        outputs = _quantize_nvfp4(x, block, hadamard, seed, kwargs.get("global_amax"), rowwise, columnwise, chosen)
        scheme = f"nvfp4_{block[0]}x{block[1]}"
        return _as_quantized(scheme, "e2m1", shape, outputs, rowwise, columnwise, has_amax=True, hadamard=hadamard)
    raise ValueError(f"{name} is not one of fp8kernels' quantize functions (quantize_tensorwise, _blockwise, ...)")


def quantize_tensorwise_split(
    x: Tensor, m_splits: list[int], backend: Backend | None = None, **kwargs
) -> list[Quantized]:
    """`fp8kernels.<reference|quantize>.quantize_tensorwise_split(x, m_splits, **kwargs)` on `backend` (default:
    x's device's); an op while torch.compile traces."""
    if not torch.compiler.is_compiling():
        return implementation(backend or backend_for(x.device)).quantize_tensorwise_split(x, m_splits, **kwargs)
    rowwise, columnwise, fmt = kwargs.get("rowwise", True), kwargs.get("columnwise", False), kwargs.get("fmt", "e4m3")
    outputs = _quantize_tensorwise_split(
        x, list(m_splits), fmt, kwargs.get("scales"), kwargs.get("amaxes"), kwargs.get("power_2_scale", False),
        kwargs.get("amax_epsilon", 0.0), rowwise, columnwise, "" if backend is None else backend.value,
    )  # fmt: skip
    buffers = len(_BUFFERS)
    return [
        _as_quantized("tensorwise", fmt, (m, x.shape[-1]), tuple(outputs[buffers * g : buffers * (g + 1)]),
                      rowwise, columnwise, has_amax=True)  # fmt: skip
        for g, m in enumerate(m_splits)
    ]


def scaled_mm(
    a: Quantized,
    b: Quantized,
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Tensor | None = None,
) -> Tensor:
    """`fp8kernels.gemm.scaled_mm`; an op while torch.compile traces (the operands' buffers cross as tensors)."""
    if not torch.compiler.is_compiling():
        return gemm.scaled_mm(
            a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias
        )
    return _scaled_mm(*_operand_arguments(a, a_columnwise), *_operand_arguments(b, b_columnwise), out_dtype, bias)


def grouped_scaled_mm(
    a: list[Quantized],
    b: list[Quantized],
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: list[Tensor] | None = None,
    out: list[Tensor] | None = None,
) -> list[Tensor]:
    """`fp8kernels.grouped_gemm.grouped_scaled_mm` (2-D operands); an op while torch.compile traces, whose
    results are then copied into `out` (an op writes no caller's views)."""
    if not torch.compiler.is_compiling():
        return grouped_gemm.grouped_scaled_mm(
            a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias, out=out
        )
    results = _grouped_scaled_mm(
        *_group_arguments(a, a_columnwise), *_group_arguments(b, b_columnwise), out_dtype, list(bias or [])
    )
    if out is None:
        return results
    return [o.copy_(result) for o, result in zip(out, results, strict=True)]


def _group_arguments(operands: list[Quantized], columnwise: bool) -> tuple:
    """The grouped op's arguments for one side: each group's _operand_arguments as lists, shapes flattened."""
    if not operands or any(len(q.shape) != 2 for q in operands):
        raise ValueError("grouped_scaled_mm under torch.compile takes a non-empty list of 2-D operands")
    per_group = [_operand_arguments(q, columnwise) for q in operands]
    data, scale_inv, amax, scheme, fmt, _, _, hadamard = per_group[0]
    amaxes = [_absent(data.device) if group[2] is None else group[2] for group in per_group]
    shapes = [size for group in per_group for size in group[5]]
    return [g[0] for g in per_group], [g[1] for g in per_group], amaxes, scheme, fmt, shapes, columnwise, hadamard


def _operand_arguments(q: Quantized, columnwise: bool) -> tuple:
    """The op's arguments for the copy of `q` a GEMM reads (None buffers left to the op's checks)."""
    data = q.columnwise_data if columnwise else q.data
    scale_inv = q.columnwise_scale_inv if columnwise else q.scale_inv
    if data is None:
        raise ValueError(f"this operand has no {'columnwise' if columnwise else 'rowwise'} copy; quantize with it")
    amax = (q.columnwise_amax if columnwise else q.amax) if q.fmt == "e2m1" else None
    return data, scale_inv, amax, q.scheme, q.fmt, list(q.shape), columnwise, q.hadamard


def norm_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, *, rms: bool, eps: float, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor | None, Tensor]:
    """(out, mean or None for RMSNorm, rstd) of LayerNorm / RMSNorm over the last dim (fp8kernels.norm); an op
    while torch.compile traces."""
    if torch.compiler.is_compiling():
        out, mean, rstd = _norm_forward(x, weight, bias, rms, eps, zero_centered_gamma)
        return out, None if rms else mean, rstd
    result = _run_norm_forward(x, weight, bias, rms, eps, zero_centered_gamma)
    return result.out, result.mean, result.rstd


def norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor, *, zero_centered_gamma: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dx, dweight, dbias or None for RMSNorm) from the forward's mean (None: RMSNorm) and rstd; an op while
    torch.compile traces."""
    if torch.compiler.is_compiling():
        dx, dweight, dbias = _norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma)
        return dx, dweight, None if mean is None else dbias
    grads = _run_norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma)
    return grads.dx, grads.dweight, grads.dbias


__all__ = [
    "grouped_scaled_mm",
    "implementation",
    "norm_backward",
    "norm_forward",
    "quantize",
    "quantize_tensorwise_split",
    "scaled_mm",
]
