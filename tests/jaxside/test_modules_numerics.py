"""jaxside.modules against a float64 numpy computation of the same quantized math, for every recipe.

The reference here is written independently of jaxside.modules: it quantizes each GEMM operand with
jaxside.quantize (the byte-exact twin of kernels.reference; the arguments are written out per recipe
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

from dataclasses import astuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

import jaxside.quantize as Q
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
from jaxside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = {
    "off": None,  # FP8 off: the same model without casts
    "delayed": DelayedScaling(amax_history_len=8),
    "current": Float8CurrentScaling(),
    "current-e4m3-pow2": Float8CurrentScaling(fp8_format=Format.E4M3, power_2_scale=True),
    "block": Float8BlockScaling(),
    "block-fp32-scales": Float8BlockScaling(power_2_scale=False),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(stochastic_rounding_seed=7),
}
ELEMENT_TOLERANCE = {np.dtype(np.float32): 2**-14, np.dtype(ml_dtypes.bfloat16): 2**-8}
FLIPPED_FRACTION = 1 / 16  # of a tensor's elements, at most, off by flips
TENSOR_TOLERANCE = {"fp8": 2**-4, "nvfp4": 2**-3}  # ||module - float64|| / ||float64||, flips included
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

# ----------------------------------------------------------------------------- the float64 model


class QuantizedMath64:
    """The float64 model of one module call's FP8 math: which scale and seed each cast uses, where it rounds."""

    def __init__(self, recipe, module, dtype: np.dtype) -> None:
        self.recipe, self.dtype = recipe, dtype
        delayed = isinstance(recipe, DelayedScaling)
        self.forward_scale = np.asarray(module.fp8_forward_scale[...]) if delayed else None
        self.backward_scale = np.asarray(module.fp8_backward_scale[...]) if delayed else None
        nvfp4 = isinstance(recipe, NVFP4BlockScaling)  # the grads' seed: the recipe's, plus the module's step
        self.seed = recipe.stochastic_rounding_seed + int(module.fp8_rounding_step[...]) if nvfp4 else None

    def round(self, x: np.ndarray) -> np.ndarray:
        return x.astype(self.dtype).astype(np.float64)

    def quantize(self, x: np.ndarray, role: str, gemm: int) -> Q.Quantized:
        """jaxside.quantize of x (values exact in the activation or parameter dtype) with the recipe's arguments."""
        x, recipe, both = x.astype(self.dtype), self.recipe, {"rowwise": True, "columnwise": True}
        if isinstance(recipe, NVFP4BlockScaling):  # RHT on the wgrad operands, stochastic rounding on grads
            block = (16, 16) if role == "weight" else (1, 16)
            seed = self.seed if role == "grad" else None
            return Q.quantize_nvfp4(x, block=block, hadamard=role != "weight", stochastic_seed=seed, **both)
        fmt = "e5m2" if recipe.fp8_format is Format.HYBRID and role == "grad" else "e4m3"  # no E5M2-only case here
        if isinstance(recipe, DelayedScaling):
            scales = self.backward_scale if role == "grad" else self.forward_scale
            slot = gemm if role == "grad" else 2 * gemm + (role == "weight")
            return Q.quantize_tensorwise(x, fmt, scales[slot : slot + 1], **both)
        if isinstance(recipe, Float8CurrentScaling):
            return Q.quantize_tensorwise(x, fmt, power_2_scale=recipe.power_2_scale, **both)
        if isinstance(recipe, Float8BlockScaling):
            block = (128, 128) if role == "weight" else (1, 128)
            return Q.quantize_blockwise(x, fmt, block, power_2_scale=recipe.power_2_scale, **both)
        return Q.quantize_mxfp8(x, fmt, scale_rounding="up", **both)

    def operand(self, x: np.ndarray, role: str, gemm: int):
        """values(columnwise) of x's cast for `role` (x itself with FP8 off): what a GEMM multiplies."""
        if self.recipe is None:
            return lambda columnwise=False: x
        q = self.quantize(x, role, gemm)
        return lambda columnwise=False: _values(q, columnwise)

    def linear(self, x, kernel, bias, gemm: int):
        """(y, backward): y = x @ kernel + bias on quantized operands; backward(dy) -> (dx, dkernel, dbias)."""
        x2d = x.reshape(-1, x.shape[-1])
        x_values, w_values = self.operand(x2d, "input", gemm), self.operand(kernel.T, "weight", gemm)
        y = self.round(x_values() @ w_values().T + (0.0 if bias is None else bias))

        def backward(dy):
            dy2d = dy.reshape(-1, dy.shape[-1])
            dy_values = self.operand(dy2d, "grad", gemm)
            dx = self.round(dy_values() @ w_values(columnwise=True))
            dkernel = x_values(columnwise=True).T @ dy_values(columnwise=True)
            return dx.reshape(x.shape), dkernel, None if bias is None else dy2d.sum(0)

        return y.reshape(*x.shape[:-1], -1), backward


def _values(q: Q.Quantized, columnwise: bool = False) -> np.ndarray:
    return np.asarray(Q.dequantize(q, jnp.float32, columnwise=columnwise)).astype(np.float64)


