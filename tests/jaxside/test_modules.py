"""jaxside.modules: parameters and their annotations, DelayedScaling bookkeeping, sharded execution, errors.

The numbers of each module's forward and backward are checked in test_modules_numerics.py; here,
what surrounds them: torchside's names with Flax's [in, out] kernels, logical axes that
jaxside.sharding places, the state updates once per region and step (against
jaxside.quantize.delayed_scaling_update), and an FSDP x TP run (make_mesh(dp_shard=4, tp=2)) that
equals the single-device run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxside import sharding as S
from jaxside.modules import (
    GRAD_FILTER,
    FP8State,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    ModuleConfig,
    RMSNorm,
    finish_backward,
    fp8_autocast,
    place,
    shardings,
)
from jaxside.modules.base import resized_amax_history
from jaxside.quantize import delayed_scaling_update, tensor_amax
from twinspec.recipe import DelayedScaling, Float8CurrentScaling, NVFP4BlockScaling
from tests.jaxside.quantized_math64 import mismatches

HISTORY = 4
CONFIG = ModuleConfig(amax_history_len=HISTORY)
DELAYED = DelayedScaling(amax_history_len=HISTORY)
COLUMN, ROW = ModuleConfig(HISTORY, parallel_mode="column"), ModuleConfig(HISTORY, parallel_mode="row")


def _params(module) -> dict:
    """name -> (shape, dtype, logical axes, parallel role, parallel mode) of every parameter."""
    params = nnx.state(module, nnx.Param)
    logical_specs = dict(nnx.to_flat_state(nnx.get_partition_spec(params)))
    described = {}
    for path, param in nnx.to_flat_state(params):
        value, metadata, axes = param.get_value(), param.get_metadata(), tuple(logical_specs[path].get_value())
        described[path[-1]] = (value.shape, value.dtype, axes, metadata["parallel_role"], metadata["parallel_mode"])
    return described


def test_parameters_have_torch_names_flax_layout_and_logical_axes():
    bf16 = jnp.bfloat16
    linear = Linear(16, 32, params_dtype=bf16, config=ModuleConfig(parallel_mode="row"), rngs=nnx.Rngs(0))
    assert _params(linear) == {
        "kernel": ((16, 32), bf16, ("mlp", "embed"), "kernel", "row"),
        "bias": ((32,), bf16, ("embed",), "bias", "row"),
    }
    mlp = LayerNormMLP(16, 8, activation="swiglu", normalization="RMSNorm", bias=False, rngs=nnx.Rngs(0))
    assert _params(mlp) == {
        "layer_norm_weight": ((16,), jnp.float32, ("embed",), "norm", "column"),
        "fc1_kernel": ((16, 16), jnp.float32, ("embed", "mlp"), "kernel", "column"),
        "fc2_kernel": ((8, 16), jnp.float32, ("mlp", "embed"), "kernel", "row"),
    }
    norm_linear = LayerNormLinear(16, 32, kernel_axes=("embed", "heads"), rngs=nnx.Rngs(0))
    assert set(_params(norm_linear)) == {"layer_norm_weight", "layer_norm_bias", "kernel", "bias"}
    assert _params(norm_linear)["kernel"][2] == ("embed", "heads")
    assert set(_params(LayerNorm(8, rngs=nnx.Rngs(0)))) == {"weight", "bias"}
    zero_centered = RMSNorm(8, zero_centered_gamma=True, rngs=nnx.Rngs(0))
    assert set(_params(zero_centered)) == {"weight"} and not zero_centered.weight[...].any()


def test_fp8_off_linear_is_x_at_kernel_plus_bias():
    linear = Linear(16, 8, rngs=nnx.Rngs(0))
    linear.bias[...] = jnp.arange(8.0)
    x = jax.random.normal(jax.random.key(1), (3, 16))
    expected = np.asarray(x, np.float64) @ np.asarray(linear.kernel[...], np.float64) + np.arange(8.0)
    np.testing.assert_allclose(np.asarray(linear(x)), expected, rtol=2**-18, atol=2**-18)
    y, bias = Linear(16, 8, return_bias=True, rngs=nnx.Rngs(0))(x)
    assert y.shape == (3, 8) and bias.shape == (8,)


# ----------------------------------------------------------------------------- DelayedScaling bookkeeping


def _loss(model, x, dy, recipe):
    with fp8_autocast(recipe=recipe):
        with fp8_autocast():  # a nested region inherits the recipe; only the outermost exit updates
            y = model(x)
    return jnp.sum(y * dy)


def _train_step(model, x, dy, recipe):
    grads = nnx.grad(_loss, argnums=nnx.DiffState(0, GRAD_FILTER))(model, x, dy, recipe)
    return finish_backward(model, grads, recipe)


def test_delayed_scaling_updates_once_per_region_and_step_eagerly_and_under_jit():
    rng = np.random.default_rng(0)
    x, dy = (jnp.asarray(rng.standard_normal((64, 64)), jnp.float32) for _ in range(2))
    eager, jitted = (Linear(64, 64, config=CONFIG, rngs=nnx.Rngs(0)) for _ in range(2))
    amaxes = jnp.concatenate([tensor_amax(x), tensor_amax(eager.kernel[...]), tensor_amax(dy)])
    forward_history = jnp.zeros((HISTORY, 2)).at[0].set(amaxes[:2])
    expected_forward = delayed_scaling_update(forward_history, jnp.ones(2), 448.0)
    expected_backward = delayed_scaling_update(jnp.zeros((HISTORY, 1)).at[0].set(amaxes[2:]), jnp.ones(1), 57344.0)
    step = nnx.jit(_train_step, static_argnums=3)
    for module, run in ((eager, _train_step), (jitted, step)):
        grads = run(module, x, dy, DELAYED)
        assert set(dict(nnx.to_flat_state(grads))) == {("kernel",), ("bias",)}, "finish_backward keeps Params only"
        np.testing.assert_array_equal(module.fp8_forward_amax_history[...], expected_forward[0])
        np.testing.assert_array_equal(module.fp8_forward_scale[...], expected_forward[1])
        np.testing.assert_array_equal(module.fp8_backward_amax_history[...], expected_backward[0])
        np.testing.assert_array_equal(module.fp8_backward_scale[...], expected_backward[1])
        assert not module.fp8_grad_amax[...].any(), "the grad amax sink is cleared for the next step"


def test_delayed_scaling_history_length_comes_from_the_recipe_unless_the_config_sets_one():
    """torchside's test of the same name: DelayedScaling(amax_history_len=2) sizes the window, eagerly and under jit."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((64, 64)), jnp.float32)
    eager, jitted = (Linear(64, 64, rngs=nnx.Rngs(0)) for _ in range(2))
    fixed = Linear(64, 64, config=ModuleConfig(amax_history_len=8), rngs=nnx.Rngs(0))

    def forward(module, x):
        with fp8_autocast(recipe=DelayedScaling(amax_history_len=2)):
            return module(x)

    for factor in (8.0, 4.0, 2.0):  # input amaxes 8a, 4a, 2a in three steps
        forward(eager, x * factor), nnx.jit(forward)(jitted, x * factor), forward(fixed, x * factor)
    amax = np.float32(np.max(np.abs(np.asarray(x))))
    for module in (eager, jitted):
        assert module.fp8_forward_amax_history[...].shape == (2, 2)
        assert module.fp8_backward_amax_history[...].shape == (2, 1)
        assert module.fp8_forward_scale[...][0] == np.float32(448.0) / (4 * amax)  # the max of steps 2 and 3
    assert fixed.fp8_forward_amax_history[...].shape == (8, 2)
    assert fixed.fp8_forward_scale[...][0] == np.float32(448.0) / (8 * amax)  # the max of all three


