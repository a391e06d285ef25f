"""Checkpoint conversion DCP <-> Orbax <-> safetensors <-> HF (bridge.convert.hf), streamed box by box into the target's sharding.

    plan      bridge.convert.plan: names and orientation (the architecture's parameter rules), and
              which process (or JAX device) writes which dim-0 block of each target tensor
    read      each box is read from the source by its byte ranges only (bridge.convert.dcp /
              .safetensors / .orbax: one module per format, a row in READERS and WRITERS),
              transposed when the names say so, then written;
              a source whose writer recorded checksums (torchside and jaxside saves, our own
              targets) is checked against them before its bytes are used (CheckFailed on a mismatch)
    stage     everything is written into `.<name>.partial/` beside the target, created exclusively
              (torchside.checkpoint.commit's rule): a second conversion into the same target is refused
    verify    every written box is read back from the staging copy; a per-tensor CRC32 of the bytes as
              produced and as read back must agree (CheckFailed if not). A writer may produce a box
              in dim-0 blocks (the HF writer does): the blocks' CRC32s join into the tensor's
    commit    only then is the staging copy renamed to the target: a failed, refused or interrupted
              conversion leaves no target and no temporary files
    Ctrl-C    SIGINT is held back until one of the points where stopping is safe (before each box,
              between write, read-back and commit; bridge.convert.interrupts), then the staging is removed

Processes: with torch.distributed initialized, each rank writes its own boxes of a DCP or safetensors
target (owners = ranks). An Orbax target is written by one process over its JAX devices (owners =
devices). Peak host memory per process: one target box (an HF target: one block, about one HF tensor)
plus what the source reader holds for it (a DCP source: the saved chunks overlapping the box;
safetensors and Orbax: the box), except for an Orbax target, where Orbax keeps the process's shards
of the whole tree until it commits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from bridge.convert import dcp, facts, hf, orbax, safetensors
from bridge.convert.interrupts import Interrupts, deferred_interrupts
from bridge.convert.plan import Box, Plan, PlanEntry, WriteJob, check_against, itemsize, make_plan
from bridge.errors import CheckFailed
from torchside.checkpoint import commit
from torchside.checkpoint.checksums import crc32_combine, tensor_crc32

# One row per format: how to read a box of a source, how to write a target. A reader is built as
# reader(path, check=...) and has `path` (what it reads: a root's latest step), `tensors`, `skipped`,
# `verifiable`, `facts` (bridge.convert.facts)
# and `read(key, box)`; a writer is writer(job: WriteJob) and records its format's checksums and the facts.
READERS = {
    "dcp": dcp.DcpReader,
    "safetensors": safetensors.SafetensorsReader,
    "orbax": orbax.OrbaxReader,
    "hf": hf.HfReader,
}
WRITERS: dict[str, Callable[[WriteJob], None]] = {
    "dcp": dcp.write,
    "safetensors": safetensors.write,
    "orbax": orbax.write,
    "hf": hf.write,
}
# Targets whose own description fixes the tensors they hold: check(plan, target_options, facts) raises
# ValueError before anything is written (an HF target: its config.json).
TARGET_CHECKS: dict[str, Callable[[Plan, Mapping, Mapping], None]] = {"hf": hf.check_target}
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
    source_verified: bool  # False: the source has no recorded checksums (written elsewhere)
    source_read: Path  # the source itself, or for a root of DCP or Orbax saves the step that was read (its latest)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checksums)


def open_reader(fmt: str, path: str | os.PathLike, *, check: bool = True):
    """A reader of a checkpoint in format `fmt`; `check=False` skips the recorded checksums."""
    if fmt not in READERS:
        raise ValueError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(READERS)}")
    if not os.path.exists(path):
        raise ValueError(f"source {os.fspath(path)} does not exist")
    return READERS[fmt](path, check=check)


def _process() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _on_rank0(action: Callable[[], object]) -> object:
    """`action()` on rank 0; an exception it raises is raised on every rank (none waits for it forever)."""
    rank, world = _process()
    result, error = None, None
    if rank == 0:
        try:
            result = action()
        except (ValueError, OSError) as failure:
            error = failure
    if world > 1:
        box = [(result, error)]
        dist.broadcast_object_list(box, src=0)
        result, error = box[0]
    if error is not None:
        raise error
    return result


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
    target_options: Mapping | None = None,
) -> ConvertResult:
    """Convert a checkpoint (see the module docstring); ValueError before anything is written if it cannot.

    target_options: the target format's own (an HF target: `config`, `max_shard_size`; bridge.convert.hf).
    Ctrl-C (SIGINT) stops it only where that is safe (bridge.convert.interrupts): KeyboardInterrupt, nothing left.
    """
    with deferred_interrupts() as interrupts:
        target_options = dict(target_options or {})
        target = Path(target).absolute()
        if target_format not in WRITERS:
            raise ValueError(f"unknown checkpoint format {target_format!r}: use one of {', '.join(WRITERS)}")
        rank, world = _process()
        devices = _devices(target_format, world)
        reader = open_reader(source_format, source)
        owners = len(devices) if devices is not None else world
        plan = make_plan(
            reader.tensors, source_format, target_format, owners, with_optimizer=with_optimizer, architecture=architecture
        )
        if expected is not None:
            check_against(plan, expected)
        target_facts = _target_facts(plan, reader.facts)
        if target_format in TARGET_CHECKS:
            TARGET_CHECKS[target_format](plan, target_options, target_facts)
        skipped = plan.skipped + tuple(reader.skipped)
        if dry_run:
            return ConvertResult(plan, skipped, (), reader.verifiable, Path(reader.path))
        produced: dict[tuple[str, Box], int] = {}
        by_target = {e.target.key: e for e in plan.entries}

        def produce(key: str, box: Box) -> torch.Tensor:
            interrupts.check()
            entry = by_target[key]
            values = reader.read(entry.source.key, entry.source_box(box))
            values = values.t().contiguous() if entry.transpose else values
            produced[(key, box)] = tensor_crc32(values)
            if on_box is not None:
                on_box(key, values.nbytes)
            return values

        interrupts.check()
        written_path = _on_rank0(lambda: commit.stage(target))
        try:
            def tensor_crcs() -> dict[str, int]:
                return _tensor_crcs(plan.entries, produced)

            job = WriteJob(written_path, plan, rank, devices, produce, tensor_crcs, _barrier, target_options, target_facts)
            WRITERS[target_format](job)
            interrupts.check()
            _barrier()
            written = _read_back(written_path, target_format, produced, target_facts, interrupts) if verify else {}
            checksums = _checksums(plan.entries, produced, written)
            differ = [c for c in checksums if not c.ok]
            if differ:
                listed = "; ".join(f"{c.key}: produced {c.produced:08x}, read back {c.written:08x}" for c in differ)
                raise CheckFailed(f"{target}: the written copy differs from what was produced ({listed}); nothing was committed")
            interrupts.check()
            _barrier()
            _on_rank0(lambda: commit.publish_staged(written_path, target))
        except BaseException:
            if rank == 0:
                commit.discard(target)  # SIGINT is still deferred: the removal runs to its end
            raise
        return ConvertResult(plan, skipped, checksums, reader.verifiable, Path(reader.path))


def _target_facts(plan: Plan, source_facts: Mapping) -> dict:
    """The source's facts with each FP8 parameter under the target's name for it."""
    names = {}
    for entry in plan.entries:
        for buffer in ("rowwise_data", "columnwise_data"):
            if entry.source.key.endswith(f".{buffer}") and entry.target.key.endswith(f".{buffer}"):
                source, target = (key.removeprefix("model.").removesuffix(f".{buffer}") for key in (entry.source.key, entry.target.key))
                names[source] = target
    return facts.renamed(source_facts, names)


def _devices(target_format: str, world: int):
    """The JAX devices an Orbax target is placed on (None for the other formats)."""
    if target_format != "orbax":
        return None
    if world > 1:
        raise ValueError("an Orbax target is written by one process (over its JAX devices); run without torch.distributed")
    import jax

    return tuple(jax.local_devices())


def _read_back(
    path: Path, target_format: str, produced: Mapping[tuple[str, Box], int], target_facts: Mapping, interrupts: Interrupts
) -> dict[tuple[str, Box], int]:
    # An HF directory does not record our fc1 layout: read it back in the one it was written from.
    layout = {"glu_interleave": facts.glu_interleave(target_facts)} if target_format == "hf" else {}
    reader = READERS[target_format](path, check=False, **layout)  # compared with what was produced instead
    crcs = {}
    for key, box in produced:
        interrupts.check()
        crcs[(key, box)] = tensor_crc32(reader.read(key, box))
    return crcs


def _gather(crcs: dict[tuple[str, Box], int]) -> dict[tuple[str, Box], int]:
    """Every rank's box CRCs (each rank produced and read back its own boxes)."""
    if not dist.is_initialized():
        return crcs
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, crcs)
    return {k: v for part in gathered for k, v in part.items()}


