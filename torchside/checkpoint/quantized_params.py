"""An FP8/FP4 parameter in a checkpoint: its raw buffers as plain tensors sharded like the parameter.

A `QuantizedTensor` parameter is never handed to DCP as it is: DCP would pickle the subclass and
could only reshard it by slicing through the dequantize fallback. Instead each buffer becomes a
tensor of its own, keyed `<param fqn>.<buffer name>` (`0.qkv.weight.rowwise_data`,
`0.qkv.weight.rowwise_scale_inv`, ...), in the dtype the storage holds it: FP8 and packed E2M1
data as raw uint8 bytes (the format is in shardbridge.json's FP8 facts; `export_safetensors`
labels E4M3/E5M2 bytes F8_E4M3/F8_E5M2), scales in their own dtype (fp32, E8M0, E4M3):

- buffers that run over the matrix rows M (data, block scales) are viewed M-first (a columnwise
  [K, M] buffer is saved transposed, [M, K]) and wrapped as a DTensor with the parameter's mesh
  and placements; their global shape is what the whole [M, K] weight's buffer would have. So DCP
  reshards them like the parameter, as long as every shard starts on a scale-block boundary
  (FSDP2 and the TP placement checks already require it);
- per-tensor buffers (a tensorwise `scale_inv`, the amaxes) are the same on every shard and saved
  once, as replicated plain tensors;
- a columnwise copy that is the transpose of the rowwise one (tensorwise and 128x128 schemes) is
  not saved: loading rebuilds it, as the FSDP2 all-gather does.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from torchside.quantization import QuantizedStorage, QuantizedTensor
from torchside.quantization.storage import BUFFERS, buffer_shapes

TRANSPOSED_COLUMNWISE = ("tensorwise", "block128x128")  # columnwise copy == rowwise copy transposed


def local_of(tensor: Tensor) -> Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_quantized(param: Tensor) -> bool:
    return isinstance(local_of(param), QuantizedTensor)


def saved_buffers(storage: QuantizedStorage) -> tuple[str, ...]:
    """The buffer names a checkpoint holds (the transposed columnwise copies are rebuilt instead)."""
    rebuilt = storage.rowwise and storage.scheme in TRANSPOSED_COLUMNWISE
    return tuple(n for n in storage.buffers() if not (rebuilt and BUFFERS[n].orientation == "columnwise"))


def describe(param: Tensor) -> dict:
    """JSON-ready facts about an FP8 parameter that the buffers alone do not say (for export and import)."""
    local = local_of(param)
    storage = local.quantized_storage
    return {
        "scheme": storage.scheme,
        "fmt": storage.fmt,
        "hadamard": storage.hadamard,
        "shape": list(param.shape),
        "dtype": str(local.dtype).removeprefix("torch."),
        "buffers": list(saved_buffers(storage)),
    }


def _check_matrix(fqn: str, param: Tensor) -> None:
    if param.dim() != 2:
        raise ValueError(
            f"FP8 parameter {fqn} has shape {tuple(param.shape)}: checkpoints hold 2-D FP8 weights [out, in] only"
        )


def _m_first(storage: QuantizedStorage, name: str, buffer: Tensor) -> Tensor:
    """`buffer` (of `storage`) with its row (M) axis first: a view, so writes reach the buffer."""
    axis_step = storage.row_axis(name)
    return buffer.t() if axis_step is not None and axis_step[0] == 1 else buffer


def buffer_tensors(fqn: str, param: Tensor, storage: QuantizedStorage | None = None) -> dict[str, Tensor]:
    """`{fqn.buffer: tensor}` for the checkpoint, as views of `storage` (default: the parameter's own)."""
    _check_matrix(fqn, param)
    local = local_of(param)
    storage = local.quantized_storage if storage is None else storage
    global_shapes = buffer_shapes(storage, *param.shape)
    tensors = {}
    for name in saved_buffers(storage):
        buffer = getattr(storage, name)
        if storage.row_axis(name) is None:
            tensors[f"{fqn}.{name}"] = buffer
            continue
        rows_first = _m_first(storage, name, buffer)
        if not isinstance(param, DTensor):
            tensors[f"{fqn}.{name}"] = rows_first
            continue
        shape = global_shapes[name]
        shape = shape if storage.row_axis(name)[0] == 0 else shape[::-1]
        stride = (shape[1], 1)
        tensors[f"{fqn}.{name}"] = DTensor.from_local(
            rows_first, param.device_mesh, param.placements, run_check=False, shape=torch.Size(shape), stride=stride
        )
    return tensors


def empty_storage_like(param: Tensor) -> QuantizedStorage:
    """New, uninitialized buffers laid out like the parameter's local shard (a load target)."""
    storage = local_of(param).quantized_storage
    return storage.with_buffers(lambda name, b: torch.empty_like(b))


def complete(storage: QuantizedStorage) -> QuantizedStorage:
    """`storage` with its transposed columnwise copies rebuilt from the loaded rowwise ones."""
    rebuilt = [n for n in storage.buffers() if n not in saved_buffers(storage)]
    transposed = {n: getattr(storage, n.replace("columnwise", "rowwise")).t().contiguous() for n in rebuilt}
    for name, values in transposed.items():
        getattr(storage, name).copy_(values)
    return storage


def copy_into_param(param: Tensor, loaded: QuantizedStorage) -> None:
    """Swap step: the loaded bytes into the parameter's own buffers, in place (FSDP2 keeps its storage)."""
    local_of(param).quantized_storage.copy_(complete(loaded))
