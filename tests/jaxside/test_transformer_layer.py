"""jaxside MultiheadAttention and TransformerLayer against a float64 model of their FP8 math, and their placement.

The float64 model composes, with hand-written backward passes: test_modules_numerics.py's model of
each FP8 submodule (jaxside.quantize casts with that submodule's own scales and seed, float64
products, rounding where the module writes a tensor), test_attention.py's float64 attention and
complex rotation, and the residual sums. The rotary angles are an input, the same array on both
sides. Tolerances are test_modules_numerics.py's (`mismatches`). Checks run in fp32: bf16 rounds
inside the attention where a one-bit difference ahead of an FP8 cast can move it a whole step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import astuple

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxside import sharding as S
from jaxside.modules import (
    GRAD_FILTER,
    FP8Module,
    LayerNormMLP,
    ModuleConfig,
    MultiheadAttention,
    RotaryPositionEmbedding,
    TransformerConfig,
    TransformerLayer,
    finish_backward,
    fp8_autocast,
    shardings,
)
from twinspec.recipe import DelayedScaling
from tests.jaxside.attention64 import attention64, causal_keep, rotate64
from tests.jaxside.layer_builders import BATCH, BUILDERS, FUSED_QKV, HEAD_DIM, HEADS, HIDDEN, SEPARATE_QKV, SEQ
from tests.jaxside.quantized_math64 import RECIPES, QuantizedMath64, mismatches, model64, norm64

# Each case compiles its quantizer shapes eagerly on CPU (seconds each, NVFP4 the most): a few recipes
# per module here, the others in tests/bridge/test_modules_cross.py (all six passed here when written).
CASES = [
    *[("layer_fused_qkv_sbhd", recipe) for recipe in ("off", "current", "delayed")],
    *[("mha_separate_qkv_rotary_bshd", recipe) for recipe in ("current", "mxfp8")],
]

# ----------------------------------------------------------------------------- the float64 model


def _grouped_qkv_columns(groups: int, queries_per_group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column indices of q, k and v in the fused output: per group, its query heads, its key head, its value head."""
    block = (queries_per_group + 2) * HEAD_DIM  # one group's columns
    head = np.arange(HEAD_DIM)
    q = [g * block + r * HEAD_DIM + head for g in range(groups) for r in range(queries_per_group)]
    k = [g * block + queries_per_group * HEAD_DIM + head for g in range(groups)]
    v = [g * block + (queries_per_group + 1) * HEAD_DIM + head for g in range(groups)]
    return np.concatenate(q), np.concatenate(k), np.concatenate(v)


def submodule64(module, params: dict, prefix: str, math: QuantizedMath64, x):
    """(y, backward) of one FP8 submodule by model64; backward(dy) -> (dx, its grads under full names)."""
    own = {name.removeprefix(prefix): p for name, p in params.items() if name.startswith(prefix)}
    out_features = module.hidden_size if isinstance(module, LayerNormMLP) else module.out_features
    y = model64(module, own, math, x, np.zeros((*x.shape[:-1], out_features)))["y"]

    def backward(dy):
        results = model64(module, own, math, x, dy)
        dx, _ = results.pop("x"), results.pop("y")
        return dx, {prefix + name: grad for name, grad in results.items() if grad is not None}

    return y, backward