def test_a_resized_amax_history_keeps_this_step_and_the_newest_past_rows():
    history = jnp.asarray([[10.0], [1.0], [2.0], [3.0]])  # row 0 this step's, then the past, oldest first
    assert resized_amax_history(history, 2).flatten().tolist() == [10.0, 3.0]
    assert resized_amax_history(history, 6).flatten().tolist() == [10.0, 0.0, 0.0, 1.0, 2.0, 3.0]


def test_a_module_that_did_not_run_keeps_its_backward_state():
    used, unused = (Linear(64, 64, config=CONFIG, rngs=nnx.Rngs(i)) for i in range(2))
    model = nnx.List([used, unused])
    x = jnp.ones((64, 64))

    def loss(model, x):
        with fp8_autocast(recipe=DELAYED):
            return jnp.sum(model[0](x))

    finish_backward(model, nnx.grad(loss, argnums=nnx.DiffState(0, GRAD_FILTER))(model, x), DELAYED)
    assert used.fp8_backward_scale[...][0] != 1.0
    np.testing.assert_array_equal(unused.fp8_backward_amax_history[...], np.zeros((HISTORY, 1)))
    np.testing.assert_array_equal(unused.fp8_backward_scale[...], np.ones(1))


def test_nvfp4_rounding_step_advances_once_per_call():
    linear = Linear(64, 64, rngs=nnx.Rngs(0))

    def loss(linear, x):
        with fp8_autocast(recipe=NVFP4BlockScaling()):
            return jnp.sum(linear(x))

    for _ in range(2):
        nnx.grad(loss)(linear, jnp.ones((64, 64)))
    assert int(linear.fp8_rounding_step[...]) == 2


# ----------------------------------------------------------------------------- sharding


def _delayed_step(model, x, dy):
    def loss(model, x):
        with fp8_autocast(recipe=DELAYED):
            y = model(x)
        return jnp.sum(y * dy), y

    (grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, GRAD_FILTER), 1), has_aux=True)(model, x)
    return y, dx, finish_backward(model, grads, DELAYED)


