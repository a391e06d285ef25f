"""Shard maps against what DTensor and FSDP2 really do, on torch's threaded process group.

Every case distributes an `arange` global, whose elements carry their own flat index,
and checks each rank's local tensor against the map's prediction. Many cases share one
`run_threads` launch so the file stays at a few seconds.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from bridge import layout
from torchside.parallel import _torch_compat
from bridge.layout import MeshSpec, ShardMap
from tests.bridge.layout_cases import GOLDEN_NAMES, arange_global, assert_same, load_golden, placement_cases
from tests.distributed import run_threads

CASES_PER_LAUNCH = 30

pytestmark = pytest.mark.usefixtures("reference_kernels")  # tests/conftest.py: what threaded ranks run


def _distribute_cases(rank, world_size, mesh_shape, axis_names, cases):
    """On each rank: the local tensor of every (placements, shape) case, and the map read from the live DTensor."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    device_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=axis_names)
    results = []
    for placements, shape, src_data_rank in cases:
        global_tensor = torch.from_numpy(arange_global(shape))
        dtensor = distribute_tensor(global_tensor, device_mesh, placements, src_data_rank=src_data_rank)
        results.append((dtensor.to_local().numpy(), layout.from_dtensor(dtensor).to_json()))
    return results


# 1-D to 3-D, up to 8 ranks, with uneven axis sizes and a size-1 axis.
LIVE_MESHES = [MeshSpec(shape, ("x", "y", "z")[: len(shape)]) for shape in [(4,), (8,), (4, 2), (2, 3), (2, 2, 2), (2, 1, 4)]]


# No shrinking: each shrink step would be another launch; the failure message names the case instead.
@pytest.mark.parametrize("mesh", LIVE_MESHES, ids=lambda mesh: "x".join(map(str, mesh.shape)))
@settings(derandomize=True, database=None, deadline=None, max_examples=3, phases=[Phase.explicit, Phase.generate])
@given(data=st.data())
def test_placement_maps_match_live_dtensors(mesh, data):
    drawn = data.draw(st.lists(placement_cases(mesh), min_size=CASES_PER_LAUNCH, max_size=CASES_PER_LAUNCH))
    predicted = [layout.from_placements(mesh, placements, shape) for placements, shape in drawn]
    cases = [(placements, shape, _src_data_rank(placements, m)) for (placements, shape), m in zip(drawn, predicted)]
    per_rank = run_threads(_distribute_cases, mesh.size, mesh.shape, mesh.axis_names, cases)
    for case, (shard_map, (placements, shape)) in enumerate(zip(predicted, drawn)):
        locals_by_coordinate = {}
        for coordinate in mesh.coordinates():
            local, live_map = per_rank[mesh.rank_of(coordinate)][case]
            assert_same(ShardMap.from_json(live_map), shard_map)
            assert local.shape == shard_map.local_shape(coordinate), (placements, shape, coordinate)
            locals_by_coordinate[coordinate] = local
        _assert_values_match(shard_map, locals_by_coordinate, placements, shape)


def _src_data_rank(placements, shard_map: ShardMap) -> int | None:
    """0 (scatter from rank 0, the default) unless torch 2.13 cannot scatter the case.

    Its scatter path raises a bare AssertionError for _StridedShard shards of unequal
    sizes; `None` splits locally on every rank, by the same rule.
    """
    strided = any(_torch_compat.is_strided_shard(p) for p in placements)
    equal_sizes = len({shard_map.local_shape(c) for c in shard_map.mesh.coordinates()}) == 1
    return None if strided and not equal_sizes else 0


def _assert_values_match(shard_map: ShardMap, locals_by_coordinate, placements, shape) -> None:
    """A local holds global[indices]; along Partial axes the locals are summands of it."""
    expected = arange_global(shape)
    partial_dims = [shard_map.mesh.axis_index(name) for name in shard_map.partial_axes]
    for coordinate, local in locals_by_coordinate.items():
        summands = [
            other
            for peer, other in locals_by_coordinate.items()
            if all(peer[d] == coordinate[d] for d in range(len(coordinate)) if d not in partial_dims)
        ]
        held = expected[np.ix_(*shard_map.indices[coordinate])]
        np.testing.assert_allclose(sum(summands), held, err_msg=f"{placements} {shape} {coordinate}")


# --- FSDP2 on top of TP: the live layouts of Linear weights ---------------------------------------


