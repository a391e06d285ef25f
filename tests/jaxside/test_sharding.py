"""jaxside.sharding alone (no torch): meshes in rank order, the golden shard maps, activations, errors.

The golden files in tests/assets/shardmaps hold torch's layouts of a Linear weight [out, in]
(tests/bridge checks them against DTensor); the Flax kernel is [in, out], so its indices are compared
transposed. tests/bridge/test_sharding_cross.py checks every role and mode against torch placements.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxside import sharding as S

GOLDEN_DIR = Path(__file__).parents[1] / "assets" / "shardmaps"
GOLDEN_AXIS_NAMES = {"dp": S.DP_SHARD, "shard": S.DP_SHARD, "rep": S.DP_REPLICATE, "tp": S.TP}
# golden name -> (parallel mode, the Flax kernel's logical axes)
GOLDEN_CASES = {
    "dp4_tp2_column": ("column", ("embed", "mlp")),
    "dp4_tp2_row": ("row", ("mlp", "embed")),
    "hsdp2x2_tp2_column": ("column", ("embed", "mlp")),
}


def _golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text())


def _mesh_for(golden_map: dict):
    sizes = {GOLDEN_AXIS_NAMES[name]: size for name, size in golden_map["mesh"].items()}
    assert golden_map["ranks"] == list(range(len(golden_map["ranks"]))), "goldens are in rank order"
    return S.make_mesh(**sizes)


def _held(sharding: NamedSharding, shape: tuple[int, ...]) -> dict:
    """device -> per-dim index lists, as JAX reports them."""
    return {
        device: [list(range(n))[index] for n, index in zip(shape, slices)]
        for device, slices in sharding.devices_indices_map(shape).items()
    }


def test_make_mesh_puts_rank_i_on_device_i_row_major():
    mesh = S.make_mesh(dp_replicate=2, dp_shard=2, tp=2)
    assert mesh.axis_names == ("dp_replicate", "dp_shard", "tp")
    devices = jax.devices()
    for (r, s, t), device in np.ndenumerate(mesh.devices):
        assert device == devices[4 * r + 2 * s + t]
    assert S.make_mesh(dp_shard=2).devices.shape == (1, 2, 1)
    assert S.make_mesh(devices=devices[3:4]).devices.flat[0] == devices[3]


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_kernel_layout_matches_golden_torch_map(name):
    golden = _golden(name)["shard_map"]
    mode, kernel_axes = GOLDEN_CASES[name]
    mesh = _mesh_for(golden)
    out_features, in_features = golden["shape"]
    sharding = S.named_sharding(mesh, kernel_axes, mode, "kernel", shape=(in_features, out_features))
    held = _held(sharding, (in_features, out_features))
    golden_names = list(golden["mesh"])
    for key, torch_indices in golden["shards"].items():
        coordinate = dict(item.split("=") for item in key.split(","))
        rank = int(np.ravel_multi_index([int(coordinate[n]) for n in golden_names], list(golden["mesh"].values())))
        assert held[jax.devices()[rank]][::-1] == torch_indices, f"{name} at {key}"


def test_uneven_dim_is_refused_with_the_padding_to_use():
    golden = _golden("dp4_tp2_column_uneven")["shard_map"]
    out_features, in_features = golden["shape"]  # 6 rows over tp x dp = 8 parts
    with pytest.raises(ValueError, match=r"size 6.*8 parts.*pad it to 8"):
        S.named_sharding(_mesh_for(golden), ("embed", "mlp"), "column", "kernel", shape=(in_features, out_features))


@pytest.mark.parametrize("mode", S.PARALLEL_MODES)
def test_activations_split_batch_over_both_data_axes_and_tp_features_only_in_tp_modes(mode):
    mesh = S.make_mesh(dp_replicate=2, dp_shard=2, tp=2)
    shape = (8, 3, 6)
    held = _held(S.named_sharding(mesh, ("batch", "seq", "mlp"), mode, shape=shape), shape)
    for (r, s, t), device in np.ndenumerate(mesh.devices):
        data_rank = 2 * r + s
        assert held[device][0] == [2 * data_rank, 2 * data_rank + 1]
        assert held[device][1] == [0, 1, 2]
        assert held[device][2] == ([3 * t, 3 * t + 1, 3 * t + 2] if mode else list(range(6)))


def test_parameters_are_never_split_over_dp_replicate():
    for mode in S.PARALLEL_MODES:
        for role, axes in (("kernel", ("embed", "mlp")), ("bias", ("mlp",)), ("norm", ("embed",))):
            if mode == "row" and role == "kernel":
                axes = ("mlp", "embed")
            spec = S.spec_for(axes, mode, role)
            assert all(S.DP_REPLICATE not in ((e,) if isinstance(e, str) else e or ()) for e in spec), (mode, role)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: S.spec_for("embed", "column", "norm"), TypeError, "tuple of names"),
        (lambda: S.spec_for(("hidden",), None), ValueError, "unknown logical axes"),
        (lambda: S.spec_for(("embed",), "colum", "norm"), ValueError, "parallel mode"),
        (lambda: S.spec_for(("embed",), "row", "weight"), ValueError, "parameter role"),
        (lambda: S.spec_for(("mlp",), "column", "kernel"), ValueError, "a kernel has 2 axes"),
        (lambda: S.spec_for(("batch", "mlp"), "column", "kernel"), ValueError, "a kernel has 2 axes"),
        (lambda: S.spec_for(("mlp", "embed"), "column", "kernel"), ValueError, "splits the kernel axis 'embed'"),
        (lambda: S.spec_for(("embed",), "column", "bias"), ValueError, "splits the bias axis 'embed'"),
        (lambda: S.make_mesh(tp=0), ValueError, "tp=0"),
        (lambda: S.make_mesh(dp_shard=16), ValueError, "needs 16 devices"),
        (lambda: S.make_mesh(tp=2, devices=jax.devices()[:3]), ValueError, "3 devices given"),
    ],
)
def test_mistakes_raise_errors_that_say_what_to_do(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_named_sharding_refuses_a_mesh_not_built_by_make_mesh():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("dp",))
    with pytest.raises(ValueError, match="build the mesh with make_mesh"):
        S.named_sharding(mesh, ("batch",))
    assert S.spec_for(("batch", "seq", "embed")) == PartitionSpec(("dp_replicate", "dp_shard"), None, None)