def _two_steps(step, model, x, dy) -> dict:
    """Two DelayedScaling steps (the second with scales from the first's amaxes): y, dx, grads, FP8 state."""
    for _ in range(2):
        y, dx, grads = step(model, x, dy)
    results = {"y": y, "x": dx}
    for tree in (grads, nnx.state(model, FP8State)):
        results |= {".".join(map(str, path)): v.get_value() for path, v in nnx.to_flat_state(tree)}
    return results


def test_parameters_follow_the_rules_table_on_an_fsdp_x_tp_mesh():
    mesh = S.make_mesh(dp_shard=4, tp=2)
    rngs = nnx.Rngs(0)
    model = nnx.List([LayerNormLinear(64, 64, config=COLUMN, rngs=rngs), Linear(64, 64, config=ROW, rngs=rngs)])
    place(model, mesh)
    expected = {  # jaxside.sharding's rules: torch's placement table with the kernel's dims swapped
        (0, "kernel"): P(None, ("tp", "dp_shard")),  # torch (_StridedShard(0, sf=tp), Shard(0)) on [out, in]
        (0, "bias"): P(("tp", "dp_shard")),
        (0, "layer_norm_weight"): P("dp_shard"),
        (1, "kernel"): P("tp", "dp_shard"),
        (1, "bias"): P("dp_shard"),
        (1, "fp8_forward_amax_history"): P(),
    }
    planned = dict(nnx.to_flat_state(shardings(model, mesh)))
    placed = dict(nnx.to_flat_state(nnx.state(model)))
    for path, spec in expected.items():
        assert planned[path].get_value().spec == spec, path
        value = placed[path].get_value()
        assert value.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), value.ndim), path


def test_fsdp_x_tp_execution_equals_single_device():
    """A LayerNormMLP holds every rules row (fc1 column, fc2 row, a norm): two DelayedScaling steps, sharded and not."""
    mesh = S.make_mesh(dp_shard=4, tp=2)
    rng = np.random.default_rng(3)
    x, dy = (jnp.asarray(rng.standard_normal((4, 16, 64)), jnp.float32) for _ in range(2))  # 64 tokens, as elsewhere
    single, sharded = (LayerNormMLP(64, 64, config=CONFIG, rngs=nnx.Rngs(0)) for _ in range(2))
    place(sharded, mesh)
    assert sharded.fc2_kernel[...].sharding.spec == P("tp", "dp_shard")
    activations = S.named_sharding(mesh, ("batch", "seq", "embed"))
    got = _two_steps(nnx.jit(_delayed_step), sharded, jax.device_put(x, activations), jax.device_put(dy, activations))
    expected = _two_steps(_delayed_step, single, x, dy)  # eagerly: the quantizers' compiles are shared
    assert set(got) == set(expected)
    failed = mismatches(got, expected, jnp.float32, DELAYED)  # only fp32 summation orders differ
    assert not failed, failed


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: Linear(0, 4, rngs=nnx.Rngs(0)), ValueError, r"in_features=0.*integer >= 1"),
        (lambda: Linear(4, 4, params_dtype=jnp.float16, rngs=nnx.Rngs(0)), TypeError, r"jnp.float32 or jnp.bfloat16"),
        (lambda: Linear(4, 4, config="column", rngs=nnx.Rngs(0)), TypeError, r"ModuleConfig or None"),
        (lambda: Linear(4, 4, kernel_axes=("embed", "batch"), rngs=nnx.Rngs(0)), ValueError, r"named from"),
        (lambda: Linear(4, 4, kernel_axes=("embed", "embed"), config=COLUMN, rngs=nnx.Rngs(0)), ValueError, r"one of"),
        (lambda: ModuleConfig(parallel_mode="columns"), ValueError, r"None, 'column' or 'row'"),
        (lambda: LayerNormMLP(4, 4, activation="tanh", rngs=nnx.Rngs(0)), ValueError, r"use one of gelu"),
        (lambda: LayerNormMLP(4, 4, config=ROW, rngs=nnx.Rngs(0)), ValueError, r"row-parallel.*leave it None"),
        (lambda: LayerNormLinear(4, 4, normalization="BatchNorm", rngs=nnx.Rngs(0)), ValueError, r"'LayerNorm'"),
        (lambda: fp8_autocast(recipe="delayed").__enter__(), TypeError, r"twinspec.recipe"),
    ],
)
def test_mistakes_raise_errors_that_say_what_to_do(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_delayed_scaling_misuse_raises_with_the_fix():
    linear = Linear(64, 64, config=CONFIG, rngs=nnx.Rngs(0))
    x = jnp.ones((64, 64))
    with pytest.raises(ValueError, match=r"ran twice in one fp8_autocast region"):
        with fp8_autocast(recipe=DELAYED):
            linear(linear(x))
    grads = nnx.grad(_loss)(linear, x, x, DELAYED)  # Params only: no grad amaxes
    with pytest.raises(ValueError, match=r"GRAD_FILTER"):
        finish_backward(linear, grads, DELAYED)
    with pytest.raises(TypeError, match=r"an FP8 linear writes float32 or bfloat16"):
        with fp8_autocast(recipe=Float8CurrentScaling()):
            linear(x.astype(jnp.float16))
