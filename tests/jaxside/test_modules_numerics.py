"""jaxside.modules against a float64 numpy computation of the same quantized math, for every recipe.

The reference here is written independently of jaxside.modules: it quantizes each GEMM operand with
jaxside.quantize (the byte-exact twin of fp8kernels.reference; the arguments are written out per recipe
below), dequantizes (code * scale_inv, exact in fp32), multiplies in float64, and rounds to the
activation dtype exactly where the module writes a tensor in that dtype (norm output, GEMM outputs,
each activation op, and their gradients), so that the same values reach every FP8 cast. Norms and
activations, and their backward, are float64 numpy formulas.

Tolerances. Both sides cast the same values with the same rules, so what differs is arithmetic:
 - the GEMMs (HIGHEST precision: true fp32 on every backend) and norms sum K <= 64 terms in fp32: at
   worst K * 2^-24 <= 2^-18 of the terms' magnitude;
 - the module rounds each result to its dtype, the float64 model does not: 2^-24 (fp32) or 2^-9
   (bf16) of the element at most.
So every element must agree within 2^-14 (fp32: 16x the accumulation bound) or 2^-8 (bf16: 2x the
final rounding) of |element| + rms(tensor) (a sum that cancels keeps the error of its terms), except
where a flip reaches: a value the module computes in fp32 (a norm or activation output, a dgrad)
and the model in float64 may lie on opposite sides of a rounding boundary of the cast that follows
(seen: 13.4999990 vs 13.5 after scaling, an E4M3 tie) and land one code apart. A flipped element
moves one row or column of each GEMM output it feeds (1/64 or 1/32 of the elements here), so at
most 1/16 of a tensor may be off; and the whole tensor stays within 2^-4 of its norm: one code is
at most 2^-2 of an element (E5M2), an element of 4 rms is 2^-4 of a 4096-element tensor's norm, so
a flip costs at most 2^-6 and 2^-4 allows four (2^-3 for NVFP4: an E2M1 step is up to half an
element). A skipped cast, a wrong format or scale, a transposed operand, a TF32 GEMM or a missing
rounding moves (nearly) every element, far past the per-element bound.

Modules run eagerly (no outer jit): the quantizers are jitted per shape and the shapes below repeat
across modules (and tests/jaxside/test_modules.py, tests/bridge/test_modules_cross.py), so each
compiles once. NVFP4 compiles slowly on CPU (~1-3 s per quantizer shape and configuration).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxside.modules import (
    GRAD_FILTER,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    ModuleConfig,
    RMSNorm,
    finish_backward,
    fp8_autocast,
)
from twinspec.recipe import DelayedScaling
from tests.jaxside.quantized_math64 import RECIPES, QuantizedMath64, mismatches, model64, to_float64

TOKENS = (2, 32)  # [B, S]: the modules flatten leading dims
CONFIG = ModuleConfig(amax_history_len=8)
_init = jax.nn.initializers.normal(0.1)  # larger than TE's 0.023, so outputs are O(1)
RMS_ZERO_CENTERED = {"normalization": "RMSNorm", "zero_centered_gamma": True}


def _builder(cls, *sizes, **kwargs):
    """dtype -> a module of `cls` with the test's init and config."""
    inits = {"kernel_init": _init} | ({"output_kernel_init": _init} if cls is LayerNormMLP else {})
    return lambda dtype: cls(*sizes, params_dtype=dtype, config=CONFIG, rngs=nnx.Rngs(0), **inits, **kwargs)


