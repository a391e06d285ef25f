"""Sharded execution equals single-device execution for the attention, layer and grouped modules.

DotProductAttention, MultiheadAttention, TransformerLayer and GroupedLinear (test_modules.py checks
LayerNormMLP, whose fc1, fc2 and norm hold every rules row). Each case is one jitted training step
(forward, backward, finish_backward) run twice: with the module and its inputs on one device, and on
the FSDP x TP mesh make_mesh(dp_shard=4, tp=2), parameters placed by jaxside.sharding's rules
(`place`) and inputs by their logical axes. On the mesh each data-parallel rank casts its own tokens
(as torch ranks do: current scaling with its own amax); the single-device step casts the same token
groups (jaxside.modules.tokens.data_parallel_groups). It is the same program, so a difference comes
from how XLA partitions it. DelayedScaling runs two steps (the second casts with the scales of the first's
amaxes) and its FP8 state is compared too.

What must agree, and how closely. Nothing here came out bitwise on XLA's CPU backend, not even
DotProductAttention, which splits no sum (only batch and query heads): each device runs code
compiled for its smaller shapes, which rounds some last bits otherwise (measured: 1.2e-7 of the
norm). Elsewhere fp32 sums are also split over devices and added in another order: every wgrad and
bias or norm grad sums the tokens the data axes split, a row-parallel GEMM (proj, fc2, the
row-parallel GroupedLinear) the features tp splits. Measured: every tensor within 4.5e-7 of its
norm (so no FP8 code moved: one code is ~1e-3 of these tensors' norms). The bounds are
test_modules_numerics.py's per-element one, 2^-14 of |element| + rms(tensor), for every element
with FP8 off; with FP8 on, a last-bit change ahead of a cast may move one code, so `mismatches`
there (at most 1/16 of the elements beyond the bound, the tensor within 2^-4 of its norm). A
missing or doubled reduction, a shard read as the whole tensor or a mis-sliced head moves most
elements by O(1) and fails both.

Compile time dominates (about 1-5 s per program on CPU), hence three recipes (off, current, delayed)
and small shapes: test_transformer_layer.py's modules, 64 tokens, 64 features.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxside import sharding as S
from jaxside.modules import (
    GRAD_FILTER,
    DotProductAttention,
    FP8State,
    GroupedLinear,
    ModuleConfig,
    RotaryPositionEmbedding,
    finish_backward,
    fp8_autocast,
    place,
)
from jaxside.modules.tokens import data_parallel_groups
from twinspec.recipe import DelayedScaling
from tests.jaxside.layer_builders import BUILDERS, GQA_GROUPS, HEAD_DIM, HEADS, SEQ
from tests.jaxside.quantized_math64 import ELEMENT_TOLERANCE, RECIPES, mismatches
from tests.selection import in_ci

BATCH, FEATURES = 4, 64  # [S, B] = [16, 4]: 64 tokens, batch 4 over dp_shard's 4
GROUP_SPLITS = (16, 0, 48)  # rows per group; group 1 has none
HEAD = (HEAD_DIM, None)  # a head's channels: no logical name, never split


@dataclass(frozen=True)
class Case:
    """A module, its call, and the logical axes of its inputs and of the output gradient `dy` (last)."""

    build: Callable[[], nnx.Module]
    call: Callable  # (module, *inputs) -> y
    inputs: tuple[tuple[tuple[int, str | None], ...], ...]  # per input: (size, logical axis name) per dim


def _grouped_row_parallel() -> GroupedLinear:
    config = ModuleConfig(amax_history_len=8, parallel_mode="row")  # kernels split over tp along the summed dim
    return GroupedLinear(3, FEATURES, FEATURES, kernel_init=jax.nn.initializers.normal(0.1), config=config,
                         rngs=nnx.Rngs(0))  # fmt: skip


def _rotary_attention(module, x):
    return module(x, rotary_pos_emb=RotaryPositionEmbedding(HEAD_DIM)(SEQ))


SBD = ((SEQ, "seq"), (BATCH, "batch"), (FEATURES, "embed"))
CASES = {
    "dot_product_attention_gqa": Case(  # tp splits the query heads; "kv" heads stay whole (the rules)
        lambda: DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=GQA_GROUPS),
        lambda module, q, k, v: module(q, k, v),
        (
            ((SEQ, "seq"), (BATCH, "batch"), (HEADS, "heads"), HEAD),
            ((SEQ, "seq"), (BATCH, "batch"), (GQA_GROUPS, "kv"), HEAD),
            ((SEQ, "seq"), (BATCH, "batch"), (GQA_GROUPS, "kv"), HEAD),
            ((SEQ, "seq"), (BATCH, "batch"), (HEADS * HEAD_DIM, "heads")),
        ),
    ),
    "multihead_attention_separate_qkv_rotary_bshd": Case(
        BUILDERS["mha_separate_qkv_rotary_bshd"],
        _rotary_attention,
        (((BATCH, "batch"), (SEQ, "seq"), (FEATURES, "embed")),) * 2,
    ),
    "transformer_layer_fused_qkv_sbhd": Case(BUILDERS["layer_fused_qkv_sbhd"], lambda module, x: module(x), (SBD, SBD)),
    "grouped_linear_row_parallel": Case(
        _grouped_row_parallel,
        lambda module, x: module(x, GROUP_SPLITS),
        (((SEQ * BATCH, "batch"), (FEATURES, "mlp")), ((SEQ * BATCH, "batch"), (FEATURES, "embed"))),
    ),
}
ATTENTION = "dot_product_attention_gqa"  # no FP8 GEMM: a recipe would change nothing in it
DP_GROUPS = 4  # the mesh's data-parallel ranks: dp_shard=4, tp=2
FP8_IN_CI = {  # the other FP8 steps run under -m grid (CI time, ~25 s each on 2 cores): the layer holds every
    # GEMM kind the others have (column and row parallel, attention); the grouped module's casting under the mesh
    # is its current case; the separate-QKV attention runs FP8 off here. DelayedScaling's second step on this
    # mesh (FP8 state included) is test_modules.py's LayerNormMLP (fc1 column, fc2 row, a norm) in CI
    ("transformer_layer_fused_qkv_sbhd", "current"),
    ("grouped_linear_row_parallel", "current"),
}
PAIRS = [(ATTENTION, "off")] + [(case, r) for case in CASES if case != ATTENTION for r in ("off", "current", "delayed")]
PAIRS_IN_CI = [(case, r) for case, r in PAIRS if r == "off" or (case, r) in FP8_IN_CI]


def _step(module, inputs: list, dy, case_name: str, recipe_name: str, dp_groups: int | None) -> dict:
    """One training step: y, the input grads, the parameter grads and the FP8 state after finish_backward.

    dp_groups: cast the tokens as that many data-parallel ranks would (None: as the mesh's do).
    """
    call, recipe = CASES[case_name].call, RECIPES[recipe_name]

    def loss(module, *inputs):
        groups = contextlib.nullcontext() if dp_groups is None else data_parallel_groups(dp_groups)
        with groups, fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = call(module, *inputs)
        return jnp.sum(y * dy), y

    argnums = (nnx.DiffState(0, GRAD_FILTER), *range(1, len(inputs) + 1))
    (grads, *input_grads), y = nnx.grad(loss, argnums=argnums, has_aux=True)(module, *inputs)
    grads = finish_backward(module, grads, recipe)
    results = {"y": y} | {f"input{i}": grad for i, grad in enumerate(input_grads)}
    for tree in (grads, nnx.state(module, FP8State)):
        results |= {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(tree)}
    return results


_jitted_step = nnx.jit(_step, static_argnames=("case_name", "recipe_name", "dp_groups"))


def _last_step(module, inputs: list, dy, case_name: str, recipe_name: str, mesh=None) -> dict:
    """The last of one step, or two for DelayedScaling (the second casts with the scales of the first's amaxes).

    With a mesh, the module's variables are `place`d on it before each step (so the second step
    reuses the first's compilation, whatever shardings XLA gave the updated state). Without one, the
    tokens are cast in DP_GROUPS groups, as the mesh's data-parallel ranks cast theirs.
    """
    for _ in range(2 if isinstance(RECIPES[recipe_name], DelayedScaling) else 1):
        if mesh is not None:
            place(module, mesh)
        results = _jitted_step(module, inputs, dy, case_name, recipe_name, None if mesh else DP_GROUPS)
    return results


def _random_vectors(module: nnx.Module, rng: np.random.Generator) -> nnx.Module:
    """Biases and norm weights off their zeros and ones, so that a misplaced one shows in the forward too."""
    for _, param in nnx.iter_graph(module):
        if isinstance(param, nnx.Param) and param[...].ndim == 1:
            param[...] = param[...] + jnp.asarray(0.1 * rng.standard_normal(param[...].shape), jnp.float32)
    return module


@pytest.mark.parametrize("case_name, recipe_name", in_ci(PAIRS, PAIRS_IN_CI))
def test_fsdp_x_tp_step_equals_single_device_step(case_name, recipe_name):
    case, mesh = CASES[case_name], S.make_mesh(dp_shard=DP_GROUPS, tp=2)
    rng = np.random.default_rng(5)
    arrays = [jnp.asarray(rng.standard_normal([size for size, _ in dims]), jnp.float32) for dims in case.inputs]
    *inputs, dy = arrays
    single, sharded = (_random_vectors(case.build(), np.random.default_rng(6)) for _ in range(2))
    expected = _last_step(single, inputs, dy, case_name, recipe_name)

    placed = []
    for array, dims in zip(arrays, case.inputs):
        spec = S.spec_for([name for _, name in dims if name])  # a head's channels come last, unsplit
        placed.append(jax.device_put(array, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))))
    assert any(len(x.sharding.device_set) == 8 and not x.is_fully_replicated for x in placed)
    got = _last_step(sharded, placed[:-1], placed[-1], case_name, recipe_name, mesh)

    assert set(got) == set(expected)
    recipe = RECIPES[recipe_name]
    if recipe is None:  # no cast a last-bit change could flip: every element within the bound
        bound = ELEMENT_TOLERANCE[np.dtype(np.float32)]
        for name, want in expected.items():
            want = np.asarray(want, np.float64)
            rms = np.sqrt(np.mean(want**2))
            have = np.asarray(got[name], np.float64)
            np.testing.assert_allclose(have, want, rtol=bound, atol=bound * rms, err_msg=name)
    else:
        failed = mismatches(got, expected, jnp.float32, recipe)
        assert not failed, f"{case_name}/{recipe_name}: {failed}"
