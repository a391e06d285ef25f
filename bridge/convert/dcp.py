"""DCP boxes: read any box of a saved tensor, and write a checkpoint box by box as the writer asks for it.

Reading goes through `dcp.load` with a planner whose local plan asks for exactly one box (DCP's
resharding computes which saved chunks overlap it). DCP's file reader loads each overlapping saved
chunk whole and narrows it, so a read holds at most one saved chunk plus the box.

Writing goes through `dcp.save` with a planner that lists this process's boxes as shard write items
and produces each box's values only when the file writer resolves it (one at a time, with
`thread_count=1`), so a process never holds more than one box. The files get torchside's per-file
CRC32s (`ChecksummedWriter`), as a torchside save's do.

Source checks: a DCP directory with `__<rank>_checksums.json` files (torchside saves, our targets)
is verifiable: each data file is checked against its recorded size and CRC32 before the first box
is read from it (CheckFailed on a CRC mismatch, ValueError when missing or truncated). Without them
(`dcp.save`'s own output) it converts unverified. An unfinished torchside save (`step-N.tmp`) is
refused as `load` refuses it; a checkpoint root or `root/latest` means its latest committed step.

DCP reports a failure inside `dcp.save` / `dcp.load` as a CheckpointException (a BaseException)
holding each rank's exception; `first_failure` gives the original back (a Ctrl-C stays one).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import TensorWriteData, create_read_items_for_chunk_list

from bridge.convert import facts
from bridge.convert.plan import Box, TensorInfo, WriteJob
from bridge.errors import CheckFailed
from torchside.checkpoint import checksums, commit, validate


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

    def __init__(self, path: str | os.PathLike, *, check: bool = True) -> None:
        directory = Path(path)
        if commit.is_unfinished(directory) or not (directory / ".metadata").is_file():
            if not directory.is_dir():
                raise ValueError(f"{directory} is not a DCP checkpoint (not a directory); pass the checkpoint's directory")
            directory = commit.resolve(directory)[1]  # a torchside root or `latest`; refuses unfinished saves
        self.path = os.fspath(directory)
        metadata = _read_metadata(directory)
        self.tensors, self.skipped, self._files = {}, [], {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                dtype = str(md.properties.dtype).removeprefix("torch.")
                self.tensors[key] = TensorInfo(key, tuple(md.size), dtype)
            else:
                self.skipped.append((key, "not a tensor (pickled bytes)"))
        self._holds: dict[str, list[str]] = {}  # data file -> the tensors stored in it
        for index, info in metadata.storage_data.items():
            self._files.setdefault(index.fqn, set()).add(info.relative_path)
            if index.fqn not in self._holds.setdefault(info.relative_path, []):
                self._holds[info.relative_path].append(index.fqn)
        self.facts = _facts(directory)
        self._sums = checksums.recorded(directory) if check else {}
        self.verifiable = bool(self._sums)
        self._checked: set[str] = set()

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of tensor `key`, read from the chunks that overlap it."""
        files = sorted(self._files.get(key, ()))
        for name in files:
            self._check_file(name, key)
        out = torch.empty(box[1], dtype=getattr(torch, self.tensors[key].dtype))
        with _one_process_is_intended():
            planner = _BoxLoadPlanner(key, box)
            try:
                dcp.load({key: out}, storage_reader=FileSystemReader(self.path), planner=planner, no_dist=True)
            except CheckpointException as error:
                cause = first_failure(error)
                if not isinstance(cause, Exception):
                    raise cause from None  # KeyboardInterrupt, SystemExit
                paths = ", ".join(os.path.join(self.path, name) for name in files)
                raise ValueError(
                    f"reading {key} from {paths} failed ({type(cause).__name__}: {cause}): the file is truncated "
                    "or damaged; convert an intact copy of the checkpoint"
                ) from cause
        return out

    def _check_file(self, name: str, key: str) -> None:
        """Check data file `name` against its recorded size and CRC32 once, before its first read."""
        if name in self._checked:
            return
        path = Path(self.path) / name
        if not path.is_file():
            raise ValueError(f"{path} is missing (tensor {key} is stored in it): the checkpoint is incomplete; convert an intact copy")
        if self.verifiable:
            if name not in self._sums:
                raise ValueError(f"{path} has no recorded checksum: the checkpoint is incomplete; convert an intact copy")
            size, crc = self._sums[name]
            actual_size, actual_crc = checksums.file_checksum(path)
            if actual_size != size:
                raise ValueError(
                    f"{path} is truncated or overwritten ({actual_size} bytes, {size} written; tensor {key} is in it): "
                    "convert an intact copy"
                )
            if actual_crc != crc:
                held = sorted(self._holds.get(name, [key]))
                listed = ", ".join(held[:10]) + (f" and {len(held) - 10} more" if len(held) > 10 else "")
                raise CheckFailed(
                    f"{path}: CRC32 {actual_crc:08x}, but {crc:08x} was recorded when it was written; it holds tensor(s) "
                    f"{listed}: the source is corrupted; nothing was written. Convert an intact copy"
                )
        self._checked.add(name)


def _read_metadata(directory: Path):
    """DCP's `.metadata`, checked against the CRC32 a torchside save recorded for it (if any); ValueError naming it."""
    recorded = None
    if (directory / commit.METADATA_FILE).exists():
        recorded = commit.read_metadata(directory).get(validate.DCP_METADATA_CHECKSUM)
    return validate.read_dcp_metadata(directory, recorded)


def _facts(directory: Path) -> dict:
    """A torchside save's FP8 facts and fc1 layout (its shardbridge.json), or a converted DCP's (bridge.convert.facts)."""
    if (directory / commit.METADATA_FILE).exists():
        metadata = commit.read_metadata(directory)
        return {key: metadata[key] for key in ("fp8_params", "glu_interleave") if metadata.get(key)}
    return facts.read_file(directory)


@contextlib.contextmanager
def _one_process_is_intended() -> Iterator[None]:
    """DCP warns that no_dist=True reads or writes in one process: that is the point, so that warning is dropped."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        yield


def first_failure(error: CheckpointException) -> BaseException:
    """The original exception inside DCP's CheckpointException (this rank's if it failed, else the first rank's)."""
    failures = error.failures
    rank = dist.get_rank() if dist.is_initialized() else 0
    wrapped = failures.get(rank) or failures[min(failures)]
    return wrapped[0]


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


def write(job: WriteJob) -> None:
    """Write this process's boxes as a DCP checkpoint with per-file CRC32s (collective when distributed)."""
    items = [_write_item(info, box) for info, box in job.boxes()]
    writer = checksums.ChecksummedWriter(os.fspath(job.path), thread_count=1)
    try:
        with _one_process_is_intended():
            dcp.save({}, storage_writer=writer, planner=_BoxSavePlanner(items, job.produce), no_dist=not dist.is_initialized())
    except CheckpointException as error:
        raise first_failure(error) from None
    if job.owner == 0:
        facts.write_file(job.path, job.facts)
