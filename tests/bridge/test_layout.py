"""Shard maps against closed forms, golden files and JAX itself (8 host CPU devices).

Live DTensor and FSDP2 checks are in test_layout_live.py; the CLI in test_layout_cli.py.
Helpers shared with them are in layout_cases.py.
"""

from __future__ import annotations

import itertools
import json
import math

import jax
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torch.distributed.tensor import Partial, Replicate, Shard

from bridge import layout
from torchside.parallel._torch_compat import make_strided_shard
from bridge.layout import MeshSpec, ShardMap
from bridge.layout import translate as layout_translate
from bridge.layout.text import (
    format_indices,
    format_placements,
    format_pspec,
    parse_mesh,
    parse_placements,
    parse_pspec,
    parse_shape,
)
from tests.bridge.layout_cases import GOLDEN_NAMES, arange_global, assert_same, load_golden, placement_cases

DETERMINISTIC = settings(derandomize=True, database=None, deadline=None, max_examples=50)
DP4_TP2 = MeshSpec((4, 2), ("dp", "tp"))


def jax_mesh(mesh: MeshSpec) -> Mesh:
    """The JAX mesh in torch rank order: device i of jax.devices('cpu') is rank i, reshaped row-major."""
    return Mesh(np.array(jax.devices("cpu")[: mesh.size]).reshape(mesh.shape), mesh.axis_names)


# --- strategies ---------------------------------------------------------------------


