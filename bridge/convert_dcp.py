"""DCP boxes: read any box of a saved tensor, and write a checkpoint box by box as the writer asks for it.

Reading goes through `dcp.load` with a planner whose local plan asks for exactly one box (DCP's
resharding computes which saved chunks overlap it). DCP's file reader loads each overlapping saved
chunk whole and narrows it, so a read holds at most one saved chunk plus the box.

Writing goes through `dcp.save` with a planner that lists this process's boxes as shard write items
and produces each box's values only when the file writer resolves it (one at a time, with
`thread_count=1`), so a process never holds more than one box.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import TensorWriteData, create_read_items_for_chunk_list

from bridge.convert_plan import Box, TensorInfo


class _BoxLoadPlanner(DefaultLoadPlanner):
    """Loads one box of one tensor into the state dict's tensor of that key."""

    def __init__(self, key: str, box: Box) -> None:
        super().__init__()
        self.key, self.box = key, box

    def create_local_plan(self) -> LoadPlan:
        offsets, sizes = self.box
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        metadata = self.metadata.state_dict_metadata[self.key]
        return LoadPlan(create_read_items_for_chunk_list(self.key, metadata, [chunk]))

    def resolve_tensor(self, read_item) -> torch.Tensor:
        box = self.state_dict[self.key]
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            box = box.narrow(dim, offset, length)
        return box


class DcpReader:
    """The tensors of a DCP checkpoint directory (`.metadata` plus its data files)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(os.path.join(self.path, ".metadata")):
            raise ValueError(f"{self.path} is not a DCP checkpoint (no .metadata); pass the checkpoint's directory")
        metadata = FileSystemReader(self.path).read_metadata()
        self.tensors, self.skipped = {}, []
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = str(md.properties.dtype).removeprefix("torch.")
                self.tensors[key] = TensorInfo(key, tuple(md.size), dtype)
            else:
                self.skipped.append((key, "not a tensor (pickled bytes)"))

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of tensor `key`, read from the chunks that overlap it."""
        out = torch.empty(box[1], dtype=getattr(torch, self.tensors[key].dtype))
        with warnings.catch_warnings():  # DCP warns that no_dist=True loads in one process: that is the point
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            planner = _BoxLoadPlanner(key, box)
            dcp.load({key: out}, storage_reader=FileSystemReader(self.path), planner=planner, no_dist=True)
        return out


class _BoxSavePlanner(DefaultSavePlanner):
    """Saves this process's boxes; each box's values come from `produce(key, box)` when DCP writes it."""

    def __init__(self, items: list[WriteItem], produce: Callable[[str, Box], torch.Tensor]) -> None:
        super().__init__(flatten_state_dict=False)
        self.items, self.produce = items, produce

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        chunk = write_item.tensor_data.chunk
        return self.produce(write_item.index.fqn, (tuple(chunk.offsets), tuple(chunk.sizes)))


def _write_item(info: TensorInfo, box: Box) -> WriteItem:
    offsets, sizes = (torch.Size(part) for part in box)
    dtype = getattr(torch, info.dtype)
    return WriteItem(
        index=MetadataIndex(info.key, offsets),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(info.shape),
        ),
    )


def write(
    path: str | os.PathLike, boxes: Sequence[tuple[TensorInfo, Box]], produce: Callable[[str, Box], torch.Tensor]
) -> None:
    """Write a DCP checkpoint of these (tensor, box) pairs (this process's share; collective when distributed)."""
    items = [_write_item(info, box) for info, box in boxes]
    writer = FileSystemWriter(os.fspath(path), thread_count=1)
    dcp.save({}, storage_writer=writer, planner=_BoxSavePlanner(items, produce), no_dist=not dist.is_initialized())
