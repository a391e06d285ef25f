"""The aten ops a QuantizedTensor runs on its bytes, and the one fallback that dequantizes.

The table is an allow-list of what FSDP2, DCP and autograd do to parameters: aliases and
no-op views, dim-0 slices and splits (on scale-block boundaries), copies, moves and new
empty tensors. Any other op runs on dequantized values through `dequantize_fallback`, which
warns once per op and counts every call in FALLBACK_CALLS (tests assert it stays at 0 on
the FSDP2 and checkpoint paths). In-place ops on a QuantizedTensor never fall back: they
would write into a temporary copy.
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Callable, Iterable

import torch
from torch.utils._pytree import tree_flatten, tree_map_only

from torchside.quantization.storage import empty_storage

aten = torch.ops.aten
Handler = Callable[..., object]  # (cls, func, args, kwargs) -> result

_HANDLERS: dict[torch._ops.OpOverload, Handler] = {}
FALLBACK_CALLS: Counter[str] = Counter()  # op name -> calls that ran on dequantized values
_WARNED: set[str] = set()


def implements(funcs: Iterable[torch._ops.OpOverload]) -> Callable[[Handler], Handler]:
    """Register a handler for these aten overloads; a second registration of an op is a bug."""

    def register(handler: Handler) -> Handler:
        for func in funcs:
            if func in _HANDLERS:
                raise RuntimeError(f"{func} already runs {_HANDLERS[func].__name__}; refusing {handler.__name__}")
            _HANDLERS[func] = handler
        return handler

    return register


def dispatch(cls: type, func: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """Run `func` for QuantizedTensor class `cls`: its handler, else the dequantize fallback."""
    handler = _HANDLERS.get(func, dequantize_fallback)
    return handler(cls, func, args, kwargs)


def dequantize_fallback(cls: type, func: torch._ops.OpOverload, args: tuple, kwargs: dict):
    """Run `func` on dequantized copies of every QuantizedTensor argument (warned once per op, counted)."""
    bound = _bind(func, args, kwargs)
    for argument in func._schema.arguments:
        written = argument.alias_info is not None and argument.alias_info.is_write
        if written and any(isinstance(t, cls) for t in tree_flatten(bound.get(argument.name))[0]):
            raise TypeError(
                f"{func} writes into a QuantizedTensor, which would only change a dequantized copy: "
                "dequantize() it, run the op, and quantize the result"
            )
    name = str(func)
    FALLBACK_CALLS[name] += 1
    if name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"{name} has no QuantizedTensor implementation: it ran on dequantized values "
            "(warned once per op; torchside.quantization.FALLBACK_CALLS counts the calls)",
            stacklevel=3,
        )
    args, kwargs = tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
    return func(*args, **kwargs)


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict:
    """Every schema argument by name: given positionally, by keyword, or its default."""
    schema = func._schema.arguments
    bound = {a.name: a.default_value for a in schema if a.has_default_value()}
    bound.update(zip((a.name for a in schema), args, strict=False))  # trailing defaults are omitted
    bound.update(kwargs)
    return bound


def _rows(t, start: int, stop: int):
    """A view of indices [start, stop) of dim 0 (whole matrix rows; scale blocks left intact)."""
    per_index = t.rows_per_index()
    storage = t.quantized_storage.slice_rows(start * per_index, stop * per_index)
    return t.like(storage, (stop - start, *t.shape[1:]))


# ----------------------------------------------------------------------------- aliases and views


@implements([aten.detach.default, aten.alias.default])
def _alias(cls, func, args, kwargs):
    t = args[0]
    return t.like(t.quantized_storage)


@implements([aten.view.default, aten._unsafe_view.default])
def _view(cls, func, args, kwargs):
    # Any shape with the same elements: the buffers keep their [M, K] layout, only the label changes.
    t, size = args[0], _bind(func, args, kwargs)["size"]
    return t.like(t.quantized_storage, tuple(torch.empty(t.shape, device="meta").view(size).shape))


@implements([aten.as_strided.default])
def _as_strided(cls, func, args, kwargs):
    a = _bind(func, args, kwargs)
    t = a["self"]
    if tuple(a["size"]) == tuple(t.shape) and tuple(a["stride"]) == t.stride() and not a["storage_offset"]:
        return t.like(t.quantized_storage)
    return dequantize_fallback(cls, func, args, kwargs)


@implements([aten.slice.Tensor])
def _slice(cls, func, args, kwargs):
    a = _bind(func, args, kwargs)
    t = a["self"]
    dim = a["dim"] % t.dim()
    start, stop, step = slice(a["start"], a["end"], a["step"]).indices(t.shape[dim])
    stop = max(stop, start)
    if (start, stop, step) == (0, t.shape[dim], 1):
        return t.like(t.quantized_storage)
    if dim == 0 and step == 1:
        return _rows(t, start, stop)
    return dequantize_fallback(cls, func, args, kwargs)


@implements([aten.split.Tensor, aten.split_with_sizes.default])
def _split(cls, func, args, kwargs):
    a = _bind(func, args, kwargs)
    t = a["self"]
    if a["dim"] % t.dim() != 0:
        return dequantize_fallback(cls, func, args, kwargs)
    n = t.shape[0]
    if "split_sizes" in a:
        sizes = list(a["split_sizes"])
        if sum(sizes) != n:
            raise ValueError(f"split sizes {sizes} do not add up to dim 0 of size {n}")
    else:
        sizes = [a["split_size"]] * max(1, math.ceil(n / max(a["split_size"], 1)))
    bounds = [min(sum(sizes[:i]), n) for i in range(len(sizes) + 1)]
    return [_rows(t, lo, hi) for lo, hi in zip(bounds, bounds[1:], strict=False)]


# ----------------------------------------------------------------------------- copies and moves


@implements([aten.clone.default])
def _clone(cls, func, args, kwargs):
    t = args[0]
    return t.like(t.quantized_storage.with_buffers(lambda name, b: b.clone()))


@implements([aten.copy_.default])
def _copy(cls, func, args, kwargs):
    a = _bind(func, args, kwargs)
    dst, src = a["self"], a["src"]
    if not isinstance(dst, cls):  # a plain destination takes the values
        return dequantize_fallback(cls, func, args, kwargs)
    if not isinstance(src, cls):
        raise TypeError(
            "copy_ of a plain tensor into a QuantizedTensor has no scale to cast with: "
            "quantize the source with a Quantizer and copy that"
        )
    if dst.shape != src.shape:
        raise ValueError(
            f"copy_ between QuantizedTensors of shapes {tuple(src.shape)} -> {tuple(dst.shape)}: match them"
        )
    dst.quantized_storage.copy_(src.quantized_storage, non_blocking=a["non_blocking"])
    return dst


@implements([aten._to_copy.default])
def _to_copy(cls, func, args, kwargs):
    a = _bind(func, args, kwargs)
    t = a["self"]
    if a["dtype"] not in (None, t.dtype):  # a new dtype asks for the values
        return dequantize_fallback(cls, func, args, kwargs)
    device = a["device"] or t.device

    def move(name, b):
        moved = b.to(device, copy=True, non_blocking=a["non_blocking"])
        return moved.pin_memory() if a["pin_memory"] else moved

    return t.like(t.quantized_storage.with_buffers(move))


@implements([aten.new_empty.default, aten.new_zeros.default, aten.empty_like.default])
def _new_like(cls, func, args, kwargs):
    a = _bind(func, args, kwargs)
    t = a["self"]
    shape = tuple(a.get("size", t.shape))
    device = torch.device(a["device"] or t.device)
    zeroed = func is aten.new_zeros.default
    if a["dtype"] not in (None, t.dtype):  # a new dtype asks for a plain tensor
        return (torch.zeros if zeroed else torch.empty)(shape, dtype=a["dtype"], device=device)
    if not shape:
        raise ValueError("a QuantizedTensor needs at least one dim; ask for shape (1,) instead of ()")
    rows, cols = math.prod(shape[:-1]), shape[-1]
    storage = empty_storage(
        t.quantized_storage, rows, cols, device=device, zeroed=zeroed, pin_memory=bool(a["pin_memory"])
    )
    return t.like(storage, shape)


@implements([aten.zeros_like.default])
def _zeros_like(cls, func, args, kwargs):
    # A gradient or accumulator for this tensor (DCP's optimizer-state init makes one per parameter):
    # plain zeros of the nominal dtype. Quantized zeros come from new_zeros.
    a = _bind(func, args, kwargs)
    t = a["self"]
    return torch.zeros(t.shape, dtype=a["dtype"] or t.dtype, device=a["device"] or t.device)


@implements([aten.is_pinned.default])
def _is_pinned(cls, func, args, kwargs):
    return all(b.is_pinned() for b in args[0].quantized_storage.buffers().values())


@implements([aten.record_stream.default])
def _record_stream(cls, func, args, kwargs):
    for b in args[0].quantized_storage.buffers().values():
        b.record_stream(args[1])
