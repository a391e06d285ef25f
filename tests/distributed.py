"""Run a function on N ranks: real processes (gloo on CPU, or NCCL with one GPU per rank), or threads.

Both call `fn(rank, world_size, *args)` after the default process group is up and
return the per-rank results in rank order. A rank that raises fails the call with its
traceback; a rank that hangs fails it after `timeout` seconds with its stack. No
process is left behind.
"""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class RankError(RuntimeError):
    """One or more ranks raised, hung, or died; the message holds their tracebacks."""


def _process_main(fn, rank, world_size, port, args, results, stack_file, timeout, backend):
    with open(stack_file, "w") as stacks:
        # The parent sends SIGUSR1 to a rank that hangs, to learn where it is stuck.
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        torch.set_num_threads(1)  # N ranks share the cores; oversubscription only slows them
        if backend == "nccl":
            torch.cuda.set_device(rank)  # one GPU per rank, before NCCL binds a communicator to a device
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        # gloo's own timeout is longer than ours, so a hang is reported here, with stacks.
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout + 60)
        )
        results.put((rank, "ready", None))
        try:
            # Pickled by value here: the queue's own pickler would pass tensors as shared-memory file
            # descriptors, which the parent can no longer fetch once this process has exited.
            results.put((rank, "ok", pickle.dumps(fn(rank, world_size, *args))))
        except BaseException:
            results.put((rank, "error", traceback.format_exc()))
        finally:
            dist.destroy_process_group()


STARTUP_TIMEOUT = 180.0  # spawning N processes that import torch is slow on a loaded 2-core machine


BACKENDS = ("gloo", "nccl")


def run_processes(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, backend: str = "gloo"
) -> list[Any]:
    """Run `fn` on `world_size` spawned processes joined by a `backend` process group.

    `fn` must be a module-level function (it is pickled by name) and return picklable values.
    `timeout` counts from the moment every rank has joined the process group. With "nccl", rank r
    runs on CUDA device r (`torch.cuda.set_device(r)` before the group starts): put tensors on
    `torch.device("cuda", rank)` and return CPU values.
    """
    if backend not in BACKENDS:
        raise ValueError(f"run_processes(backend={backend!r}): use one of {BACKENDS}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(
            f"run_processes(backend='nccl') needs one CUDA device per rank: {world_size} ranks, "
            f"{torch.cuda.device_count()} devices; use fewer ranks or backend='gloo'"
        )
    ctx = multiprocessing.get_context("spawn")
    # The parent owns the rendezvous store: its port is bound before any child starts (no race).
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as scratch:
        stack_files = [Path(scratch, f"rank{r}.stack") for r in range(world_size)]
        procs = [
            ctx.Process(
                target=_process_main,
                args=(fn, r, world_size, store.port, args, results, str(stack_files[r]), timeout, backend),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, stack_files, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            results.close()
            del store


def _collect(procs, results, stack_files, timeout) -> list[Any]:
    world_size = len(procs)
    ready: set[int] = set()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while len(values) + len(errors) < world_size and not errors:
        try:
            rank, kind, payload = results.get(timeout=0.2)
        except queue.Empty:
            kind = None
        if kind == "ready":
            ready.add(rank)
            if len(ready) == world_size:  # the clock for `fn` starts now
                deadline = time.monotonic() + timeout
            continue
        if kind is not None:
            if kind == "ok":
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
            continue
        for rank, p in enumerate(procs):
            if rank not in values and rank not in errors and p.exitcode is not None and results.empty():
                errors[rank] = f"exited with code {p.exitcode} without reporting a result\n"
        if time.monotonic() > deadline:
            limit = timeout if len(ready) == world_size else STARTUP_TIMEOUT
            missing = [r for r in range(world_size) if r not in values and r not in errors]
            for r in missing:
                if procs[r].is_alive():
                    os.kill(procs[r].pid, signal.SIGUSR1)
            time.sleep(1.0)  # let faulthandler write the stacks
            for r in missing:
                stack = stack_files[r].read_text() if stack_files[r].exists() else "(not started)"
                errors[r] = f"did not finish within {limit:.0f} s; its stack:\n{stack}"
    if errors:
        raise RankError(_report(errors))
    return [values[r] for r in range(world_size)]


def _report(errors: dict[int, str]) -> str:
    return "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in sorted(errors.items()))


def run_threads(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    """Run `fn` on `world_size` threads joined by torch's threaded process group.

    Real collectives (DTensor, FSDP2 and DCP work on it) at thread cost. The threaded
    group is a private torch testing API; this function is the only place that uses it.
    """
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
        _uninstall_threaded_pg,
    )

    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    world = _install_threaded_pg()
    store = dist.HashStore()

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            values[rank] = fn(rank, world_size, *args)
        except BaseException as error:
            if not isinstance(error, SystemExit):  # SystemExit: woken by another rank's failure
                errors[rank] = traceback.format_exc()
            ProcessLocalGroup.exception_handle(error)  # wake the ranks waiting in a collective
        finally:
            if dist.distributed_c10d._world is world:
                try:
                    dist.destroy_process_group()
                except AttributeError:  # torch 2.11's ThreadLocalWorld lacks `comms`; the group dies with the world
                    pass

    threads = [threading.Thread(target=worker, args=(r,), daemon=True, name=f"rank{r}") for r in range(world_size)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, t in enumerate(threads) if t.is_alive()]
        if hung:
            frames = sys._current_frames()
            for r in hung:
                stack = "".join(traceback.format_stack(frames[threads[r].ident])) if threads[r].ident in frames else ""
                errors[r] = f"did not finish within {timeout:.0f} s; its stack:\n{stack}"
            ProcessLocalGroup.exception_handle(TimeoutError())  # release ranks stuck in collectives
            for t in threads:
                t.join(5)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise RankError(_report(errors))
    return [values[r] for r in range(world_size)]