def mha64(mha, params: dict, maths: dict, x, angles, prefix: str = ""):
    """(y, backward) of MultiheadAttention; backward(dy) -> (dx, grads by name)."""
    config, math = mha.config, maths[f"{prefix}proj"]  # every submodule's model rounds alike
    sequence_first = config.qkv_format == "sbhd"

    def project(name, values):
        return submodule64(getattr(mha, name), params, f"{prefix}{name}.", maths[f"{prefix}{name}"], values)

    norm_backward = None
    if config.fuse_qkv_params:
        fused, fused_backward = project("layernorm_qkv" if mha.input_layernorm else "qkv", x)
        columns = _grouped_qkv_columns(mha.core_attention.num_gqa_groups, HEADS // mha.core_attention.num_gqa_groups)
        q, k, v = (fused[..., c] for c in columns)
    else:
        x_in = x
        if mha.input_layernorm:
            norm = f"{prefix}layernorm."
            normalized, norm_backward = norm64(
                x, params[f"{norm}weight"], params.get(f"{norm}bias"), *astuple(mha.layernorm.norm)
            )
            x_in = math.round(normalized)
        (q, q_backward), (k, k_backward), (v, v_backward) = (project(n, x_in) for n in ("query", "key", "value"))
    q, k, v = (t.reshape(*t.shape[:-1], -1, HEAD_DIM) for t in (q, k, v))
    rotations = [lambda d: d, lambda d: d]
    if angles is not None:
        (q, q_turn), (k, k_turn) = (rotate64(t, angles, config.qkv_format) for t in (q, k))
        q, k, rotations = math.round(q), math.round(k), [q_turn, k_turn]

    def batch_first(t):
        return t.swapaxes(0, 1) if sequence_first else t

    context, attention_backward = attention64(*map(batch_first, (q, k, v)), causal_keep(SEQ, SEQ), HEAD_DIM**-0.5)
    y, proj_backward = project("proj", math.round(batch_first(context)))

    def backward(dy):
        dcontext, grads = proj_backward(dy)
        dq, dk, dv = (batch_first(d) for d in attention_backward(batch_first(dcontext)))
        dq, dk = rotations[0](dq), rotations[1](dk)
        dq, dk, dv = (d.reshape(*d.shape[:-2], -1) for d in (dq, dk, dv))
        if config.fuse_qkv_params:
            dfused = np.zeros(fused.shape)
            for c, d in zip(columns, (dq, dk, dv)):
                dfused[..., c] = d
            dx, fused_grads = fused_backward(dfused)
            return dx, grads | fused_grads
        dx = 0
        for part_backward, dpart in ((q_backward, dq), (k_backward, dk), (v_backward, dv)):
            dx_part, part_grads = part_backward(dpart)
            dx, grads = dx + dx_part, grads | part_grads
        if norm_backward is not None:
            dx, grads[f"{prefix}layernorm.weight"], _ = norm_backward(dx)  # RMSNorm: no bias
        return dx, grads

    return y, backward


def layer64(layer, params: dict, maths: dict, x, angles):
    """(y, backward) of TransformerLayer: two residual sublayers, each sum rounded where the module rounds it."""
    math = maths["layernorm_mlp"]
    attention, attention_backward = mha64(layer.self_attention, params, maths, x, angles, prefix="self_attention.")
    hidden = math.round(x + attention)
    mlp, mlp_backward = submodule64(layer.layernorm_mlp, params, "layernorm_mlp.", math, hidden)

    def backward(dy):
        dhidden, mlp_grads = mlp_backward(dy)
        dhidden = dy + dhidden
        dx, attention_grads = attention_backward(dhidden)
        return dhidden + dx, mlp_grads | attention_grads

    return math.round(hidden + mlp), backward


# ----------------------------------------------------------------------------- the check


def _step(module, recipe, x, dy, angles_freqs) -> dict:
    """One FP8 forward and backward (dy weights the output), then the FP8 bookkeeping: y, dx, grads by dotted name."""

    def loss(module, x):
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, rotary_pos_emb=angles_freqs)
        return jnp.sum(y * dy), y

    (grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, GRAD_FILTER), 1), has_aux=True)(module, x)
    flat = nnx.to_flat_state(finish_backward(module, grads, recipe))
    return {"y": y, "x": dx, **{".".join(map(str, path)): v.get_value() for path, v in flat}}


