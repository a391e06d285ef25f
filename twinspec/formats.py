"""The number formats and the constants of quantization, once for every implementation.

`fp8kernels.formats` (plain torch, the spec), `fp8kernels._casts` (Triton) and `jaxside.formats`
(jnp) compute with these values; each adds only its framework's dtype for a format.
docs/quantization.md states the rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32_MAX = float.fromhex("0x1.fffffep+127")  # the largest finite fp32


@dataclass(frozen=True)
class FloatFormat:
    """One low-precision format: its bit layout, largest finite value and canonical NaN code."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float
    nan_code: int  # the one byte every implementation writes for NaN

    @property
    def bias(self) -> int:
        """Exponent bias, 2^(exponent_bits - 1) - 1."""
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def max_exponent(self) -> int:
        """floor(log2(max)): 8 for e4m3, 15 for e5m2, 2 for e2m1 (the OCP MX `emax_elem`)."""
        return math.floor(math.log2(self.max))


FORMATS: dict[str, FloatFormat] = {
    # e4m3 and e5m2 write their NaN code for every non-finite value (+-inf too): a cast never hides one.
    "e4m3": FloatFormat("e4m3", 4, 3, 448.0, 0x7F),
    "e5m2": FloatFormat("e5m2", 5, 2, 57344.0, 0x7F),
    # e2m1 has no NaN: a NaN element becomes code 0 and its block's e4m3 scale is NaN (an infinite
    # block amax makes that scale NaN too), so the block dequantizes to NaN.
    "e2m1": FloatFormat("e2m1", 2, 1, 6.0, 0x00),
    # e8m0 holds MXFP8 block scales: a biased exponent (bias 127), 0xFF is NaN.
    "e8m0": FloatFormat("e8m0", 8, 0, 2.0**127, 0xFF),
}
FP8_FORMATS = ("e4m3", "e5m2")
E8M0_INF_CODE = 0xFE  # the e8m0 code of an infinite amax (the largest finite exponent)
E8M0_UP_ZERO_BITS = 0x00400000  # "up" gives code 0 to an amax / fmax ratio at most 2^-127 (these fp32 bits)
ONE_BITS = 0x3F800000  # fp32 1.0
NVFP4_GLOBAL_MAX = FORMATS["e4m3"].max * FORMATS["e2m1"].max  # 448 * 6: the global encode's fmax

# The 8 magnitudes of e2m1 by code (bit 3 is the sign): 0 and 0.5 subnormal, then (1 + m/2) * 2^(e-1).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# scheme name -> block shape [rows, cols] of the operand sharing one scale (None: whole tensor)
SCHEME_BLOCKS: dict[str, tuple[int, int] | None] = {
    "tensorwise": None,
    "block1x128": (1, 128),
    "block128x128": (128, 128),
    "mxfp8": (1, 32),
    "nvfp4_1x16": (1, 16),
    "nvfp4_16x16": (16, 16),
}

# lowbias32 (C. Wellons): a 32-bit integer mixer that torch (int64), Triton and jnp (uint32) compute
# identically, so stochastic rounding needs no shared random tensor.
HASH_MULTIPLIERS = (0x7FEB352D, 0x846CA68B)
HASH_SHIFTS = (16, 15, 16)
MASK32 = 0xFFFFFFFF

HADAMARD_SIZE = 16
HADAMARD_SIGN_BITS = 0b1001_0110_1100_1010  # bit i set: the Hadamard transform's sign i is -1 (fixed, arbitrary)


__all__ = [
    "E2M1_MAGNITUDES",
    "E8M0_INF_CODE",
    "E8M0_UP_ZERO_BITS",
    "FORMATS",
    "FP32_MAX",
    "FP8_FORMATS",
    "HADAMARD_SIGN_BITS",
    "HADAMARD_SIZE",
    "HASH_MULTIPLIERS",
    "HASH_SHIFTS",
    "MASK32",
    "NVFP4_GLOBAL_MAX",
    "ONE_BITS",
    "SCHEME_BLOCKS",
    "FloatFormat",
]
