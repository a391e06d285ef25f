"""jaxside.sharding's rules against the torch placement table, as shard maps on 8 host devices.

torch side: the table of docs/design.md ("Parallelism"), written out here from the document, with FSDP2
on top (Shard(0) over dp_shard; `_StridedShard(0, sf=tp)` where TP already shards dim 0), turned
into a shard map by bridge.layout (checked against live DTensors in test_layout_live.py). JAX side:
what `devices_indices_map` reports for jaxside's NamedSharding. A torch weight [out, in] is the
Flax kernel [in, out], so the JAX map is transposed before the comparison.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from torch.distributed.tensor import Replicate, Shard

from bridge import layout
from bridge.layout import MeshSpec
from jaxside import sharding as S
from torchside.parallel import MESH_AXES as TORCH_MESH_AXES
from torchside.parallel._torch_compat import make_strided_shard

# docs/design.md: (parameter role, parallel mode) -> the TP placement of the torch parameter.
TORCH_TP_TABLE = {
    ("weight", "column"): Shard(0), ("weight", "row"): Shard(1), ("weight", None): Replicate(),
    ("bias", "column"): Shard(0), ("bias", "row"): Replicate(), ("bias", None): Replicate(),
    ("norm", "column"): Replicate(), ("norm", "row"): Replicate(), ("norm", None): Replicate(),
}  # fmt: skip
OUT_FEATURES, IN_FEATURES = 16, 8  # divisible by every split below
# torch role -> (jaxside role, Flax logical axes per mode, torch shape); the names follow a column
# layer embed -> mlp and a row layer mlp -> embed.
PARAMETERS = {
    "weight": ("kernel", {"column": ("embed", "mlp"), "row": ("mlp", "embed"), None: ("embed", "mlp")}),
    "bias": ("bias", {"column": ("mlp",), "row": ("embed",), None: ("embed",)}),
    "norm": ("norm", {"column": ("embed",), "row": ("embed",), None: ("embed",)}),
}
LAYOUTS = {  # (dp_replicate, dp_shard, tp)
    "FSDP": (1, 8, 1),
    "HSDP": (2, 4, 1),
    "TP": (1, 1, 8),
    "FSDPxTP": (1, 4, 2),
    "HSDPxTP": (2, 2, 2),
}


def test_torch_and_jax_name_the_mesh_axes_alike():
    """The bridge maps a torch mesh onto the JAX mesh of the same devices by axis name (bridge.transfer)."""
    assert TORCH_MESH_AXES == S.make_mesh(1, 1, 1).axis_names == ("dp_replicate", "dp_shard", "tp")


def torch_placements(role: str, mode: str | None, tp_size: int) -> tuple:
    """What set_device_mesh then fully_shard give on the (dp_replicate, dp_shard, tp) mesh."""
    tp_placement = TORCH_TP_TABLE[(role, mode)]
    fsdp_placement = make_strided_shard(0, tp_size) if tp_placement == Shard(0) else Shard(0)
    return Replicate(), fsdp_placement, tp_placement


@pytest.mark.parametrize("layout_name", sorted(LAYOUTS))
@pytest.mark.parametrize("mode", ["column", "row", None])
@pytest.mark.parametrize("role", sorted(PARAMETERS))
def test_jax_rules_hold_what_torch_placements_hold(role, mode, layout_name):
    sizes = LAYOUTS[layout_name]
    jax_role, axes_by_mode = PARAMETERS[role]
    torch_shape = (OUT_FEATURES, IN_FEATURES) if role == "weight" else (OUT_FEATURES,)
    torch_mesh = MeshSpec(sizes, S.MESH_AXES)  # rank order, like make_mesh
    torch_map = layout.from_placements(torch_mesh, torch_placements(role, mode, sizes[2]), torch_shape)

    mesh = S.make_mesh(*sizes)
    flax_shape = torch_shape[::-1]
    jax_map = layout.from_named_sharding(S.named_sharding(mesh, axes_by_mode[mode], mode, jax_role), flax_shape)
    if role == "weight":
        jax_map = jax_map.transposed()
    comparison = layout.compare(jax_map, torch_map)
    assert comparison.equal, comparison.reason


def test_fsdp_on_column_tp_is_the_strided_layout_of_the_seed_example():
    """DP=4, TP=2: rank (dp=i, tp=j) holds row 4j+i of an 8-row weight, in a live jax.Array too."""
    mesh = S.make_mesh(dp_shard=4, tp=2)
    kernel = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)  # Flax [in, out]: column j is torch row j
    array = jax.device_put(kernel, S.named_sharding(mesh, ("embed", "mlp"), "column", "kernel"))
    for shard in array.addressable_shards:
        rank = jax.devices().index(shard.device)
        dp, tp = divmod(rank, 2)
        np.testing.assert_array_equal(np.asarray(shard.data), kernel[:, [4 * tp + dp]])
    torch_mesh = MeshSpec((1, 4, 2), S.MESH_AXES)
    torch_map = layout.from_placements(torch_mesh, torch_placements("weight", "column", 2), (8, 16))
    assert layout.compare(layout.from_jax_array(array).transposed(), torch_map).equal