def _fsdp_on_tp(rank, world_size):
    """Colwise/rowwise TP then fully_shard on a (dp=4, tp=2) mesh and an HSDP (2, 2, 2) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dp_tp = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    hsdp = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    setups = {
        "dp4_tp2_column": (dp_tp, 8, ColwiseParallel(), ("dp",)),
        "dp4_tp2_row": (dp_tp, 8, RowwiseParallel(), ("dp",)),
        "dp4_tp2_column_uneven": (dp_tp, 6, ColwiseParallel(), ("dp",)),
        "hsdp2x2_tp2_column": (hsdp, 8, ColwiseParallel(), ("rep", "shard")),
    }
    weights = {}
    for name, (mesh, out_features, style, fsdp_axes) in setups.items():
        linear = torch.nn.Linear(16, out_features, bias=False)
        with torch.no_grad():
            linear.weight.copy_(torch.from_numpy(arange_global((out_features, 16))))
        parallelize_module(linear, mesh["tp"], style)
        fully_shard(linear, mesh=mesh[fsdp_axes])
        weights[name] = (linear.weight.to_local().detach().numpy(), layout.from_dtensor(linear.weight).to_json())
    return weights


@pytest.fixture(scope="module")
def fsdp_weights():
    """Per rank, {golden name: (local weight, map read from the live DTensor)}: one launch for the module."""
    return run_threads(_fsdp_on_tp, 8)


def test_seed_example_fsdp_on_tp_rank_i_j_holds_row_4j_plus_i(fsdp_weights):
    for rank, weights in enumerate(fsdp_weights):
        i, j = divmod(rank, 2)  # (dp, tp) mesh in rank order
        local, _ = weights["dp4_tp2_column"]
        np.testing.assert_array_equal(local, arange_global((8, 16))[[4 * j + i]])


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_fsdp_on_tp_matches_the_golden_map(fsdp_weights, name):
    golden = ShardMap.from_json(load_golden(name)["shard_map"])
    for coordinate in golden.mesh.coordinates():
        local, live_map = fsdp_weights[golden.mesh.rank_of(coordinate)][name]
        assert_same(ShardMap.from_json(live_map), golden)
        np.testing.assert_array_equal(local, arange_global(golden.global_shape)[np.ix_(*golden.indices[coordinate])])



# --- our modules: a parallelized TransformerLayer stack -------------------------------------------

STACK_MESHES = {"fsdp2_tp2": ((2, 2), ("dp", "tp")), "hsdp2x2_tp2": ((2, 2, 2), ("rep", "dp", "tp"))}


def _parallelized_stack(rank, world_size, shape, names):
    """Every parameter of a parallelized 2-layer stack: (name, placements, local, full, live map, coordinate)."""
    from torch.distributed.device_mesh import init_device_mesh

    from torchside.modules import ModuleConfig, TransformerConfig, TransformerLayer
    from torchside.parallel import parallelize
    from torchside.parallel.module_mesh import local_tensor

    world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_names = names[:-1]
    weight_mesh = world[(dp_names[-1], "tp")]._flatten("dp_tp")
    module_config = ModuleConfig(tp_size=2, sequence_parallel=True)
    layers = [  # a Llama block (RMSNorm, SwiGLU, no bias) and a GPT block (LayerNorm, GELU, biases)
        TransformerLayer(64, 128, 4, num_gqa_groups=2, config=TransformerConfig(
            normalization="RMSNorm", activation="swiglu", bias=False, module_config=module_config), tp_mesh=world["tp"]),
        TransformerLayer(64, 128, 4, num_gqa_groups=2, config=TransformerConfig(
            module_config=module_config), tp_mesh=world["tp"]),
    ]  # fmt: skip
    model = torch.nn.Sequential(*layers)
    # Threads share torch's RNG: give every TP shard values of its own, the same on its replicas (its
    # data-parallel peers; for a TP-replicated parameter, every rank).
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):
            split = any(p.is_shard() for p in getattr(param, "placements", ()))
            generator = torch.Generator().manual_seed(2 * index + (world["tp"].get_local_rank() if split else 0))
            local_tensor(param).copy_(torch.randn(local_tensor(param).shape, generator=generator))
    model = parallelize(model, world[dp_names], weight_mesh=weight_mesh)
    coordinate = tuple(world.get_coordinate())
    return [
        (name, p.placements, p.to_local().detach().numpy(), p.full_tensor().detach().numpy(), layout.from_dtensor(p).to_json(), coordinate)
        for name, p in model.named_parameters()
    ]  # fmt: skip


@pytest.mark.parametrize("mesh_name", STACK_MESHES)
def test_parallelized_transformer_stack_matches_the_bridge_prediction(reference_kernels, mesh_name):
    """For every parameter: each rank holds exactly what the bridge's shard map says, and the bridge's
    PartitionSpec for the Flax kernel ([in, out]) makes JAX's own devices_indices_map put the same
    elements on the same devices (the gated fc1 included: its rows interleave gate and up)."""
    import jax
    from jax.sharding import Mesh, NamedSharding

    from bridge.layout.translate import placements_to_pspec

    shape, names = STACK_MESHES[mesh_name]
    per_rank = run_threads(_parallelized_stack, math.prod(shape), shape, names)
    mesh = MeshSpec(shape, names)
    jax_mesh = Mesh(np.array(jax.devices()[: mesh.size]).reshape(shape), names)
    without_equivalent = {}
    for index, (name, placements, _, full, live_json, _) in enumerate(per_rank[0]):
        predicted = layout.from_placements(mesh, placements, full.shape)
        for rank_results in per_rank:
            _, _, local, _, live_rank_json, coordinate = rank_results[index]
            assert_same(ShardMap.from_json(live_rank_json), predicted)
            np.testing.assert_array_equal(local, full[np.ix_(*predicted.indices[coordinate])], err_msg=f"{name} {coordinate}")
        transpose = full.ndim == 2
        try:
            pspec = placements_to_pspec(mesh, placements, full.shape, transpose=transpose)
        except ValueError as error:
            without_equivalent[name] = str(error)
            continue
        flax_shape = full.shape[::-1] if transpose else full.shape
        jax_map = layout.from_named_sharding(NamedSharding(jax_mesh, pspec), flax_shape)
        torch_map = layout.from_placements(mesh, placements, full.shape)
        for coordinate in mesh.coordinates():
            torch_indices = torch_map.indices[coordinate]
            jax_indices = jax_map.indices[coordinate][::-1] if transpose else jax_map.indices[coordinate]
            for dim, (ours, theirs) in enumerate(zip(torch_indices, jax_indices)):
                np.testing.assert_array_equal(np.asarray(ours), np.asarray(theirs), err_msg=f"{name} dim {dim}")
    assert not without_equivalent, without_equivalent  # every dim divides evenly: JAX has each layout
