"""What `dcp.async_save` accepts and returns, in one place (torch 2.11 on the GPU machine, 2.13 in CI).

Both releases take `async_checkpointer_type=AsyncCheckpointerType.THREAD | PROCESS` (process: a
daemon process with its own gloo group, started on first use, reused after). Both may return an
`AsyncSaveResponse` (staging and upload futures) instead of a plain Future when a non-blocking
stager is passed; we pass none, but normalize anyway. A release without the argument supports
only threads: asking it for a process raises instead of silently using a thread.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Future

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.storage import StorageWriter

ASYNC_MODES = ("thread", "process")


def async_save(
    state: dict, writer: StorageWriter, group: dist.ProcessGroup | None, mode: str, no_dist: bool
) -> Future:
    """Start `dcp.async_save` in `mode` ("thread" or "process"); a Future that completes when written."""
    kwargs = {"storage_writer": writer, "process_group": group, "no_dist": no_dist}
    if "async_checkpointer_type" in inspect.signature(dcp.async_save).parameters:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kwargs["async_checkpointer_type"] = AsyncCheckpointerType(mode)
    elif mode != "thread":
        raise ValueError(f"async_mode={mode!r} needs a torch whose dcp.async_save takes async_checkpointer_type")
    if mode == "process" and not dist.is_initialized():  # its daemon joins the default group (torch 2.11)
        raise ValueError(
            "async_mode='process' needs torch.distributed initialized (one process: "
            "dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())); or use 'thread'"
        )
    result = dcp.async_save(state, **kwargs)
    return getattr(result, "upload_completion", result)
