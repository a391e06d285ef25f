"""The co-located runtime: one process per device hosts one torch rank and one JAX process.

Processes are started by torchrun's own machinery (`torch.distributed.run`, or in Python
`launch`, which calls `torch.distributed.launcher.api.elastic_launch`); multi-node runs use
torchrun's rendezvous, and rank 0's host becomes JAX's coordinator. In each process
`initialize` brings up, in this order:

- torch: NCCL on `cuda:LOCAL_RANK` (`torch.cuda.set_device` first), or gloo on the CPU;
- JAX: `jax.distributed.initialize(coordinator, WORLD_SIZE, RANK)` with
  `local_device_ids=[LOCAL_RANK]` and `XLA_PYTHON_CLIENT_PREALLOCATE=false` on CUDA (JAX then
  allocates what its programs need, beside torch's caching allocator), or one CPU device per
  process with JAX's CPU collectives over gloo.

So JAX process i is torch rank i and owns the same device. `jax_mesh(device_mesh)` builds the
JAX mesh of a torch DeviceMesh (same shape, axis names and rank at every coordinate) and checks
with bridge.layout that both place a probe tensor identically.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch.distributed.elastic.multiprocessing.errors import record

if TYPE_CHECKING:
    import jax
    from jax.sharding import Mesh
    from torch.distributed.device_mesh import DeviceMesh

DEVICES = ("cpu", "cuda")
_FORCED_CPU_DEVICES = re.compile(r"--xla_force_host_platform_device_count=\d+")


@dataclass(frozen=True)
class Runtime:
    """What one co-located process is: its ranks, its torch device and its JAX device."""

    rank: int
    local_rank: int
    world_size: int
    device_type: str  # "cpu" or "cuda"
    jax_device: jax.Device

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device_type, self.local_rank) if self.device_type == "cuda" else torch.device("cpu")


def default_device_type() -> str:
    """"cuda" where torch sees a GPU, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def launch(
    fn: Callable[..., Any], nprocs: int, *args: Any, device_type: str | None = None, timeout_s: float = 600.0
) -> list[Any]:
    """Run `fn(runtime, *args)` in `nprocs` co-located processes on this node; their results in rank order.

    `fn` must be a module-level function (it is pickled by name); a failing rank raises
    torch's ChildFailedError with that rank's traceback. The workers' stdout goes to log files
    deleted afterwards (this process's stdout stays the caller's); stderr is shared.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"launch(nprocs={nprocs!r}): pass the number of processes, an integer >= 1")
    device_type = device_type or default_device_type()
    _check_device_type(device_type, nprocs)
    with tempfile.TemporaryDirectory(prefix="shardbridge-logs-") as logs:  # removed after the launch
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=nprocs,
            run_id=f"shardbridge-{uuid.uuid4().hex[:8]}",
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",  # a free port, as `torchrun --standalone`
            max_restarts=0,
            monitor_interval=0.1,
            start_method="spawn",
            logs_specs=DefaultLogsSpecs(log_dir=logs, redirects=Std.OUT),  # workers' stdout (gloo's chatter)
        )
        with ctrl_c_as_keyboard_interrupt():
            results = elastic_launch(config, _worker)(fn, args, device_type, timeout_s)
    return [results[rank] for rank in range(nprocs)]


@contextlib.contextmanager
def ctrl_c_as_keyboard_interrupt() -> Iterator[None]:
    """torchrun's agent turns Ctrl-C into SignalException after stopping its workers: back to KeyboardInterrupt."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        yield
    except SignalException as received:
        if received.sigval != signal.SIGINT:
            raise
        raise KeyboardInterrupt from received


@record
def _worker(fn: Callable[..., Any], args: Sequence[Any], device_type: str, timeout_s: float) -> Any:
    runtime = initialize(device_type, timeout_s=timeout_s)
    try:
        return fn(runtime, *args)
    finally:
        shutdown()


def initialize(device_type: str | None = None, *, timeout_s: float = 600.0) -> Runtime:
    """Bring up torch's process group, then JAX's, in a process torchrun started (reads RANK, LOCAL_RANK, ...)."""
    import torch
    import torch.distributed as dist

    missing = [name for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR") if name not in os.environ]
    if missing:
        raise ValueError(
            f"initialize() needs torchrun's environment ({', '.join(missing)} unset): start the script with "
            "`shardbridge run -n N script.py` or `torchrun --nproc-per-node N script.py`"
        )
    rank, local_rank, world_size = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device_type = device_type or default_device_type()
    _check_device_type(device_type, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    _prepare_jax_environment(device_type)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", timeout=timeout, device_id=torch.device("cuda", local_rank))
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world_size))))
        dist.init_process_group("gloo", timeout=timeout)
    jax_device = _initialize_jax(device_type, rank, local_rank, world_size)
    return Runtime(rank, local_rank, world_size, device_type, jax_device)


