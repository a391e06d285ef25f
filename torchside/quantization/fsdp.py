"""FSDP2 all-gather hooks: gather a sharded QuantizedTensor parameter as its FP8/FP4 bytes.

FSDP2 shards parameters on dim 0 and all-gathers each hook input by concatenating dim 0.
So every buffer is sent with M (the row axis) first: rowwise buffers as they are, columnwise
ones ([K, M]) transposed, all as uint8 bytes. Buffers without an M axis (a per-tensor
scale_inv, the amaxes) are the same on every shard (the full tensor was quantized before it
was sharded, or its amax was all-reduced) and travel as metadata from the local shard.
Tensorwise and 128x128 columnwise copies are transposes of the rowwise ones: they are not
sent but rebuilt after the gather. Only the public hook arguments are read.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from torchside.quantization.storage import BUFFERS, QuantizedStorage

# Schemes whose columnwise copy (data and scale_inv) is exactly the transpose of the rowwise one.
_TRANSPOSED_COLUMNWISE = ("tensorwise", "block128x128")


class _GatherMetadata(NamedTuple):
    local: QuantizedStorage  # the shard's storage: layout, dtypes and the per-tensor buffers
    sent: tuple[str, ...]  # buffer names, in the order of the all-gather inputs
    rebuilt: tuple[str, ...]  # columnwise buffers rebuilt from rowwise ones after the gather
    rows_per_index: int  # matrix rows per index of dim 0
    orig_size: torch.Size


def _plan(storage: QuantizedStorage) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(buffers to gather, columnwise buffers to rebuild locally)."""
    rebuild = storage.rowwise and storage.columnwise and storage.scheme in _TRANSPOSED_COLUMNWISE
    rebuilt = tuple(n for n in storage.buffers() if rebuild and BUFFERS[n].orientation == "columnwise")
    sent = tuple(n for n in storage.buffers() if storage.row_axis(n) is not None and n not in rebuilt)
    return sent, rebuilt


def _as_row_major_bytes(storage: QuantizedStorage, name: str) -> Tensor:
    """Buffer `name` with M on axis 0, contiguous, viewed as uint8 (what FSDP2 concatenates)."""
    t = getattr(storage, name)
    if storage.row_axis(name)[0] == 1:
        t = t.t()
    return t.contiguous().view(torch.uint8)


def _row_bytes(storage: QuantizedStorage, name: str) -> int:
    """Bytes per index of M in buffer `name` (its width once M is axis 0)."""
    t = getattr(storage, name)
    return t.shape[1 - storage.row_axis(name)[0]] * t.element_size()


def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
    """FSDP2 hook: the uint8 buffers of this shard to all-gather, and what rebuilds the full tensor."""
    storage = self.quantized_storage
    rows_per_index = self.rows_per_index()
    sent, rebuilt = _plan(storage)
    inputs = tuple(_as_row_major_bytes(storage, name) for name in sent)
    padded_rows = math.ceil(orig_size[0] / mesh.size())  # torch.chunk's shard size: FSDP2 pads to it
    if padded_rows * mesh.size() != orig_size[0]:
        # Uneven shards: FSDP2 needs each input shaped like the padded shard, which only
        # one-byte-per-value data under a per-tensor scale can be. Every rank decides alike.
        if storage.scheme != "tensorwise" or sent != ("rowwise_data",):
            raise ValueError(
                f"FSDP2 shards this {storage.describe()} unevenly ({orig_size[0]} rows over {mesh.size()} ranks); "
                "its scales cannot be padded like the parameter: make dim 0 a multiple of the shard count "
                "(on scale-block boundaries), or use rowwise-only per-tensor scaling"
            )
        data = inputs[0].new_zeros(padded_rows * rows_per_index, storage.cols)
        data[: storage.rows].copy_(inputs[0])
        inputs = (data.view(padded_rows, *self.shape[1:]),)
    return inputs, _GatherMetadata(storage, sent, rebuilt, rows_per_index, torch.Size(orig_size))


def fsdp_post_all_gather(
    self, outputs: tuple[Tensor, ...], metadata: Any, param_dtype: torch.dtype, *, out: Tensor | None = None
):
    """FSDP2 hook: the full QuantizedTensor over the gathered bytes (`out`: refresh it in place)."""
    local, sent, rebuilt, rows_per_index, orig_size = metadata
    gathered = {}
    for name, output in zip(sent, outputs, strict=True):
        t = output.reshape(-1, _row_bytes(local, name)).view(getattr(local, name).dtype)
        gathered[name] = t.t() if local.row_axis(name)[0] == 1 else t
    gathered_rows = gathered[sent[0]].shape[local.row_axis(sent[0])[0]] * local.row_axis(sent[0])[1]
    full = dataclasses.replace(local, rows=gathered_rows, **gathered, **dict.fromkeys(rebuilt))
    full = full.slice_rows(0, orig_size[0] * rows_per_index)  # drop FSDP2's padding rows
    if rebuilt:
        # New tensors (never views of the shard's buffers): FSDP2 frees them after each use.
        transposed = {
            n: getattr(full, n.replace("columnwise", "rowwise")).t().clone(memory_format=torch.contiguous_format)
            for n in rebuilt
        }
        full = dataclasses.replace(full, **transposed)
    if out is not None:
        if isinstance(out, DTensor):  # a TP parameter: FSDP2 hands back the DTensor it built last time
            out = out.to_local()
        # FSDP2 re-allocated the storages of `out`'s gathered views in place; rebuilt buffers need refilling.
        for name, t in out.quantized_storage.buffers().items():
            if t.data_ptr() != getattr(full, name).data_ptr():
                t.copy_(getattr(full, name))
        return None
    tensor = type(self)(full, tuple(orig_size), param_dtype)
    return tensor, tuple(getattr(full, n) for n in rebuilt)
