"""The float64 numpy model of jaxside.modules' quantized math, and the check of a result against it.

Shared by the JAX module, transformer-layer and sharded-execution tests (and the torch-vs-JAX module
tests). The model and its tolerances are explained in tests/jaxside/test_modules_numerics.py's
docstring.
"""

from __future__ import annotations

from dataclasses import astuple

import jax.numpy as jnp
import ml_dtypes
import numpy as np

import jaxside.quantize as Q
from bridge.numerics import relative_error
from jaxside.modules import LayerNorm, LayerNormLinear, Linear, RMSNorm
from twinspec.recipe import (
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


def norm64(x, weight, bias, normalization: str, eps: float, zero_centered_gamma: bool):
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
        y, norm_backward = norm64(x, params["weight"], params.get("bias"), *astuple(norm))
        grads["x"], grads["weight"], grads["bias"] = norm_backward(dy)
        return {"y": math.round(y), **{name: g for name, g in grads.items() if g is not None}}
    if isinstance(module, Linear):
        y, linear_backward = math.linear(x, params["kernel"], params.get("bias"), 0)
        grads["x"], grads["kernel"], grads["bias"] = linear_backward(dy)
        return {"y": y, **grads}
    gamma, beta = params["layer_norm_weight"], params.get("layer_norm_bias")
    normalized, norm_backward = norm64(x, gamma, beta, *astuple(norm))
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


def to_float64(array) -> np.ndarray:
    return np.asarray(array).astype(np.float64)  # exact from fp32 and bf16 (ml_dtypes)


def mismatches(got: dict, expected: dict, dtype, recipe, slack: float = 1.0) -> dict[str, str]:
    """The tensors of `got` that break the tolerances of test_modules_numerics' docstring against `expected` (float64).

    slack multiplies the per-element bound: 2 compares two results that are each within it of float64.
    """
    tolerance = slack * ELEMENT_TOLERANCE[np.dtype(dtype)]
    whole_tolerance = TENSOR_TOLERANCE["nvfp4" if isinstance(recipe, NVFP4BlockScaling) else "fp8"]
    failed = {}
    for name, want in expected.items():
        have, want = to_float64(got[name]), to_float64(want)
        off = np.abs(have - want) > tolerance * (np.abs(want) + np.sqrt(np.mean(want**2)))
        error = relative_error(have, want)
        if not (np.isfinite(have).all() and off.mean() <= FLIPPED_FRACTION and error <= whole_tolerance):
            failed[name] = f"{off.sum()} of {off.size} elements off, relative error {error:.2e}"
    return failed
