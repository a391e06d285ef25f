"""Float64 models of the low-precision formats, built from the bit layouts alone (OCP FP8/MX specs).

Independent of fp8kernels/: the tests use these to check the reference, and the edge-value sets
here (ties, subnormals, +-max and beyond, +-inf, NaN, zeros) drive the bit-exact tests.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# format -> (exponent bits, mantissa bits, canonical NaN code), from the OCP specs and the contract
LAYOUTS = {"e4m3": (4, 3, 0x7F), "e5m2": (5, 2, 0x7F), "e2m1": (2, 1, 0x00)}


def decode_model(code: int, fmt: str) -> float:
    """The value of one code, from the bit layout (NaN and inf codes as the specs define them)."""
    if fmt == "e8m0":
        return math.nan if code == 0xFF else 2.0 ** (code - 127)
    exponent_bits, mantissa_bits, _ = LAYOUTS[fmt]
    bias = 2 ** (exponent_bits - 1) - 1
    sign = -1.0 if code >> (exponent_bits + mantissa_bits) & 1 else 1.0
    exponent = (code >> mantissa_bits) & (2**exponent_bits - 1)
    mantissa = code & (2**mantissa_bits - 1)
    if fmt == "e4m3" and exponent == 15 and mantissa == 7:
        return math.nan
    if fmt == "e5m2" and exponent == 31:
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == 0:
        return sign * mantissa * 2.0 ** (1 - bias - mantissa_bits)
    return sign * (1 + mantissa / 2**mantissa_bits) * 2.0 ** (exponent - bias)


def finite_magnitudes(fmt: str) -> np.ndarray:
    """Non-negative finite values by code, ascending (code i has magnitude grid[i])."""
    exponent_bits, mantissa_bits, _ = LAYOUTS[fmt]
    values = [decode_model(code, fmt) for code in range(2 ** (exponent_bits + mantissa_bits))]
    return np.array([v for v in values if math.isfinite(v)])


def format_max(fmt: str) -> float:
    return float(finite_magnitudes(fmt)[-1])


def rne_model(values: np.ndarray, fmt: str) -> np.ndarray:
    """Codes by nearest-even on the exact grid: NaN -> canonical code, saturate at +-max, sign kept;
    +-inf -> the canonical NaN code in the fp8 formats (a cast never hides a non-finite), +-max in e2m1."""
    exponent_bits, mantissa_bits, nan_code = LAYOUTS[fmt]
    grid = finite_magnitudes(fmt)
    values = np.asarray(values, dtype=np.float64)
    a = np.minimum(np.abs(values), grid[-1])
    lower = np.clip(np.searchsorted(grid, a, side="right") - 1, 0, len(grid) - 1)
    upper = np.minimum(lower + 1, len(grid) - 1)
    twice = 2 * a  # exact; grid[lower] + grid[upper] is exact too (dyadic, few bits)
    midpoint_sum = grid[lower] + grid[upper]
    up = (twice > midpoint_sum) | ((twice == midpoint_sum) & (lower % 2 == 1))
    code = np.where(up & (upper > lower), upper, lower)
    code = code | (np.signbit(values).astype(np.int64) << (exponent_bits + mantissa_bits))
    non_finite = np.isnan(values) | (np.isinf(values) & (fmt != "e2m1"))
    return np.where(non_finite, nan_code, code).astype(np.uint8)


def edge_values(fmt: str) -> torch.Tensor:
    """fp32 edge cases of a format, generated from its grid: every value, every midpoint (the ties),
    one fp32 ulp either side of each midpoint, subnormals, +-max and beyond, +-inf, NaN, zeros."""
    grid = finite_magnitudes(fmt).astype(np.float32)
    midpoints = ((grid[1:].astype(np.float64) + grid[:-1]) / 2).astype(np.float32)
    above = np.nextafter(midpoints, np.float32(np.inf))
    below = np.nextafter(midpoints, np.float32(0))
    fmax = grid[-1]
    beyond = np.array([np.nextafter(fmax, np.float32(np.inf)), fmax * 1.03, fmax * 1.0625, fmax * 2, 3e38, np.inf])
    tiny = np.array([grid[1] / 2, grid[1] / 4, 1e-30, 1e-45, 0.0])  # half the smallest subnormal is a tie
    magnitudes = np.concatenate([grid, midpoints, above, below, beyond, tiny]).astype(np.float32)
    values = np.concatenate([magnitudes, -magnitudes, np.array([np.nan, -np.nan], np.float32)])
    return torch.from_numpy(values)
