"""The compiled FSDP x TP training step moves activations as torch's layout does: nothing is regathered.

torch's FSDP2 x TP (docs/design.md, "Parallelism"): an activation [S, B, D] keeps its batch split over the
data axes; FSDP all-gathers each parameter before use (over dp_shard) and reduce-scatters its grad; TP
all-reduces, over tp, the output of a row-parallel GEMM and the input grad of a column-parallel one,
both [S, B / dp, D]. Under FP8 each data-parallel rank casts its own tokens, so an FP8 GEMM needs no
more of the batch than a high-precision one (current scaling checked; FP8 off as the control).
Attention runs on the heads each tp rank holds. So in the optimized HLO of one step every all-gather
is of a parameter (1-D or 2-D), no collective reshuffles an activation (all-to-all,
collective-permute), and every all-reduce of an activation has the local batch's size.

A layout XLA cannot follow shows up there as an all-gather of an activation (rank >= 3) or an
all-to-all, and on stderr as "Involuntary full rematerialization". Compiling only: about 1 s per case.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxside import sharding as S
from jaxside.modules import GRAD_FILTER, fp8_autocast, place, shardings
from twinspec.recipe import Float8CurrentScaling
from tests.jaxside.layer_builders import BUILDERS, HIDDEN, SEQ
from tests.selection import in_ci

BATCH = 8  # a multiple of every mesh's dp
# module -> where its input's batch dim is: "sbhd" [S, B, D] or "bshd" [B, S, D]
MODULES = {"layer_fused_qkv_sbhd": 1, "mha_separate_qkv_rotary_bshd": 0}
MESHES = [(2, 2), (4, 2)]  # (dp_shard, tp)
RECIPES = {"fp8_off": None, "current": Float8CurrentScaling()}

_COLLECTIVE = re.compile(
    r"=\s*(?P<result>\(.*?\)|\S+)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)"
    r"(?:-start)?\("
)
_SHAPE = re.compile(r"\w+\[([\d,]*)\]")


# docs/design.md's TP table once FSDP2 has unsharded a parameter (torch [out, in] read as the Flax kernel [in, out]):
# (role, parallel mode, logical axes) -> the PartitionSpec a GEMM or norm reads it in
TP_ONLY = {
    ("kernel", "column", ("embed", "mlp")): PartitionSpec(None, "tp"),  # weight Shard(0)
    ("kernel", "row", ("mlp", "embed")): PartitionSpec("tp", None),  # weight Shard(1)
    ("kernel", None, ("embed", "mlp")): PartitionSpec(None, None),  # Replicate
    ("bias", "column", ("mlp",)): PartitionSpec("tp"),  # Shard(0)
    ("bias", "row", ("embed",)): PartitionSpec(None),
    ("norm", "column", ("embed",)): PartitionSpec(None),
}


@pytest.mark.parametrize("role, mode, axes", TP_ONLY)
def test_gathered_spec_keeps_only_the_tp_split(role, mode, axes):
    assert S.gathered_spec(axes, mode, role) == TP_ONLY[role, mode, axes]


def collectives(hlo_text: str) -> list[tuple[str, tuple[tuple[int, ...], ...]]]:
    """(op, result shapes) of every collective in an optimized HLO text (an async pair counts once)."""
    found = []
    for match in _COLLECTIVE.finditer(hlo_text):
        shapes = tuple(tuple(int(d) for d in dims.split(",") if d) for dims in _SHAPE.findall(match["result"]))
        found.append((match["op"], shapes))
    return found


def _compiled_step(module_name: str, dp: int, tp: int, recipe=None) -> str:
    mesh = S.make_mesh(dp_shard=dp, tp=tp)
    model = BUILDERS[module_name]()
    place(model, mesh)
    batch_dim = MODULES[module_name]
    shape = [SEQ, SEQ, HIDDEN]
    shape[batch_dim] = BATCH
    spec = [None] * 3
    spec[batch_dim] = (S.DP_REPLICATE, S.DP_SHARD)  # as the bridge places a batch
    activation = NamedSharding(mesh, PartitionSpec(*spec))
    x, dy = (jax.device_put(jnp.ones(shape, jnp.float32), activation) for _ in range(2))

    def loss(model, x, dy):
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            return jnp.sum(model(x) * dy)

    def step(graphdef, state, x, dy):
        model = nnx.merge(graphdef, state)
        return nnx.grad(loss, argnums=(nnx.DiffState(0, GRAD_FILTER), 1))(model, x, dy)

    graphdef, state = nnx.split(model)
    grads_placed = nnx.state(shardings(model, mesh), GRAD_FILTER)  # where an optimizer keeps them: FSDP shards
    jitted = jax.jit(step, static_argnums=0, out_shardings=(grads_placed, activation))
    return jitted.lower(graphdef, state, x, dy).compile().as_text()


# FP8 off on every mesh; FP8 on the (2, 2) mesh only (the per-shard casting does not depend on dp's size), in CI
# for the layer only (its attention is the other module; ~16 s on 2 cores)
STEPS = [(m, mesh, "fp8_off") for m in MODULES for mesh in MESHES] + [(m, (2, 2), "current") for m in MODULES]
STEPS_IN_CI = [step for step in STEPS if step[2] == "fp8_off" or step[0] == "layer_fused_qkv_sbhd"]


@pytest.mark.parametrize("module_name, mesh_shape, recipe_name", in_ci(STEPS, STEPS_IN_CI))
def test_step_moves_only_parameters_and_tp_partial_sums(module_name, mesh_shape, recipe_name):
    dp, tp = mesh_shape
    found = collectives(_compiled_step(module_name, dp, tp, RECIPES[recipe_name]))
    local_activation = SEQ * (BATCH // dp) * HIDDEN
    summary = sorted({(op, shapes) for op, shapes in found})

    assert not [c for c in found if c[0] in ("all-to-all", "collective-permute")], summary
    activation_gathers = [c for c in found if c[0] == "all-gather" and any(len(s) >= 3 for s in c[1])]
    assert not activation_gathers, summary
    activation_sums = [s for op, shapes in found if op == "all-reduce" for s in shapes if len(s) >= 3]
    assert activation_sums, summary  # TP's partial sums are there
    assert all(math.prod(s) == local_activation for s in activation_sums), summary
    assert any(op == "all-gather" for op, _ in found), summary  # FSDP's parameter gathers are there
