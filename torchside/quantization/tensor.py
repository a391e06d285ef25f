"""`QuantizedTensor`: a torch.Tensor that holds FP8/FP4 bytes and their scales.

Its nominal dtype is the high-precision one it stands for (what `dequantize()` returns by
default); its buffers live in a `QuantizedStorage`. The stored scale is `scale_inv`
(dequant = q * scale_inv), never the multiplicative scale.

Aten ops go through `ops.py` (an allow-list for what FSDP2, DCP and autograd do to
parameters; anything else dequantizes there, loudly). The FSDP2 hooks are in `fsdp.py`,
pickling in `serialization.py`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchside.quantization import fsdp, ops, serialization
from torchside.quantization.storage import BUFFER_FIELDS, QuantizedStorage


class QuantizedTensor(Tensor):
    """Quantized bytes with the shape and nominal dtype of the tensor they encode."""

    quantized_storage: QuantizedStorage

    @staticmethod
    def __new__(
        cls, storage: QuantizedStorage, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False
    ):
        shape = tuple(shape)
        if math.prod(shape) != storage.rows * storage.cols:
            raise ValueError(
                f"shape {shape} does not hold the {storage.rows}x{storage.cols} values of {storage.describe()}"
            )
        if not storage.buffers():
            raise ValueError("a QuantizedTensor needs rowwise or columnwise data; quantize with at least one usage")
        self = Tensor._make_wrapper_subclass(
            cls,
            shape,
            strides=_contiguous_strides(shape),
            dtype=dtype,
            device=storage.device,
            requires_grad=requires_grad,
        )
        self.quantized_storage = storage
        return self

    def like(self, storage: QuantizedStorage, shape: tuple[int, ...] | None = None) -> QuantizedTensor:
        """A tensor of the same class and nominal dtype over other buffers (a view, a copy, a slice)."""
        return type(self)(storage, self.shape if shape is None else shape, self.dtype)

    def rows_per_index(self) -> int:
        """How many matrix rows one index of dim 0 spans; ValueError if it does not span whole rows."""
        cols = self.quantized_storage.cols
        if self.dim() >= 2 and self.shape[-1] == cols:
            return math.prod(self.shape[1:-1])
        inner = math.prod(self.shape[1:])
        if cols and inner % cols == 0:  # a reshaped view whose dim 0 still covers whole rows
            return inner // cols
        raise ValueError(
            f"dim 0 of a QuantizedTensor of shape {tuple(self.shape)} does not cover whole rows of its "
            f"[{self.quantized_storage.rows}, {cols}] quantized matrix: view it back to [..., {cols}] first"
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The values as a plain tensor of this shape, in `dtype` (default: the nominal dtype)."""
        return self.quantized_storage.dequantize(dtype or self.dtype).reshape(self.shape)

    def __repr__(self, *, tensor_contents=None) -> str:
        # Tensor.__repr__ would print values through aten ops, i.e. through the dequantize fallback.
        return f"QuantizedTensor({self.quantized_storage.describe()}, shape={tuple(self.shape)}, dtype={self.dtype})"

    # ---- torch.compile / subclass protocol: the inner tensors are the annotated buffers.

    def __tensor_flatten__(self):
        return list(self.quantized_storage.buffers()), (self.quantized_storage.metadata(), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner_tensors, flatten_metadata, outer_size, outer_stride):
        (scheme, fmt, rows, cols, hadamard), dtype = flatten_metadata
        storage = QuantizedStorage(scheme, fmt, rows, cols, hadamard, **inner_tensors)
        return QuantizedTensor(storage, tuple(outer_size), dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return ops.dispatch(cls, func, args, kwargs or {})

    __torch_function__ = torch._C._disabled_torch_function_impl

    # ---- what FSDP2 and DCP ask of a parameter beyond aten ops.

    def untyped_storage(self) -> torch.UntypedStorage:
        """The rowwise (else columnwise) bytes' storage: a stable identity for DCP and FSDP2."""
        if _compiling():  # Dynamo fakifies the wrapper itself: its own (empty) storage
            return super().untyped_storage()
        storage = self.quantized_storage
        return (storage.rowwise_data if storage.rowwise else storage.columnwise_data).untyped_storage()

    fsdp_pre_all_gather = fsdp.fsdp_pre_all_gather
    fsdp_post_all_gather = fsdp.fsdp_post_all_gather

    def __reduce_ex__(self, protocol):
        return serialization.reduce_quantized_tensor(self)


def _make_buffer_property(name: str) -> property:
    return property(lambda self: getattr(self.quantized_storage, name), doc=f"the `{name}` buffer (None if absent)")


# getattr(tensor, name) must reach each inner tensor named by __tensor_flatten__.
for _name in BUFFER_FIELDS:
    setattr(QuantizedTensor, _name, _make_buffer_property(_name))


def _compiling() -> bool:
    """Whether a torch.compile session runs, Dynamo's fakification of the graph's inputs included."""
    # torch 2.13 holds is_compiling() True for the whole session; torch 2.11 only inside traced code, so there
    # fakifying an FP8 parameter saw its bytes' storage ("Attempted to set the storage of a tensor on device
    # "cpu" to a storage on different device "meta""): the session's CompileContext tells on both.
    return torch.compiler.is_compiling() or torch._guards.CompileContext.try_get() is not None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