# Square 64-wide GEMMs except swiglu's fc2 ([32] -> [64]), so that the quantizer shapes repeat across
# modules (compiles dominate the time on CPU) and one kernel is not square (a layout mix-up shows).
MODULES = {
    "linear": _builder(Linear, 64, 64),
    "layernorm_linear": _builder(LayerNormLinear, 64, 64),
    "rmsnorm_linear_zero_centered": _builder(LayerNormLinear, 64, 64, **RMS_ZERO_CENTERED),
    "mlp_gelu": _builder(LayerNormMLP, 64, 64),
    "mlp_swiglu_rmsnorm": _builder(LayerNormMLP, 64, 32, activation="swiglu", normalization="RMSNorm"),
}
NORM_MODULES = {
    "layernorm": lambda dtype: LayerNorm(64, params_dtype=dtype, rngs=nnx.Rngs(0)),
    "rmsnorm_zero_centered": lambda dtype: RMSNorm(64, zero_centered_gamma=True, params_dtype=dtype, rngs=nnx.Rngs(0)),
}

# ----------------------------------------------------------------------------- the check


def _module_results(module, recipe, x, dy) -> dict:
    """One FP8 forward and backward of the module (dy weights the output), then the FP8 bookkeeping."""

    def loss(module, x):
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
        return jnp.sum(y.astype(jnp.float32) * dy), y

    (module_grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, GRAD_FILTER), 1), has_aux=True)(module, x)
    param_grads = finish_backward(module, module_grads, recipe)
    flat = {path[-1]: value for path, value in nnx.to_flat_state(param_grads)}
    return {"y": y, "x": dx, **{name: variable.get_value() for name, variable in flat.items()}}


def check_against_float64(module_name: str, recipe_name: str, dtype) -> None:
    """One FP8 forward and backward of the module and its float64 model; assert they agree."""
    dtype, recipe, rng = np.dtype(dtype), RECIPES[recipe_name], np.random.default_rng(1234)
    module = (MODULES | NORM_MODULES)[module_name](dtype)
    for _, param in nnx.iter_graph(module):  # non-trivial gamma and biases, so that their use is checked too
        if isinstance(param, nnx.Param) and param[...].ndim == 1:
            param[...] = param[...] + jnp.asarray(0.1 * rng.standard_normal(param[...].shape), dtype)
    has_kernel = isinstance(module, (Linear, LayerNormLinear))
    in_features, out_features = (module.in_features, module.out_features) if has_kernel else (module.hidden_size,) * 2
    x = jnp.asarray(rng.standard_normal((*TOKENS, in_features)), dtype)
    dy = jnp.asarray(rng.standard_normal((*TOKENS, out_features)), dtype)
    if isinstance(recipe, DelayedScaling):  # a first step fills the histories: the checked step has real scales
        _module_results(module, recipe, x, dy)
    math = QuantizedMath64(recipe, module, dtype)
    params64 = {path[-1]: to_float64(p.get_value()) for path, p in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    expected = model64(module, params64, math, to_float64(x), to_float64(dy))
    got = _module_results(module, recipe, x, dy)
    assert set(got) == set(expected), f"gradients {sorted(got)} vs the model's {sorted(expected)}"
    failed = mismatches(got, expected, dtype, recipe)
    assert not failed, f"{module_name}/{recipe_name}/{dtype}: {failed}"


# NVFP4 on the gated MLP would compile its [64, 32] shapes once more (~15 s of CPU); its GEMM path is the gelu MLP's.
FP32_CASES = [(m, r) for m in MODULES for r in RECIPES if (m, r) != ("mlp_swiglu_rmsnorm", "nvfp4")]


@pytest.mark.parametrize("module_name, recipe_name", FP32_CASES)
def test_fp32_matches_float64_quantized_math(module_name, recipe_name):
    check_against_float64(module_name, recipe_name, jnp.float32)


BF16_CASES = [(m, r) for m in ("linear", "mlp_gelu") for r in ("off", "delayed", "current", "block", "mxfp8")]


@pytest.mark.parametrize("module_name, recipe_name", [*BF16_CASES, ("linear", "nvfp4")])
def test_bf16_matches_float64_quantized_math(module_name, recipe_name):
    check_against_float64(module_name, recipe_name, jnp.bfloat16)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("module_name", NORM_MODULES)
def test_norms_match_float64_inside_an_fp8_region(module_name, dtype):
    check_against_float64(module_name, "current", dtype)  # no GEMM: the region changes nothing
