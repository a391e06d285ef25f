"""`save`: write the AppState with DCP into a staging directory and publish it when complete.

Sync saves publish before returning. Async saves return once the state is staged (copied out of
the training tensors, so training may go on); the files are written in a background thread or
process, and rank 0 publishes as soon as DCP's metadata is written (DCP's coordinator writes it
only after every rank's files are in). A new save or a load of the same root waits for the
previous save first. A thread save runs its collectives on a gloo group of its own, so that they
never interleave with training collectives on the caller's group.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from torchside.checkpoint import _dcp_compat, checksums, commit, quantized_params, validate
from torchside.checkpoint.app_state import AppState
from torchside.checkpoint.checksums import ChecksummedWriter

_PENDING: dict[Path, SaveHandle] = {}  # checkpoint root -> its save in flight (this process)
_ASYNC_GROUPS: dict[tuple[int, ...], dist.ProcessGroup] = {}  # ranks -> a gloo group for background saves


@dataclass
class SaveHandle:
    """A save in flight (or done). `wait()` blocks until it is written (and, on rank 0, published)."""

    root: Path
    step: int
    future: Future | None = None  # None: a sync save, already published
    _publish: Any = None  # rank 0: () -> Path, run once when the files are written
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _outcome: Path | BaseException | None = None

    @property
    def path(self) -> Path:
        """Where the committed checkpoint is (or will be)."""
        return commit.step_dir(self.root, self.step)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self) -> Path:
        """Block until written and published; re-raise what went wrong in the background."""
        if self.future is not None:
            self.future.result()
        self._publish_once()
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self.path

    def _publish_once(self, _future: Future | None = None) -> None:
        with self._lock:
            if self._outcome is not None or self._publish is None:
                return
            try:
                if _future is not None and _future.exception() is not None:
                    raise _future.exception()
                self._outcome = self._publish()
            except BaseException as error:  # kept for wait(): the callback thread cannot raise to the caller
                self._outcome = error


def save(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    extra: dict[str, Any] | None = None,
    async_mode: str | None = None,
    keep_last: int | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> SaveHandle:
    """Save model, optimizer, FP8 scaling state, step and RNG under `directory/step-N` (every rank calls it).

    `async_mode`: None (write now), "thread" or "process" (return after staging; `handle.wait()`
    before relying on the files). `extra`: JSON-serializable values kept in the metadata.
    `keep_last`: keep only that many committed steps. Any topology can load the result.
    """
    _check_arguments(step, extra, async_mode, keep_last)
    root = Path(directory)
    pending = _PENDING.pop(root, None)
    if pending is not None:
        pending.wait()
    use_dist = dist.is_initialized()
    rank = dist.get_rank(process_group) if use_dist else 0
    app = AppState(model, optimizer, step=step, process_group=process_group)
    state = app.state_dict()
    if rank == 0:
        commit.prepare_staging(root, step)
    if use_dist:
        dist.barrier(group=process_group)
    metadata = _metadata(app, extra, process_group) if rank == 0 else None
    writer = ChecksummedWriter(commit.staging_dir(root, step))
    handle = SaveHandle(root, step)
    if rank == 0:
        handle._publish = lambda: _publish(root, step, metadata, keep_last)
    if async_mode is None:
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=not use_dist)
        handle.wait()
        if use_dist:
            dist.barrier(group=process_group)  # nobody looks for the step before rank 0 published it
        return handle
    group = _background_group(process_group) if use_dist and async_mode == "thread" else process_group
    handle.future = _dcp_compat.async_save(state, writer, group, async_mode, no_dist=not use_dist)
    handle.future.add_done_callback(handle._publish_once)
    _PENDING[root] = handle
    return handle


def wait_for_pending(root: Path) -> None:
    """Finish this process's save in flight under `root`, if any."""
    pending = _PENDING.pop(root, None)
    if pending is not None:
        pending.wait()


def _check_arguments(step, extra, async_mode, keep_last) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"save(step={step!r}): pass the training step as an int >= 0")
    if async_mode is not None and async_mode not in _dcp_compat.ASYNC_MODES:
        raise ValueError(f"save(async_mode={async_mode!r}): use None, 'thread' or 'process'")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"save(keep_last={keep_last!r}): pass None (keep all) or an int >= 1")
    try:
        json.dumps(extra)
    except TypeError as error:
        raise TypeError(f"save(extra=...) must be JSON-serializable (nothing is pickled): {error}") from None


def _metadata(app: AppState, extra: dict[str, Any] | None, group: dist.ProcessGroup | None) -> dict[str, Any]:
    return {
        "step": app.step,
        "extra": extra,
        "world_size": dist.get_world_size(group) if dist.is_initialized() else 1,
        "param_groups": app.param_groups() if app.optimizer is not None else None,
        "fp8_params": {fqn: quantized_params.describe(p) for fqn, p in app.fp8_params.items()},
        **validate.glu_interleave(app.model),
        "torch_version": torch.__version__,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _publish(root: Path, step: int, metadata: dict[str, Any], keep_last: int | None) -> Path:
    """Rank 0, once DCP wrote `.metadata`: record its checksum (a pickle DCP does not check), then commit."""
    dcp_metadata = commit.staging_dir(root, step) / ".metadata"
    if dcp_metadata.exists():  # else publish refuses the step
        metadata = {**metadata, validate.DCP_METADATA_CHECKSUM: list(checksums.file_checksum(dcp_metadata))}
    return commit.publish(root, step, metadata, keep_last)


def _background_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A gloo group over `group`'s ranks for a background save's collectives (made once, reused)."""
    ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    if ranks not in _ASYNC_GROUPS:
        _ASYNC_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True)
    return _ASYNC_GROUPS[ranks]
