"""`load`: resolve a committed step, check it, load it into fresh tensors, then swap them in.

Order, so that a failed load leaves the model and optimizer as they were:
1. resolve `latest` on rank 0 and broadcast the step (every rank loads the same one);
2. read the step's metadata (a damaged file is named) and check the checkpoint against the model
   (every differing key, shape, dtype, FP8 scheme and optimizer param group listed) and its files
   (the first missing, truncated or corrupted shard named), before reading any tensor;
3. `dcp.load` into fresh tensors laid out like this topology's (DCP reshards);
4. swap: copy them into the model, the FP8 parameters' buffers and the optimizer.
Should anything fail after step 1 (even Ctrl-C in the middle of the swap), a `Rollback` taken
before step 2 puts the model and optimizer back bitwise, and the error propagates.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from torchside.checkpoint import commit, quantized_params, save, validate
from torchside.checkpoint.app_state import AppState
from torchside.checkpoint.rollback import Rollback


@dataclass(frozen=True)
class LoadResult:
    """What was loaded: the step, its directory and JSON metadata, and unfinished saves found beside it."""

    step: int
    path: Path
    metadata: dict[str, Any]
    interrupted: tuple[Path, ...]  # staging directories of saves that never committed
    rng_restored: bool  # False when the world size changed (RNG states are per rank)


def load(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
    process_group: dist.ProcessGroup | None = None,
) -> LoadResult:
    """Load a checkpoint root (its latest committed step), `root/latest`, or a `step-N` directory.

    Every rank calls it; the topology may differ from the one that saved. `verify=False` skips
    the CRC32 pass over the shard files (sizes are still checked by DCP's reads).
    """
    root, step_path = _resolve_same_everywhere(Path(directory), process_group)
    interrupted = tuple(commit.interrupted_saves(root))
    if interrupted:
        names = ", ".join(str(p) for p in interrupted)
        warnings.warn(f"unfinished checkpoint saves (a process died or is still writing): {names}", stacklevel=2)
    metadata = commit.read_metadata(step_path)
    dcp_metadata = validate.read_dcp_metadata(step_path, metadata.get(validate.DCP_METADATA_CHECKSUM))
    use_dist = dist.is_initialized()
    world = dist.get_world_size(process_group) if use_dist else 1
    rng_restored = metadata["world_size"] == world
    rollback = Rollback(model, optimizer)
    try:
        app = AppState(model, optimizer, process_group=process_group)
        target = app.empty_state_dict(with_rng=rng_restored)
        live_fp8 = {fqn: quantized_params.describe(p) for fqn, p in app.fp8_params.items()}
        live_groups = app.param_groups() if optimizer is not None else None
        validate.check_fits(
            step_path,
            dcp_metadata,
            target,
            fp8_params=(metadata["fp8_params"], live_fp8),
            param_groups=(metadata["param_groups"], live_groups),
            layouts=(metadata, validate.glu_interleave(model)),
        )
        if verify:
            validate.check_files(step_path, dcp_metadata, process_group)
        _read(target, step_path, process_group, use_dist)
        _swap_on_every_rank(app, target, metadata["param_groups"], process_group)
    except BaseException:  # whatever failed, and wherever: the model and optimizer as they were
        rollback.restore()
        raise
    return LoadResult(app.step, step_path, metadata, interrupted, rng_restored)


def _read(target: dict[str, Any], step_path: Path, group: dist.ProcessGroup | None, use_dist: bool) -> None:
    """`dcp.load` into `target`; a failed read (bytes that do not decode) is a ValueError naming the step."""
    try:
        dcp.load(target, checkpoint_id=str(step_path), process_group=group, no_dist=not use_dist)
    except CheckpointException as error:
        failures = [exc for exc, _ in error.failures.values()]
        if any(isinstance(exc, KeyboardInterrupt) for exc in failures):
            raise KeyboardInterrupt from error
        causes = {f"{type(exc).__name__}: {exc}" for exc in failures}
        raise ValueError(
            f"reading checkpoint {step_path} failed ({'; '.join(sorted(causes))}): its .metadata or a shard file "
            "is damaged; load another step (load with verify=True names a damaged shard)"
        ) from error


def _swap_on_every_rank(app: AppState, target: dict[str, Any], param_groups, group: dist.ProcessGroup | None) -> None:
    """The swap; if it fails on any rank, every rank raises (and rolls back): no rank keeps the new state alone."""
    error = None
    try:
        app.load_state_dict(target, param_groups)
    except Exception as failure:  # reported to the other ranks first, then raised
        error = failure
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        failed = torch.tensor([error is not None], dtype=torch.int64, device=_collective_device(group))
        dist.all_reduce(failed, group=group)
        if error is None and failed.item():
            raise RuntimeError(f"the swap failed on {failed.item()} other rank(s) (their errors say why): rolled back")
    if error is not None:
        raise error


def _collective_device(group: dist.ProcessGroup | None) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"


def _resolve_same_everywhere(path: Path, group: dist.ProcessGroup | None) -> tuple[Path, Path]:
    """(root, step directory), resolved on rank 0 (after its own pending save) and agreed by all ranks."""
    use_dist = dist.is_initialized() and dist.get_world_size(group) > 1
    rank = dist.get_rank(group) if use_dist else 0
    root, step_path, error = commit.root_of(path), None, None
    if rank == 0:
        save.wait_for_pending(root)
        try:
            root, step_path = commit.resolve(path)
        except ValueError as failure:
            error = failure
    if use_dist:
        step = -1 if step_path is None else int(step_path.name.removeprefix("step-"))
        agreed = torch.tensor([step], dtype=torch.int64, device=_collective_device(group))
        dist.broadcast(agreed, src=dist.get_global_rank(group or dist.group.WORLD, 0), group=group)
        if rank != 0 and agreed.item() >= 0:
            step_path = commit.step_dir(root, int(agreed.item()))
    if error is not None:
        raise error
    if step_path is None:
        raise ValueError(f"rank 0 found no committed checkpoint under {path} (its error says why)")
    return root, step_path