def check_against_float64(case: str, recipe_name: str) -> None:
    recipe, rng = RECIPES[recipe_name], np.random.default_rng(1234)
    module = BUILDERS[case]()
    for _, param in nnx.iter_graph(module):  # non-trivial gammas and biases, so that their use is checked too
        if isinstance(param, nnx.Param) and param[...].ndim == 1:
            param[...] = param[...] + jnp.asarray(0.1 * rng.standard_normal(param[...].shape), jnp.float32)
    config = module.config
    shape = (SEQ, BATCH, HIDDEN) if config.qkv_format == "sbhd" else (BATCH, SEQ, HIDDEN)
    x, dy = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    freqs = RotaryPositionEmbedding(HEAD_DIM)(SEQ) if isinstance(module, MultiheadAttention) else None
    if isinstance(recipe, DelayedScaling):  # a first step fills the histories: the checked step has real scales
        _step(module, recipe, x, dy, freqs)
    maths = {
        ".".join(map(str, path)): QuantizedMath64(recipe, node, np.dtype(np.float32))
        for path, node in nnx.iter_graph(module)
        if isinstance(node, FP8Module) and node.num_gemms
    }
    params64 = {
        ".".join(map(str, path)): np.asarray(p.get_value(), np.float64)
        for path, p in nnx.to_flat_state(nnx.state(module, nnx.Param))
    }
    angles = None if freqs is None else np.asarray(freqs, np.float64)[:SEQ, 0, 0, : HEAD_DIM // 2]
    model = mha64 if isinstance(module, MultiheadAttention) else layer64
    y64, backward64 = model(module, params64, maths, np.asarray(x, np.float64), angles)
    dx64, grads64 = backward64(np.asarray(dy, np.float64))
    expected = {"y": y64, "x": dx64, **grads64}
    got = _step(module, recipe, x, dy, freqs)
    assert set(got) == set(expected), f"gradients {sorted(got)} vs the model's {sorted(expected)}"
    failed = mismatches(got, expected, jnp.float32, recipe)
    assert not failed, f"{case}/{recipe_name}: {failed}"


@pytest.mark.parametrize("case, recipe_name", CASES)
def test_matches_float64_quantized_math(case, recipe_name):
    check_against_float64(case, recipe_name)


# ----------------------------------------------------------------------------- structure and placement


def _param_paths(module) -> set[str]:
    return {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def test_parameter_paths_mirror_torch_names():
    fused = MultiheadAttention(64, 4, config=TransformerConfig(bias=False), rngs=nnx.Rngs(0))
    assert _param_paths(fused) == {"qkv.kernel", "proj.kernel"}
    assert fused.qkv.kernel[...].shape == (64, 3 * 64)  # Flax [in, out]: torch's qkv.weight [(N + 2G) H, D]
    separate = MultiheadAttention(64, 4, num_gqa_groups=1, config=SEPARATE_QKV, rngs=nnx.Rngs(0))
    assert _param_paths(separate) == {"query.kernel", "query.bias", "key.kernel", "key.bias", "value.kernel",
                                      "value.bias", "proj.kernel"}  # fmt: skip
    assert separate.key.kernel[...].shape == (64, 16)
    layer = BUILDERS["layer_fused_qkv_sbhd"]()
    assert _param_paths(layer) == {
        *(f"self_attention.layernorm_qkv.{n}" for n in ("layer_norm_weight", "layer_norm_bias", "kernel", "bias")),
        "self_attention.proj.kernel", "self_attention.proj.bias",
        *(f"layernorm_mlp.{n}" for n in ("layer_norm_weight", "layer_norm_bias", "fc1_kernel", "fc1_bias",
                                          "fc2_kernel", "fc2_bias")),
    }  # fmt: skip


def test_parameters_follow_the_rules_table_on_an_fsdp_x_tp_mesh():
    mesh = S.make_mesh(dp_shard=4, tp=2)
    planned = {
        ".".join(map(str, path)): sharding.get_value().spec
        for path, sharding in nnx.to_flat_state(shardings(BUILDERS["layer_fused_qkv_sbhd"](), mesh))
    }
    assert planned["self_attention.layernorm_qkv.kernel"] == P(None, ("tp", "dp_shard"))  # QKV: column
    assert planned["self_attention.layernorm_qkv.bias"] == P(("tp", "dp_shard"))
    assert planned["self_attention.layernorm_qkv.layer_norm_weight"] == P("dp_shard")
    assert planned["self_attention.proj.kernel"] == P("tp", "dp_shard")  # proj: row
    assert planned["self_attention.proj.bias"] == P("dp_shard")
    assert planned["layernorm_mlp.fc1_kernel"] == P(None, ("tp", "dp_shard"))
    assert planned["layernorm_mlp.fc2_kernel"] == P("tp", "dp_shard")
    assert planned["self_attention.proj.fp8_forward_amax_history"] == P()


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: TransformerConfig(hidden_dropout=0.1), ValueError, r"no dropout"),
        (lambda: TransformerConfig(activation="tanh"), ValueError, r"'gelu'"),
        (lambda: TransformerConfig(module_config=ModuleConfig(parallel_mode="row")), ValueError, r"leave it None"),
        (lambda: MultiheadAttention(60, 8, rngs=nnx.Rngs(0)), ValueError, r"kv_channels"),
        (lambda: MultiheadAttention(64, 4, config=FUSED_QKV.module_config, rngs=nnx.Rngs(0)), TypeError, r"Config"),
        (lambda: TransformerLayer(64, 0, 4, rngs=nnx.Rngs(0)), ValueError, r"ffn_hidden_size=0"),
    ],
)
def test_bad_arguments_raise_with_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_hidden_states_raise_with_the_fix():
    mha = MultiheadAttention(64, 4, config=dataclasses.replace(FUSED_QKV), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"hidden_states \[S, B, D\] with D=64"):
        mha(jnp.zeros((16, 64)))