def shutdown() -> None:
    """Tear down JAX's distributed runtime and torch's process group (whichever are up)."""
    import jax
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()  # no process leaves while another still talks to it
    jax.distributed.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


def choose_device_type(requested: str | None, processes: int, gpus: int) -> tuple[str, str | None]:
    """The device type for `processes` co-located processes on a node with `gpus` GPUs, and a note if it fell back.

    The default (None) is a process per GPU where there are enough GPUs, else CPU processes (the note says
    so); an explicit "cuda" with too few GPUs is a ValueError naming the fix.
    """
    if requested not in (None, *DEVICES):
        raise ValueError(f"device type {requested!r}: use one of {DEVICES}")
    if requested == "cpu" or (requested is None and gpus == 0):
        return "cpu", None
    if gpus >= processes:
        return "cuda", None
    if requested == "cuda":
        raise ValueError(_too_few_gpus(processes, gpus))
    note = f"{processes} processes need {processes} GPUs but torch sees {gpus}: running {processes} CPU processes"
    return "cpu", note


def _too_few_gpus(processes: int, gpus: int) -> str:
    return (
        f"{processes} processes per node need {processes} GPUs but torch sees {gpus}: "
        "start fewer processes, or run on the CPU (device type 'cpu')"
    )


def _check_device_type(device_type: str, local_processes: int) -> None:
    if device_type not in DEVICES:
        raise ValueError(f"device type {device_type!r}: use one of {DEVICES}")
    if device_type == "cuda":
        import torch

        available = torch.cuda.device_count()
        if local_processes > available:
            raise ValueError(_too_few_gpus(local_processes, available))


def _prepare_jax_environment(device_type: str) -> None:
    """Before JAX's backends start: no preallocation on CUDA; one CPU device per process on the CPU."""
    if device_type == "cuda":
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    flags = _FORCED_CPU_DEVICES.sub("", os.environ.get("XLA_FLAGS", "")).strip()  # a test's 8 host devices
    os.environ["XLA_FLAGS"] = flags


def _initialize_jax(device_type: str, rank: int, local_rank: int, world_size: int) -> jax.Device:
    import jax
    import torch.distributed as dist

    if device_type == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    port = [_free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)  # torch's group is up: it tells everyone the coordinator's port
    options = {"local_device_ids": [local_rank]} if device_type == "cuda" else {}
    jax.distributed.initialize(
        coordinator_address=f"{os.environ['MASTER_ADDR']}:{port[0]}",
        num_processes=world_size,
        process_id=rank,
        **options,
    )
    local = jax.local_devices()
    if len(local) != 1 or local[0].process_index != rank:
        raise RuntimeError(
            f"JAX process {rank} sees local devices {local}; the co-located runtime needs exactly one, its own"
        )
    return local[0]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def jax_mesh(device_mesh: DeviceMesh, axis_names: Sequence[str] | None = None) -> Mesh:
    """The JAX mesh of a torch DeviceMesh: same shape and axis names, the device of rank r where torch has rank r.

    `axis_names` renames the axes (default: the DeviceMesh's names). Checked with `check_mesh`.
    """
    import jax
    import numpy as np
    from jax.sharding import Mesh

    names = tuple(axis_names or device_mesh.mesh_dim_names or ())
    if len(names) != device_mesh.ndim:
        raise ValueError(
            f"the DeviceMesh has {device_mesh.ndim} dims but axis names {names}: name its dims "
            "(init_device_mesh(..., mesh_dim_names=...)) or pass axis_names"
        )
    device_of_rank = {device.process_index: device for device in jax.devices()}
    ranks = device_mesh.mesh.tolist()
    devices = np.vectorize(lambda r: device_of_rank[r], otypes=[object])(np.asarray(ranks))
    mesh = Mesh(devices, names)
    check_mesh(device_mesh, mesh)
    return mesh


def check_mesh(device_mesh: DeviceMesh, mesh: Mesh) -> None:
    """ValueError unless both meshes put each block of a probe tensor on the same rank (bridge.layout decides)."""
    from jax.sharding import NamedSharding, PartitionSpec
    from torch.distributed.tensor import Shard

    from bridge import layout

    torch_spec = layout.MeshSpec(
        tuple(device_mesh.mesh.shape), tuple(mesh.axis_names), tuple(device_mesh.mesh.flatten().tolist())
    )
    probe_shape = (torch_spec.size,)  # one element per rank: mesh dims split it most significant first
    torch_map = layout.from_placements(torch_spec, [Shard(0)] * torch_spec.ndim, probe_shape)
    jax_map = layout.from_named_sharding(NamedSharding(mesh, PartitionSpec(tuple(mesh.axis_names))), probe_shape)
    verdict = layout.compare(torch_map, jax_map)
    if not verdict.equal:
        raise ValueError(f"the JAX mesh does not match the torch DeviceMesh: {verdict.reason}")


__all__ = ["DEVICES", "Runtime", "check_mesh", "default_device_type", "initialize", "jax_mesh", "launch", "shutdown"]
