"""Argument checks of the jaxside quantizers: the same errors, with the same fixes, as fp8kernels/_checks.py."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array

from jaxside.formats import FORMATS, FloatFormat, seed_as_uint32

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


def check_roles(rowwise: bool, columnwise: bool) -> None:
    """At least one of the two copies must be asked for."""
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False produce nothing; ask for at least one")


def check_divisible(operand_cols: int, multiple: int, scheme: str, role: str) -> None:
    """MXFP8 and NVFP4 blocks must tile each operand row exactly (a row of x, or a column of x)."""
    if operand_cols % multiple:
        dim = "last dim (K)" if role == "rowwise" else "row count (M, the product of the leading dims)"
        other = "columnwise" if role == "rowwise" else "rowwise"
        raise ValueError(
            f"{scheme} {role} needs the {dim} to be a multiple of {multiple}, got {operand_cols}; "
            f"pad the tensor or ask for {other} only"
        )


def element_format(fmt: str, allowed: tuple[str, ...]) -> FloatFormat:
    """The format a quantizer writes, checked against those it supports."""
    if fmt not in allowed:
        raise ValueError(f"fmt={fmt!r} is not supported here; use one of {allowed}")
    return FORMATS[fmt]


def check_block(block, allowed: tuple[tuple[int, int], ...], name: str) -> tuple[int, int]:
    """A block shape argument, checked against the ones a scheme defines."""
    block = tuple(block)
    if block not in allowed:
        raise ValueError(f"{name} block={block} is not supported; use one of {allowed}")
    return block


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
    if scale is not None and amax is not None:
        raise ValueError("pass scale (delayed scaling) or amax (current scaling from a given amax), not both")
    if scale is not None and (power_2_scale or amax_epsilon):
        raise ValueError("power_2_scale and amax_epsilon shape a current scale; with a given scale leave them unset")
    if amax is not None:
        amax = _one_fp32(amax, "amax", "the amax to scale from, e.g. reduced over the shards of x")
    return (None if scale is None else check_scale(scale)), amax


def check_global_amax(global_amax, rotated_columnwise: bool) -> Array | None:
    """An NVFP4 global amax given for a shard: fp32, one element, for unrotated copies."""
    if global_amax is None:
        return None
    global_amax = _one_fp32(global_amax, "global_amax", "the whole tensor's amax")
    if rotated_columnwise:
        raise ValueError(
            "global_amax stands for x's amax, not for that of the Hadamard-rotated columnwise copy: "
            "pass hadamard=False, or columnwise=False, or leave global_amax None"
        )
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
