"""Argument checks of the jaxside quantizers: the same errors, with the same fixes, as fp8kernels/_checks.py.

The checks that need no array are twinspec.checks', shared with fp8kernels._checks.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array

from jaxside.formats import seed_as_uint32
from twinspec.checks import check_global_amax_unrotated, check_scale_or_amax_given

INPUT_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


def matrix_view(x) -> tuple[Array, tuple[int, ...]]:
    """x (any rank >= 1) as fp32 [prod(leading dims), last dim] (an exact conversion), and its shape."""
    if isinstance(x, np.generic):  # a numpy scalar: refused below as 0-d
        x = np.asarray(x)
    if not isinstance(x, (jax.Array, np.ndarray)) or x.dtype not in INPUT_DTYPES:
        got = x.dtype if isinstance(x, (jax.Array, np.ndarray)) else type(x).__name__
        raise TypeError(f"quantize takes a float32, bfloat16 or float16 array, got {got}")
    if x.ndim == 0:
        raise ValueError("quantize needs at least one dim, got a 0-d array; reshape it to (1,)")
    rows = math.prod(x.shape[:-1])
    return jnp.asarray(x).astype(jnp.float32).reshape(rows, x.shape[-1]), tuple(x.shape)


def check_scale(scale) -> Array:
    """A delayed-scaling scale: fp32 with one element."""
    if not isinstance(scale, (jax.Array, np.ndarray)) or scale.dtype != np.float32 or scale.size != 1:
        raise TypeError(
            f"scale must be an fp32 array of one element, got {scale!r}; pass scale=None for current scaling"
        )
    return jnp.asarray(scale).reshape(1)


def _one_fp32(value, name: str, meaning: str) -> Array:
    if not isinstance(value, (jax.Array, np.ndarray)) or value.dtype != np.float32 or value.size != 1:
        raise TypeError(f"{name} must be an fp32 array of one element ({meaning}), got {value!r}")
    return jnp.asarray(value).reshape(1)


def check_scale_or_amax(scale, amax, power_2_scale: bool, amax_epsilon: float) -> tuple[Array | None, Array | None]:
    """Tensorwise: a given delayed-scaling scale, or a given amax to scale from (current scaling), or neither."""
    check_scale_or_amax_given(scale is not None, amax is not None, power_2_scale, amax_epsilon)
    if amax is not None:
        amax = _one_fp32(amax, "amax", "the amax to scale from, e.g. reduced over the shards of x")
    return (None if scale is None else check_scale(scale)), amax


def check_global_amax(global_amax, rotated_columnwise: bool) -> Array | None:
    """An NVFP4 global amax given for a shard: fp32, one element, for unrotated copies."""
    if global_amax is None:
        return None
    global_amax = _one_fp32(global_amax, "global_amax", "the whole tensor's amax")
    check_global_amax_unrotated(rotated_columnwise)
    return global_amax


def check_seed(seed) -> Array | None:
    """A stochastic-rounding seed as uint32 (None: round to nearest)."""
    if seed is None:
        return None
    is_integer_array = (
        isinstance(seed, (jax.Array, np.ndarray)) and seed.size == 1 and np.issubdtype(seed.dtype, np.integer)
    )
    if not (isinstance(seed, (int, np.integer)) or is_integer_array):
        raise TypeError(f"stochastic_seed must be an int (or None for round-to-nearest), got {seed!r}")
    return seed_as_uint32(seed).reshape(())
