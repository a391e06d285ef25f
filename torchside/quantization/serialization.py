"""Pickling a QuantizedTensor as its raw buffers, loadable with `torch.load(weights_only=True)`.

A pickle names `rebuild_quantized_tensor` (module level, registered as a safe global when
this module is imported) with plain arguments: metadata, a dict of buffers, shape, dtype.
Nothing is dequantized and no process group or quantizer travels with it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchside.quantization.storage import QuantizedStorage


def reduce_quantized_tensor(tensor) -> tuple:
    """The `__reduce_ex__` value of a QuantizedTensor."""
    storage = tensor.quantized_storage
    return rebuild_quantized_tensor, (
        storage.metadata(),
        storage.buffers(),
        tuple(tensor.shape),
        tensor.dtype,
        tensor.requires_grad,
    )


def rebuild_quantized_tensor(
    metadata: tuple[str, str, int, int, bool],
    buffers: dict[str, Tensor],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    requires_grad: bool,
):
    """Inverse of `reduce_quantized_tensor` (the name a pickle refers to; keep it stable)."""
    from torchside.quantization.tensor import QuantizedTensor  # tensor.py imports this module

    scheme, fmt, rows, cols, hadamard = metadata
    storage = QuantizedStorage(scheme, fmt, rows, cols, hadamard, **buffers)
    return QuantizedTensor(storage, shape, dtype, requires_grad)


torch.serialization.add_safe_globals([rebuild_quantized_tensor])
