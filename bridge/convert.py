"""Checkpoint conversion DCP <-> Orbax <-> safetensors, streamed box by box into the target's sharding.

    plan      bridge.convert_plan: names and orientation (the architecture's parameter rules), and
              which process (or JAX device) writes which dim-0 block of each target tensor
    read      each box is read from the source by its byte ranges only (bridge.convert_dcp /
              convert_safetensors / convert_orbax), transposed when the names say so, then written
    commit    everything is written under `.<name>.partial` beside the target and renamed at the end:
              a failed conversion leaves no target and no temporary files
    verify    every written box is read back from the target; a per-tensor CRC32 of the bytes as
              produced and as read back must agree

Processes: with torch.distributed initialized, each rank writes its own boxes of a DCP or safetensors
target (owners = ranks). An Orbax target is written by one process over its JAX devices (owners =
devices). Peak host memory per process: one target box plus what the source reader holds for it (a
DCP source: the saved chunks overlapping the box; safetensors and Orbax: the box), except for an Orbax
target, where Orbax keeps the process's shards of the whole tree until it commits.
"""

from __future__ import annotations

import os
import shutil
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bridge import convert_dcp, convert_orbax, convert_safetensors
from bridge.convert_plan import Box, Plan, PlanEntry, check_against, make_plan

READERS = {
    "dcp": convert_dcp.DcpReader,
    "safetensors": convert_safetensors.SafetensorsReader,
    "orbax": convert_orbax.OrbaxReader,
}
ProgressCallback = Callable[[str, int], None]  # (target key, bytes written)


@dataclass(frozen=True)
class TensorChecksum:
    """CRC32 of one target tensor's bytes as produced from the source and as read back from the target."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    produced: int
    written: int | None  # None when not verified

    @property
    def ok(self) -> bool:
        return self.written is None or self.produced == self.written


@dataclass(frozen=True)
class ConvertResult:
    plan: Plan
    skipped: tuple[tuple[str, str], ...]  # (source key, reason): the plan's, plus non-tensor entries
    checksums: tuple[TensorChecksum, ...]  # empty for a dry run

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checksums)


def open_reader(fmt: str, path: str | os.PathLike):
    if fmt not in READERS:
        raise ValueError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(READERS)}")
    if not os.path.exists(path):
        raise ValueError(f"source {os.fspath(path)} does not exist")
    return READERS[fmt](path)


def _process() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def convert(
    source: str | os.PathLike,
    source_format: str,
    target: str | os.PathLike,
    target_format: str,
    *,
    with_optimizer: bool = False,
    architecture: str = "shardbridge",
    expected: Mapping[str, tuple[int, ...]] | None = None,
    dry_run: bool = False,
    verify: bool = True,
    on_box: ProgressCallback | None = None,
) -> ConvertResult:
    """Convert a checkpoint (see the module docstring); ValueError before anything is written if it cannot."""
    target = Path(target).absolute()
    rank, world = _process()
    devices = _devices(target_format, world)
    reader = open_reader(source_format, source)
    owners = len(devices) if devices is not None else world
    plan = make_plan(reader.tensors, source_format, target_format, owners, with_optimizer=with_optimizer, architecture=architecture)
    if expected is not None:
        check_against(plan, expected)
    skipped = plan.skipped + tuple(reader.skipped)
    if dry_run:
        return ConvertResult(plan, skipped, ())
    if os.path.lexists(target):
        raise ValueError(f"target {target} exists; pass a new path (a conversion never overwrites)")
    partial = target.with_name(f".{target.name}.partial")
    produced: dict[tuple[str, Box], int] = {}
    by_target = {e.target.key: e for e in plan.entries}

    def produce(key: str, box: Box) -> torch.Tensor:
        entry = by_target[key]
        values = reader.read(entry.source.key, entry.source_box(box))
        values = values.t().contiguous() if entry.transpose else values
        produced[(key, box)] = _crc(values)
        if on_box is not None:
            on_box(key, values.nbytes)
        return values

    try:
        _write(partial, plan, target_format, rank, devices, produce)
        _barrier()
        if rank == 0:
            os.rename(partial, target)
        _barrier()
    except BaseException:
        _remove(partial)
        raise
    written = _read_back(target, target_format, produced) if verify else {}
    return ConvertResult(plan, skipped, _checksums(plan.entries, produced, written))


def _devices(target_format: str, world: int):
    """The JAX devices an Orbax target is placed on (None for the other formats)."""
    if target_format != "orbax":
        return None
    if world > 1:
        raise ValueError("an Orbax target is written by one process (over its JAX devices); run without torch.distributed")
    import jax

    return jax.local_devices()


def _write(partial: Path, plan: Plan, target_format: str, rank: int, devices, produce) -> None:
    if rank == 0:
        _remove(partial)  # a stale one from an interrupted run
    _barrier()
    mine = [(e.target, box) for e in plan.entries for box in e.boxes[rank]] if devices is None else []
    if target_format == "dcp":
        convert_dcp.write(partial, mine, produce)
    elif target_format == "safetensors":
        targets = [e.target for e in plan.entries]
        convert_safetensors.write(partial, targets, mine, produce, first=rank == 0, barrier=_barrier)
    else:
        convert_orbax.write(partial, [e.target for e in plan.entries], produce, devices)


def _remove(path: Path) -> None:
    for stale in path.parent.glob(f"{path.name}*"):  # Orbax's own temporary directory starts with the name too
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)


def _read_back(target: Path, target_format: str, produced: Mapping[tuple[str, Box], int]) -> dict[tuple[str, Box], int]:
    reader = open_reader(target_format, target)
    return {(key, box): _crc(reader.read(key, box)) for key, box in produced}


def _combine(entry: PlanEntry, crcs: Mapping[tuple[str, Box], int]) -> int | None:
    """One CRC per tensor: CRC32 over its boxes' CRCs in box order (None if a box has none)."""
    boxes = sorted(box for boxes in entry.boxes for box in boxes)
    values = [crcs.get((entry.target.key, box)) for box in boxes]
    if any(v is None for v in values):
        return None
    return zlib.crc32(b"".join(v.to_bytes(4, "little") for v in values))


def _checksums(entries, produced: dict, written: dict) -> tuple[TensorChecksum, ...]:
    if dist.is_initialized():  # every rank produced (and read back) its own boxes
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (produced, written))
        produced = {k: v for p, _ in gathered for k, v in p.items()}
        written = {k: v for _, w in gathered for k, v in w.items()}
    verified = bool(written)
    return tuple(
        TensorChecksum(
            e.target.key, e.target.shape, e.target.dtype, _combine(e, produced), _combine(e, written) if verified else None
        )
        for e in entries
    )


__all__ = ["READERS", "ConvertResult", "TensorChecksum", "convert", "open_reader"]