def _by_tensor(crcs: Mapping[tuple[str, Box], int]) -> dict[str, list[tuple[Box, int]]]:
    by_key: dict[str, list[tuple[Box, int]]] = {}
    for (key, box), crc in crcs.items():
        by_key.setdefault(key, []).append((box, crc))
    return by_key


def _tensor_crc(entry: PlanEntry, boxes: list[tuple[Box, int]]) -> int | None:
    """CRC32 of a whole target tensor's bytes from the (box, CRC32) of the dim-0 blocks produced of it, joined
    in row order; None unless they tile the tensor (a writer may produce its plan box in row blocks)."""
    shape, crc, row = entry.target.shape, None, 0
    for (offsets, sizes), block_crc in sorted(boxes):
        if not shape:  # 0-d: one box
            return block_crc if len(boxes) == 1 else None
        if offsets[0] != row or any(offsets[1:]) or tuple(sizes[1:]) != tuple(shape[1:]):
            return None
        nbytes = math.prod(sizes) * itemsize(entry.target.dtype)
        crc = block_crc if crc is None else crc32_combine(crc, block_crc, nbytes)
        row += sizes[0]
    return crc if shape and row == shape[0] else None


def _tensor_crcs(entries, produced: dict) -> dict[str, int]:
    everything = _by_tensor(_gather(produced))
    return {e.target.key: _tensor_crc(e, everything.get(e.target.key, [])) for e in entries}


def _checksums(entries, produced: dict, written: dict) -> tuple[TensorChecksum, ...]:
    produced, written = _by_tensor(_gather(produced)), _by_tensor(_gather(written))
    verified = bool(written)
    return tuple(
        TensorChecksum(
            e.target.key,
            e.target.shape,
            e.target.dtype,
            _tensor_crc(e, produced.get(e.target.key, [])),
            _tensor_crc(e, written.get(e.target.key, [])) if verified else None,
        )
        for e in entries
    )


__all__ = ["READERS", "TARGET_CHECKS", "WRITERS", "ConvertResult", "TensorChecksum", "convert", "open_reader"]