@st.composite
def meshes(draw, max_devices: int = 8) -> MeshSpec:
    """1-D to 3-D meshes, axis sizes 1..4, at most `max_devices` devices."""
    sizes: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        sizes.append(draw(st.integers(1, min(4, max_devices // math.prod(sizes)))))
    return MeshSpec(tuple(sizes), ("x", "y", "z")[: len(sizes)])


@st.composite
def pspec_cases(draw, mesh: MeshSpec) -> tuple[P, tuple[int, ...]]:
    """(PartitionSpec, shape): each mesh axis unused or splitting one dim, in a drawn order."""
    ndim = draw(st.integers(1, 2))
    axes_per_dim: list[list[str]] = [[] for _ in range(ndim)]
    for name in draw(st.permutations(mesh.axis_names)):
        dim = draw(st.sampled_from([-1, *range(ndim), *range(ndim)]))  # -1: axis unused
        if dim >= 0:
            axes_per_dim[dim].append(name)
    parts = [math.prod(mesh.shape[mesh.axis_index(name)] for name in axes) for axes in axes_per_dim]
    shape = tuple(n * draw(st.integers(1, 3)) + draw(st.sampled_from([0, 0, 1])) for n in parts)  # +1: uneven
    return P(*(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None) for axes in axes_per_dim)), shape


def every_pspec(mesh: MeshSpec, ndim: int):
    """All PartitionSpecs of a mesh for `ndim` dims: each axis unused or on one dim, in every order."""
    for assignment in itertools.product(range(-1, ndim), repeat=mesh.ndim):
        per_dim = [[name for name, d in zip(mesh.axis_names, assignment) if d == dim] for dim in range(ndim)]
        for orders in itertools.product(*(itertools.permutations(axes) for axes in per_dim)):
            yield P(*(tuple(axes) if axes else None for axes in orders))


# --- the seeds' example and the golden files ----------------------------------------------------


def test_seed_example_rank_i_j_holds_row_4j_plus_i():
    placements = (make_strided_shard(0, 2), Shard(0))
    torch_map = layout.from_placements(DP4_TP2, placements, (8, 16))
    jax_array = jax.device_put(arange_global((8, 16)), NamedSharding(jax_mesh(DP4_TP2), P(("tp", "dp"))))
    for i, j in DP4_TP2.coordinates():
        assert torch_map.indices[(i, j)][0].tolist() == [4 * j + i]
        assert torch_map.indices[(i, j)][1].tolist() == list(range(16))
    assert format_pspec(layout_translate.placements_to_pspec(DP4_TP2, placements, (8, 16))) == "P(('tp', 'dp'), None)"
    assert_same(torch_map, layout.from_jax_array(jax_array))
    for shard in jax_array.addressable_shards:
        i, j = np.unravel_index(jax.devices("cpu").index(shard.device), (4, 2))
        assert np.asarray(shard.data)[:, 0].tolist() == [16 * (4 * j + i)]


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_map_matches_placements_and_jax(name):
    golden = load_golden(name)
    expected = ShardMap.from_json(golden["shard_map"])
    mesh, shape = expected.mesh, expected.global_shape
    placements = parse_placements(golden["placements"])
    assert_same(layout.from_placements(mesh, placements, shape), expected)
    sharding = NamedSharding(jax_mesh(mesh), parse_pspec(golden["pspec"]))
    if golden["jax_accepts"]:
        assert format_pspec(layout_translate.placements_to_pspec(mesh, placements, shape)) == golden["pspec"]
        assert_same(layout.from_pspec(mesh, parse_pspec(golden["pspec"]), shape), expected)
        assert_same(layout.from_named_sharding(sharding, shape), expected)
        live = jax.device_put(arange_global(shape), sharding)
        assert_same(layout.from_jax_array(live), expected)
    else:
        with pytest.raises(ValueError, match="JAX rejects dims that do not divide evenly"):
            layout_translate.placements_to_pspec(mesh, placements, shape)
        with pytest.raises(ValueError, match="should evenly divide"):  # JAX's own IndivisibleError
            sharding.devices_indices_map(shape)
        with pytest.raises(ValueError, match="JAX rejects"):
            layout.from_named_sharding(sharding, shape)


# --- translation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "placements, pspec",
    [
        ("Shard(0), Shard(0)", "P(('dp', 'tp'), None)"),
        ("_StridedShard(0, sf=2), Shard(0)", "P(('tp', 'dp'), None)"),
        ("Shard(0), Shard(1)", "P('dp', 'tp')"),
        ("Replicate(), Shard(0)", "P('tp', None)"),
        ("Replicate(), Replicate()", "P(None, None)"),
    ],
)
def test_design_table_translates_both_ways(placements, pspec):
    to_jax = layout_translate.placements_to_pspec(DP4_TP2, parse_placements(placements), (8, 16))
    assert format_pspec(to_jax) == pspec
    assert format_placements(layout_translate.pspec_to_placements(DP4_TP2, parse_pspec(pspec), 2)) == placements


def test_transpose_maps_a_torch_linear_weight_to_a_flax_kernel():
    placements = (make_strided_shard(0, 2), Shard(0))  # weight [out=8, in=16]
    kernel_spec = layout_translate.placements_to_pspec(DP4_TP2, placements, (8, 16), transpose=True)
    assert format_pspec(kernel_spec) == "P(None, ('tp', 'dp'))"
    kernel_map = layout.from_named_sharding(NamedSharding(jax_mesh(DP4_TP2), kernel_spec), (16, 8))
    assert_same(layout.from_placements(DP4_TP2, placements, (8, 16)).transposed(), kernel_map)
    back = layout_translate.pspec_to_placements(DP4_TP2, kernel_spec, 2, transpose=True)
    assert format_placements(back) == "_StridedShard(0, sf=2), Shard(0)"


def test_partial_has_no_jax_equivalent():
    with pytest.raises(ValueError, match=r"Partial\(sum\).*'dp'.*no PartitionSpec equivalent"):
        layout_translate.placements_to_pspec(DP4_TP2, (Partial(), Shard(0)), (8, 16))


def test_split_factor_no_mesh_axis_explains_has_no_jax_equivalent():
    with pytest.raises(ValueError, match=r"split factor must be one of \[1, 2\]"):
        layout_translate.placements_to_pspec(DP4_TP2, (make_strided_shard(0, 3), Shard(0)), (24, 16))


def _live_rows(rank, world_size, mesh_shape, cases):
    """Per (split factor, rows) case: the rows this rank's real DTensor shard holds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    device_mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    rows_held = []
    for split_factor, rows in cases:
        global_tensor = torch.arange(rows * 6).reshape(rows, 6)
        placements = (make_strided_shard(0, split_factor), Shard(0))
        local = distribute_tensor(global_tensor, device_mesh, placements, src_data_rank=None).to_local()
        rows_held.append((local[:, 0] // 6).tolist())
    return rows_held


# (mesh, [(split factor, rows)]): factors no product of later axes explains, some of which torch.chunk
# turns into a JAX layout anyway (4 rows, sf=3 on 2 x 2: chunks of 2, 2, 0 rows), some not.
STRIDED_CASES = [
    ((2, 2), [(3, 4), (3, 6), (5, 8), (6, 8), (2, 8), (3, 24)]),
    ((2, 4), [(5, 8), (6, 8), (5, 16), (6, 16), (3, 8), (4, 16)]),
]


@pytest.mark.parametrize("mesh_shape, cases", STRIDED_CASES, ids=lambda value: str(value))
def test_verdict_comes_from_live_dtensor_and_jax_shard_maps(mesh_shape, cases):
    """Finding 9: an equivalent exactly when JAX's devices_indices_map of some spec equals DTensor's real shards."""
    from tests.distributed import run_threads

    mesh = MeshSpec(mesh_shape, ("dp", "tp"))
    per_rank = run_threads(_live_rows, mesh.size, mesh_shape, cases)
    for case, (split_factor, rows) in enumerate(cases):
        live = {coordinate: per_rank[mesh.rank_of(coordinate)][case] for coordinate in mesh.coordinates()}
        placements = (make_strided_shard(0, split_factor), Shard(0))
        matching = [spec for spec in every_pspec(mesh, 2) if _jax_rows(mesh, spec, (rows, 6)) == live]
        try:
            pspec = layout_translate.placements_to_pspec(mesh, placements, (rows, 6))
        except ValueError as no_equivalent:
            assert not matching, f"sf={split_factor}, {rows} rows: {no_equivalent}, but {matching[0]} matches"
            continue
        assert matching, f"sf={split_factor}, {rows} rows: {pspec} claimed, but no spec gives DTensor's shards"
        assert _jax_rows(mesh, pspec, (rows, 6)) == live, (split_factor, rows, pspec)


def test_strided_shard_of_four_rows_over_three_is_p_tp_dp():
    """The issue's case: (_StridedShard(0, sf=3), Shard(0)) on (4, 6), mesh 2 x 2 is P(('tp', 'dp'), None)."""
    mesh = MeshSpec((2, 2), ("dp", "tp"))
    pspec = layout_translate.placements_to_pspec(mesh, (make_strided_shard(0, 3), Shard(0)), (4, 6))
    assert format_pspec(pspec) == "P(('tp', 'dp'), None)"


def _jax_rows(mesh: MeshSpec, pspec: P, shape: tuple[int, ...]) -> dict | None:
    """Per coordinate, the rows JAX's own devices_indices_map gives; None where JAX rejects the spec."""
    sharding = NamedSharding(jax_mesh(mesh), pspec)
    try:
        per_device = sharding.devices_indices_map(shape)
    except ValueError:
        return None
    devices = jax.devices("cpu")
    return {
        coordinate: list(range(shape[0]))[per_device[devices[mesh.rank_of(coordinate)]][0]]
        for coordinate in mesh.coordinates()
    }


@DETERMINISTIC
@given(st.data())
def test_translation_exists_exactly_when_some_pspec_reproduces_the_map(data):
    mesh = data.draw(meshes())
    placements, shape = data.draw(placement_cases(mesh))
    torch_map = layout.from_placements(mesh, placements, shape)
    assert_each_element_held_by_every_replica(torch_map, placements)
    reproducing = [spec for spec in every_pspec(mesh, len(shape)) if _reproduces(mesh, spec, shape, torch_map)]
    try:
        pspec = layout_translate.placements_to_pspec(mesh, placements, shape)
    except ValueError as no_equivalent:
        assert not reproducing, f"{no_equivalent} but {reproducing[0]} reproduces {format_placements(placements)}"
        return
    assert reproducing and not torch_map.partial_axes
    sharding = NamedSharding(jax_mesh(mesh), pspec)
    assert_same(layout.from_pspec(mesh, pspec, shape), torch_map)
    assert_same(layout.from_named_sharding(sharding, shape), torch_map)
    assert_same(layout.from_jax_array(jax.device_put(arange_global(shape), sharding)), torch_map)
    back = layout_translate.pspec_to_placements(mesh, pspec, len(shape))
    assert_same(layout.from_placements(mesh, back, shape), torch_map)


@DETERMINISTIC
@given(st.data())
def test_pspec_map_matches_jax_and_its_placements(data):
    mesh = data.draw(meshes())
    pspec, shape = data.draw(pspec_cases(mesh))
    sharding = NamedSharding(jax_mesh(mesh), pspec)
    try:
        jax_map = layout.from_named_sharding(sharding, shape)
    except ValueError:
        with pytest.raises(ValueError, match="JAX rejects"):
            layout.from_pspec(mesh, pspec, shape)
        return
    assert_same(layout.from_pspec(mesh, pspec, shape), jax_map)
    assert_same(layout.from_jax_array(jax.device_put(arange_global(shape), sharding)), jax_map)
    placements = layout_translate.pspec_to_placements(mesh, pspec, len(shape))
    assert_same(layout.from_placements(mesh, placements, shape), jax_map)
    if len(shape) == 2:
        transposed = layout_translate.pspec_to_placements(mesh, pspec, 2, transpose=True)
        assert_same(layout.from_placements(mesh, transposed, shape[::-1]).transposed(), jax_map)


def _reproduces(mesh: MeshSpec, pspec: P, shape: tuple[int, ...], expected: ShardMap) -> bool:
    try:
        return layout.compare(layout.from_pspec(mesh, pspec, shape), expected).equal
    except ValueError:  # JAX would reject this spec for this shape
        return False


def assert_each_element_held_by_every_replica(shard_map: ShardMap, placements) -> None:
    """Shards tile the tensor: each element is held once per coordinate of the non-sharding axes."""
    copies = math.prod(
        size for size, p in zip(shard_map.mesh.shape, placements) if isinstance(p, Replicate | Partial)
    )
    counts = np.zeros(shard_map.global_shape, dtype=np.int64)
    for held in shard_map.indices.values():
        counts[np.ix_(*held)] += 1
    assert (counts == copies).all(), counts


# --- comparison, selectors, replicas, JSON ------------------------------------------------------


def test_compare_names_the_first_difference():
    column = layout.from_placements(DP4_TP2, parse_placements("_StridedShard(0, sf=2), Shard(0)"), (8, 16))
    row = layout.from_placements(DP4_TP2, parse_placements("Shard(0), Shard(1)"), (8, 16))
    comparison = layout.compare(column, row)
    assert (comparison.equal, comparison.coordinate, comparison.dim) == (False, (0, 0), 0)
    assert (comparison.left.tolist(), comparison.right.tolist()) == ([0], [0, 1])
    assert "dp=0,tp=0" in comparison.reason


def test_compare_catches_a_mesh_not_built_in_rank_order():
    placements = parse_placements("Shard(0), Shard(1)")
    in_order = layout.from_placements(DP4_TP2, placements, (8, 16))
    shuffled = layout.from_placements(MeshSpec((4, 2), ("dp", "tp"), (0, 2, 1, 3, 4, 5, 6, 7)), placements, (8, 16))
    comparison = layout.compare(in_order, shuffled)
    assert not comparison.equal and comparison.coordinate == (0, 1) and "rank order" in comparison.reason


def test_selectors_are_slices_where_contiguous_and_arrays_where_strided():
    strided = layout.from_placements(MeshSpec((2,), ("x",)), (make_strided_shard(0, 2),), (4, 3))
    assert strided.selectors((0,))[0].tolist() == [0, 2] and strided.selectors((0,))[1] == slice(0, 3)
    assert strided.local_shape((1,)) == (2, 3)
    assert format_indices(strided.indices[(1,)][0]) == "1:4:2"


def test_replica_groups_follow_replicate_axes_but_not_partial_ones():
    hsdp = ShardMap.from_json(load_golden("hsdp2x2_tp2_column")["shard_map"])
    assert sorted(hsdp.replica_groups()) == [
        ((0, 0, 0), (1, 0, 0)),
        ((0, 0, 1), (1, 0, 1)),
        ((0, 1, 0), (1, 1, 0)),
        ((0, 1, 1), (1, 1, 1)),
    ]
    partial = layout.from_placements(DP4_TP2, (Partial(), Shard(0)), (8,))
    assert all(len(group) == 1 for group in partial.replica_groups())


def test_json_round_trips():
    shard_map = layout.from_placements(DP4_TP2, parse_placements("_StridedShard(0, sf=2), Shard(0)"), (6, 16))
    assert_same(ShardMap.from_json(json.loads(json.dumps(shard_map.to_json()))), shard_map)


# --- bad input: clear errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: parse_mesh("dp4,tp=2"), "is not name=size"),
        (lambda: parse_mesh("dp=4,dp=2"), "gives dp twice"),
        (lambda: parse_shape("8,x"), "positive sizes"),
        (lambda: parse_placements("Shard(0), Bogus(1)"), "'Bogus\\(1\\)'.*not a placement"),
        (lambda: parse_placements("Shard(0"), "do not parse"),
        (lambda: parse_pspec("(('tp','dp'),3)"), "must be None"),
        (lambda: layout.from_placements(DP4_TP2, (Shard(2), Shard(0)), (8, 16)), "shape \\(8, 16\\) has 2 dims"),
        (lambda: layout.from_placements(DP4_TP2, (Shard(0),), (8, 16)), "1 placements for a 2-D mesh"),
        (lambda: layout.from_pspec(DP4_TP2, P("tq"), (8, 16)), "'tq' is not in the mesh"),
        (lambda: layout.from_pspec(DP4_TP2, P("dp", "dp"), (8, 16)), "twice"),
        (lambda: layout.from_pspec(DP4_TP2, P("dp", None, None), (8, 16)), "3 entries but the tensor has 2 dims"),
        (lambda: layout.from_pspec(DP4_TP2, P("dp"), (6, 16)), "pad dim 0 to 8"),
    ],
)
def test_bad_input_raises_a_clear_value_error(build, message):
    with pytest.raises(ValueError, match=message):
        build()
