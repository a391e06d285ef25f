"""jaxside GroupedLinear against a float64 model applied group by group, its DelayedScaling slots, placement, errors.

The model is test_modules_numerics.py's `QuantizedMath64.linear` on each group's rows with that
group's slots (GEMM g), so its tolerances apply. Splits are uneven and include an empty group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxside import sharding as S
from jaxside.modules import GRAD_FILTER, GroupedLinear, ModuleConfig, finish_backward, fp8_autocast, shardings
from twinspec.recipe import DelayedScaling, MXFP8BlockScaling
from tests.jaxside.quantized_math64 import RECIPES, QuantizedMath64, mismatches
from tests.selection import in_ci

SPLITS = [16, 0, 48]  # 64 rows; group 1 has none
CONFIG = ModuleConfig(amax_history_len=8)


def _module(**kwargs) -> GroupedLinear:
    module = GroupedLinear(3, 64, 64, kernel_init=jax.nn.initializers.normal(0.1), config=CONFIG,
                           rngs=nnx.Rngs(0), **kwargs)  # fmt: skip
    rng = np.random.default_rng(7)
    for g in range(3):
        getattr(module, f"bias{g}")[...] = jnp.asarray(0.1 * rng.standard_normal(64), jnp.float32)
    return module


def _step(module, recipe, x, dy, splits=SPLITS) -> dict:
    def loss(module, x):
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, splits)
        return jnp.sum(y * dy), y

    (grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, GRAD_FILTER), 1), has_aux=True)(module, x)
    flat = nnx.to_flat_state(finish_backward(module, grads, recipe))
    return {"y": y, "x": dx, **{path[-1]: v.get_value() for path, v in flat}}


def grouped64(module, math: QuantizedMath64, x, dy) -> dict:
    """The float64 model: group g's rows through GEMM g of the model; an empty group's grads are zero."""
    results = {"y": np.zeros((len(x), 64)), "x": np.zeros(x.shape)}
    start = 0
    for g, rows in enumerate(SPLITS):
        kernel, bias = (np.asarray(getattr(module, f"{n}{g}")[...], np.float64) for n in ("kernel", "bias"))
        part = slice(start, start + rows)
        results[f"kernel{g}"], results[f"bias{g}"] = np.zeros(kernel.shape), np.zeros(bias.shape)
        if rows:
            results["y"][part], backward = math.linear(x[part], kernel, bias, g)
            results["x"][part], results[f"kernel{g}"], results[f"bias{g}"] = backward(dy[part])
        start += rows
    return results


@pytest.mark.parametrize("recipe_name", in_ci(["off", "delayed", "current", "block"], ["off", "current", "block"]))
def test_matches_float64_quantized_math_group_by_group(recipe_name):
    recipe, rng = RECIPES[recipe_name], np.random.default_rng(3)
    module = _module()
    x, dy = (jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for _ in range(2))
    if isinstance(recipe, DelayedScaling):  # a first step fills the histories: the checked step has real scales
        _step(module, recipe, x, dy)
    expected = grouped64(module, QuantizedMath64(recipe, module, np.dtype(np.float32)), np.asarray(x, np.float64),
                         np.asarray(dy, np.float64))  # fmt: skip
    got = _step(module, recipe, x, dy)
    assert set(got) == set(expected)
    failed = mismatches(got, expected, jnp.float32, recipe)
    assert not failed, f"{recipe_name}: {failed}"
    assert not np.asarray(got["kernel1"]).any() and not np.asarray(got["bias1"]).any()


def test_delayed_scaling_keeps_one_scale_per_group():
    module, recipe = _module(), RECIPES["delayed"]
    x = jnp.concatenate([jnp.full((16, 64), 1.0), jnp.full((48, 64), 4.0)])
    _step(module, recipe, x, jnp.ones((64, 64)))
    inputs = np.asarray(module.fp8_forward_scale[...])[0::2]  # slot 2g: group g's input
    assert inputs[0] == 448.0 and inputs[2] == 112.0, inputs  # E4M3 max / amax of the group's own rows
    assert inputs[1] == 1.0, "a group without rows keeps its scale"


def test_kernels_follow_the_rules_table():
    mesh = S.make_mesh(dp_shard=4, tp=2)
    row = GroupedLinear(2, 64, 64, config=ModuleConfig(parallel_mode="row"), rngs=nnx.Rngs(0))
    planned = {path[-1]: s.get_value().spec for path, s in nnx.to_flat_state(shardings(row, mesh))}
    assert planned["kernel0"] == planned["kernel1"] == P("tp", "dp_shard")  # torch weight{g} Shard(1)
    assert planned["bias0"] == planned["bias1"] == P("dp_shard")
    assert planned["fp8_forward_scale"] == P()


def test_bad_calls_raise_with_the_fix():
    module = GroupedLinear(2, 64, 64, rngs=nnx.Rngs(0))
    x = jnp.ones((64, 64))
    with pytest.raises(ValueError, match=r"pass a list of 2 row counts"):
        module(x, [64])
    with pytest.raises(ValueError, match=r"sum to the input's 64 rows"):
        module(x, [32, 16])
    with pytest.raises(ValueError, match=r"takes x \[\.\.\., 64\]"):
        module(jnp.ones((4, 32)), [2, 2])
    with pytest.raises(ValueError, match=r"num_gemms=0"):
        GroupedLinear(0, 64, 64, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"M % 32|multiple of 32|32"):  # MXFP8 wgrad blocks run along the rows
        _step(module, MXFP8BlockScaling(), x, x, splits=[16, 48])
