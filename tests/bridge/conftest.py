"""Fixtures shared by the bridge tests."""

import pytest


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
