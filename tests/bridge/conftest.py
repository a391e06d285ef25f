"""Fixtures shared by the bridge tests."""

from dataclasses import dataclass
from typing import Any

import pytest


@dataclass(frozen=True)
class Launch:
    """One bridge.runtime.launch a command asked for."""

    worker: str  # the function's name
    processes: int
    args: tuple  # what each process gets after the runtime
    device_type: str | None


@pytest.fixture
def launches(monkeypatch) -> list[Launch]:
    """bridge.runtime.launch stopped before any process starts (a KeyboardInterrupt, the CLI's exit 130):
    the launches asked for, for tests of what a command decides to run."""
    from bridge import runtime

    asked: list[Launch] = []

    def stop(fn, nprocs: int, *args: Any, device_type: str | None = None, **kwargs: Any):
        asked.append(Launch(fn.__name__, nprocs, args, device_type))
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime, "launch", stop)
    return asked


@pytest.fixture
def one_rank_world():
    """A one-rank gloo world's (dp_replicate, dp_shard, tp) torch mesh and the JAX mesh of this process's first device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from jaxside.sharding import make_mesh
    from torchside.parallel import MESH_AXES

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = init_device_mesh("cpu", (1, 1, 1), mesh_dim_names=MESH_AXES)
    yield world, make_mesh()
    dist.destroy_process_group()