def _norm64(x, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
    """(y, backward) of LayerNorm or RMSNorm over the last dim; backward(dy) -> (dx, dweight, dbias)."""
    gamma = weight + (1.0 if zero_centered_gamma else 0.0)
    centered = x - x.mean(-1, keepdims=True) if normalization == "LayerNorm" else x
    rstd = 1.0 / np.sqrt((centered**2).mean(-1, keepdims=True) + eps)
    xhat = centered * rstd
    y = xhat * gamma + (0.0 if bias is None else bias)

    def backward(dy):
        gdy = gamma * dy
        inner = gdy - xhat * (xhat * gdy).mean(-1, keepdims=True)
        if normalization == "LayerNorm":
            inner = inner - gdy.mean(-1, keepdims=True)
        rows = dy.reshape(-1, dy.shape[-1])
        dbias = None if bias is None else rows.sum(0)
        return inner * rstd, (rows * xhat.reshape(rows.shape)).sum(0), dbias

    return y, backward


_GELU_C = np.sqrt(2.0 / np.pi)


def _gelu64(x):
    t = np.tanh(_GELU_C * (x + 0.044715 * x**3))
    return 0.5 * x * (1 + t), 0.5 * (1 + t) + 0.5 * x * (1 - t**2) * _GELU_C * (1 + 3 * 0.044715 * x**2)


def _silu64(x):
    s = 1.0 / (1.0 + np.exp(-x))
    return x * s, s * (1 + x * (1 - s))


def _activation64(math: QuantizedMath64, name: str, h):
    """(a, backward) with the module's roundings: each op's result and each op's input gradient."""
    function = {"gelu": _gelu64, "swiglu": _silu64}[name]
    if name == "gelu":
        value, slope = function(h)
        return math.round(value), lambda da: math.round(slope * da)
    gate, linear = h[..., 0::2], h[..., 1::2]  # fc1's columns alternate gate, up
    value, slope = function(gate)
    activated = math.round(value)

    def backward(da):
        dactivated, dlinear = math.round(da * linear), math.round(da * activated)
        return np.stack([math.round(slope * dactivated), dlinear], axis=-1).reshape(h.shape)  # interleaved back

    return math.round(activated * linear), backward


def model64(module, params: dict, math: QuantizedMath64, x, dy) -> dict:
    """The float64 model's y and gradients (dx and one per parameter, by name) for output gradient dy."""
    norm, grads = getattr(module, "norm", None), {}
    if isinstance(module, (LayerNorm, RMSNorm)):
        y, norm_backward = _norm64(x, params["weight"], params.get("bias"), *astuple(norm))
        grads["x"], grads["weight"], grads["bias"] = norm_backward(dy)
        return {"y": math.round(y), **{name: g for name, g in grads.items() if g is not None}}
    if isinstance(module, Linear):
        y, linear_backward = math.linear(x, params["kernel"], params.get("bias"), 0)
        grads["x"], grads["kernel"], grads["bias"] = linear_backward(dy)
        return {"y": y, **grads}
    gamma, beta = params["layer_norm_weight"], params.get("layer_norm_bias")
    normalized, norm_backward = _norm64(x, gamma, beta, *astuple(norm))
    normalized = math.round(normalized)
    if isinstance(module, LayerNormLinear):
        y, linear_backward = math.linear(normalized, params["kernel"], params.get("bias"), 0)
        dnormalized, grads["kernel"], grads["bias"] = linear_backward(dy)
    else:
        h, fc1_backward = math.linear(normalized, params["fc1_kernel"], params.get("fc1_bias"), 0)
        a, activation_backward = _activation64(math, module.activation, h)
        y, fc2_backward = math.linear(a, params["fc2_kernel"], params.get("fc2_bias"), 1)
        da, grads["fc2_kernel"], grads["fc2_bias"] = fc2_backward(dy)
        dnormalized, grads["fc1_kernel"], grads["fc1_bias"] = fc1_backward(activation_backward(da))
    grads["x"], grads["layer_norm_weight"], grads["layer_norm_bias"] = norm_backward(dnormalized)
    return {"y": y, **{name: g for name, g in grads.items() if g is not None}}


# ----------------------------------------------------------------------------- the check


def _float64(array) -> np.ndarray:
    return np.asarray(array).astype(np.float64)  # exact from fp32 and bf16 (ml_dtypes)


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


def mismatches(got: dict, expected: dict, dtype, recipe, slack: float = 1.0) -> dict[str, str]:
    """The tensors of `got` that break the tolerances of the module docstring against `expected` (float64).

    slack multiplies the per-element bound: 2 compares two results that are each within it of float64.
    """
    tolerance = slack * ELEMENT_TOLERANCE[np.dtype(dtype)]
    whole_tolerance = TENSOR_TOLERANCE["nvfp4" if isinstance(recipe, NVFP4BlockScaling) else "fp8"]
    failed = {}
    for name, want in expected.items():
        have, want = _float64(got[name]), _float64(want)
        off = np.abs(have - want) > tolerance * (np.abs(want) + np.sqrt(np.mean(want**2)))
        difference, size = np.linalg.norm(have - want), np.linalg.norm(want)
        error = float(difference / size) if size else float(difference and np.inf)
        if not (np.isfinite(have).all() and off.mean() <= FLIPPED_FRACTION and error <= whole_tolerance):
            failed[name] = f"{off.sum()} of {off.size} elements off, relative error {error:.2e}"
    return failed


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
    params64 = {path[-1]: _float64(p.get_value()) for path, p in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    expected = model64(module, params64, math, _float64(x), _float64(dy))
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
