"""On a data-parallel mesh the FP8 linear casts each DP shard's tokens apart, as each torch rank does.

A jaxside Linear placed on an HSDP mesh (2 x 2 DP shards, the batch split over both data axes) is
called inside `batch_dim(1)`, as TransformerLayer does. Reference: the single-device FP8 linear
(checked bit for bit against torchside by tests/bridge/test_modules_cross.py) run on each shard's
tokens alone; y and dx are those results side by side, dkernel and dbias their sums (FSDP's
reduce-scatter). The shards' values differ in
magnitude (x4 per shard), so casting the whole batch at once (one amax, token blocks that mix the
shards: the control) lands far outside the tolerance, which only allows fp32 summation order.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from bridge.numerics import FP32_ORDER, relative_error
from jaxside import sharding as S
from jaxside.modules import GRAD_FILTER, Linear, fp8_autocast, fp8_linear, place
from jaxside.modules.tokens import batch_dim, data_parallel_groups
from twinspec.recipe import Float8BlockScaling, Float8CurrentScaling
from tests.selection import in_ci

SEQ, BATCH, IN, OUT = 16, 8, 64, 32  # [S, B, I]: 32 tokens per shard on 4 DP shards
# Per-shard amaxes (current) and per-shard token blocks (1x128, here 32 tokens a shard). Power-of-2
# block scales (MXFP8, Float8BlockScaling's default) shift exponents only, so there a block cast with
# another shard's tokens changes only codes pushed into the subnormals: too few for the control to see.
RECIPES = {"current": Float8CurrentScaling(), "block": Float8BlockScaling(power_2_scale=False)}
ORDER_ONLY = FP32_ORDER  # relative (bridge.numerics): fp32 sums in another order, nothing cast differently


def _inputs():
    rng = np.random.default_rng(0)
    shard_scale = np.repeat(4.0 ** np.arange(4), BATCH // 4)[None, :, None]  # shard g's values x 4^g
    x = (rng.standard_normal((SEQ, BATCH, IN)) * shard_scale).astype(np.float32)
    dy = (rng.standard_normal((SEQ, BATCH, OUT)) * shard_scale).astype(np.float32)
    kernel = (0.05 * rng.standard_normal((IN, OUT))).astype(np.float32)
    bias = (0.1 * rng.standard_normal(OUT)).astype(np.float32)
    return x, dy, kernel, bias


def _step(recipe, x, dy, kernel, bias):
    """(y, dx, dkernel, dbias) of one FP8 linear under jit."""

    def loss(x, kernel, bias):
        y, _ = fp8_linear(x, kernel, bias, recipe)
        return jnp.sum(y * dy), y

    (dx, dkernel, dbias), y = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, kernel, bias)
    return y, dx, dkernel, dbias


def _per_shard_reference(recipe, x, dy, kernel, bias):
    """Each shard's tokens through the single-device FP8 linear (off any mesh); y, dx joined, grads summed."""
    step = jax.jit(lambda *args: _step(recipe, *args))
    results = [step(xs, dys, kernel, bias) for xs, dys in zip(np.split(x, 4, axis=1), np.split(dy, 4, axis=1))]
    y, dx, dkernel, dbias = zip(*results)
    return np.concatenate(y, axis=1), np.concatenate(dx, axis=1), np.sum(dkernel, axis=0), np.sum(dbias, axis=0)


def _on_mesh(recipe, x, dy, kernel, bias, *, per_shard: bool):
    """(y, dx, dkernel, dbias) of a Linear on the mesh, called inside `batch_dim(1)` or (the control) not."""
    mesh = S.make_mesh(dp_replicate=2, dp_shard=2)
    model = Linear(IN, OUT, rngs=nnx.Rngs(0))
    model.kernel[...], model.bias[...] = kernel, bias
    place(model, mesh)
    tokens = NamedSharding(mesh, PartitionSpec(None, (S.DP_REPLICATE, S.DP_SHARD), None))

    def loss(model, x, dy):
        with fp8_autocast(recipe=recipe), (batch_dim(1) if per_shard else contextlib.nullcontext()):
            y = model(x)
        return jnp.sum(y * dy), y

    @nnx.jit
    def step(model, x, dy):
        (grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, GRAD_FILTER), 1), has_aux=True)(model, x, dy)
        return y, dx, grads.kernel.get_value(), grads.bias.get_value()

    return step(model, jax.device_put(x, tokens), jax.device_put(dy, tokens))


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_each_dp_shard_casts_its_own_tokens(recipe_name):
    recipe, inputs = RECIPES[recipe_name], _inputs()
    expected = _per_shard_reference(recipe, *inputs)
    names = ("y", "dx", "dkernel", "dbias")
    got = _on_mesh(recipe, *inputs, per_shard=True)
    errors = {name: relative_error(a, b) for name, a, b in zip(names, got, expected)}
    assert all(error <= ORDER_ONLY for error in errors.values()), f"{recipe_name}: {errors}"
    whole_batch = _on_mesh(recipe, *inputs, per_shard=False)  # the control: one cast over every shard's tokens
    control = {name: relative_error(a, b) for name, a, b in zip(names, whole_batch, expected)}
    assert max(control[name] for name in ("y", "dkernel")) > 100 * ORDER_ONLY, f"{recipe_name}: {control}"


@pytest.mark.parametrize("recipe_name", in_ci(RECIPES, ["current"]))  # block: the grid (the shards' test runs it)
def test_one_device_told_the_dp_ranks_casts_as_they_do(recipe_name):
    """data_parallel_groups(4) on one device: the same casts as the 4 shards' (a G-rank run's numerics, no mesh)."""
    recipe, (x, dy, kernel, bias) = RECIPES[recipe_name], _inputs()

    @jax.jit
    def grouped_step(x, dy, kernel, bias):
        def loss(x, kernel, bias):
            with data_parallel_groups(4):
                y, _ = fp8_linear(x, kernel, bias, recipe, batch_dim=1)
            return jnp.sum(y * dy), y

        (dx, dkernel, dbias), y = jax.grad(loss, argnums=(0, 1, 2), has_aux=True)(x, kernel, bias)
        return y, dx, dkernel, dbias

    got, expected = grouped_step(x, dy, kernel, bias), _per_shard_reference(recipe, x, dy, kernel, bias)
    errors = {name: relative_error(a, b) for name, a, b in zip(("y", "dx", "dkernel", "dbias"), got, expected)}
    assert all(error <= ORDER_ONLY for error in errors.values()), f"{recipe_name}: {errors}"


@pytest.mark.parametrize("groups", [0, 2.0, True])
def test_data_parallel_groups_takes_a_rank_count(groups):
    with pytest.raises(ValueError, match="pass the number of data-parallel ranks"), data_parallel_groups(groups):
        pass


def test_a_batch_the_dp_shards_do_not_divide_is_refused():
    x, dy, kernel, bias = _inputs()
    mesh = S.make_mesh(dp_shard=4)
    whole = NamedSharding(mesh, PartitionSpec())
    with pytest.raises(ValueError, match="use a batch that is a multiple of 4"):
        fp8_linear(x[:, :6], jax.device_put(kernel, whole), bias, RECIPES["current"], batch_dim=1)


@pytest.mark.parametrize("dim", [-1, 1.0, True])
def test_batch_dim_takes_a_dim_index(dim):
    with pytest.raises(ValueError, match="pass the batch's dim index"), batch_dim(dim):
        pass
