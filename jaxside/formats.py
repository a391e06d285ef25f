"""Number formats and the element-level pieces of quantization, in jnp: the twin of fp8kernels/formats.py.

The format table (max, canonical NaN byte), element casts, fp32 and e8m0 block scales, FP4
packing, the stochastic-rounding hash and the random Hadamard transform, each returning the same
bytes as the torch spec (docs/quantization.md states the rules). Two JAX differences are handled
here: JAX's fp8 casts do not saturate and write e5m2 NaN as 0x7E, so values are clipped to +-max
first and NaN gets the canonical byte afterwards; and XLA flushes fp32 subnormals on CPU and divides
inexactly on GPU, so the products, quotients and sums that decide bytes go through `jaxside._fp32`
(IEEE results on every backend).

Stochastic rounding shares its random bits with torch and Triton without sharing a tensor: the
bits of an element are a counter-based hash of (seed, element index), `hash32(index ^ hash32(seed))`
with lowbias32 on uint32 (mod 2^32) and index = row * C + col in the operand [R, C] being quantized.
torch computes the same integers in int64 masked to 32 bits, Triton in uint32, so a given seed
rounds every element the same way on every side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import Array, lax

from jaxside._fp32 import (
    SIGN_BIT,
    add,
    divide,
    from_bits,
    is_finite,
    is_nan,
    magnitude_bits,
    multiply,
    negate,
    scale_down_by_power_of_two,
    to_bits,
)

FP32_MAX = float(np.finfo(np.float32).max)


@dataclass(frozen=True)
class FloatFormat:
    """One low-precision format: its bit layout, largest finite value and canonical NaN code."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float
    nan_code: int  # the one byte every implementation writes for NaN
    dtype: np.dtype | None  # the jnp/ml_dtypes dtype; None: e2m1 is packed by hand

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
    "e4m3": FloatFormat("e4m3", 4, 3, 448.0, 0x7F, np.dtype(ml_dtypes.float8_e4m3fn)),
    "e5m2": FloatFormat("e5m2", 5, 2, 57344.0, 0x7F, np.dtype(ml_dtypes.float8_e5m2)),
    # e2m1 has no NaN: a NaN element becomes code 0 and its block's e4m3 scale is NaN (an infinite
    # block amax makes that scale NaN too), so the block dequantizes to NaN.
    "e2m1": FloatFormat("e2m1", 2, 1, 6.0, 0x00, None),
    # e8m0 holds MXFP8 block scales: a biased exponent (bias 127), 0xFF is NaN.
    "e8m0": FloatFormat("e8m0", 8, 0, 2.0**127, 0xFF, np.dtype(ml_dtypes.float8_e8m0fnu)),
}
FP8_FORMATS = ("e4m3", "e5m2")
E8M0_INF_CODE = 0xFE  # the e8m0 code of an infinite amax (the largest finite exponent)
E8M0_UP_ZERO_BITS = np.uint32(0x00400000)  # "up" gives code 0 to an amax / fmax ratio at most 2^-127 (these bits)
NVFP4_GLOBAL_MAX = FORMATS["e4m3"].max * FORMATS["e2m1"].max  # 448 * 6: the global encode's fmax

# The 8 magnitudes of e2m1 by code (bit 3 is the sign): [0, 0.5] subnormal, then 1.0 * 2^(e-1).
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


# ----------------------------------------------------------------------------- element casts


def encode_fp8(values, fmt: str) -> Array:
    """fp32 values -> uint8 codes of e4m3/e5m2: NaN and +-inf -> the canonical NaN, finite values saturate
    to +-max, round to nearest even."""
    f = FORMATS[fmt]
    values = jnp.asarray(values, jnp.float32)
    # JAX's cast overflows to NaN instead of saturating: clip first (a subnormal input rounds to +-0 either way).
    codes = lax.bitcast_convert_type(jnp.clip(values, -f.max, f.max).astype(f.dtype), jnp.uint8)
    return jnp.where(is_finite(values), codes, jnp.uint8(f.nan_code))


def decode_fp8(codes, fmt: str) -> Array:
    """uint8 codes of e4m3/e5m2/e8m0 -> fp32 values (NaN codes -> NaN)."""
    codes = jnp.asarray(codes, jnp.uint8)
    if fmt == "e8m0":  # built from the bits: code 0 is 2^-127, an fp32 subnormal
        return from_bits(_power_of_two_bits(codes.astype(jnp.int32) - 127))
    return lax.bitcast_convert_type(codes, FORMATS[fmt].dtype).astype(jnp.float32)


def encode_e2m1(values, random_bits=None) -> Array:
    """fp32 values -> e2m1 codes (uint8, 0..15), nearest-even, or stochastic given uint32 `random_bits`."""
    values = jnp.asarray(values, jnp.float32)
    magnitudes = jnp.asarray(E2M1_MAGNITUDES, jnp.float32)
    six = np.float32(FORMATS["e2m1"].max)
    a_bits = jnp.minimum(magnitude_bits(values), to_bits(six))  # |v| clamped to 6, as bits (NaN fixed below)
    a = from_bits(a_bits)[..., None]
    if random_bits is None:
        # Count the midpoints below |v|; exactly on one, move up only from an odd code (ties to even).
        midpoints = (np.array(E2M1_MAGNITUDES[1:]) + np.array(E2M1_MAGNITUDES[:-1])).astype(np.float32) / 2
        lower_code_is_odd = np.arange(7) % 2 == 1
        code = jnp.sum((a > midpoints) | ((a == midpoints) & lower_code_is_odd), axis=-1)
    else:
        # Round up with probability (|v| - lower) / (upper - lower); the grid step is a power of 2,
        # so the fraction is exact (a product with 1 / step, 0 past the top code), and
        # uniform = top 24 random bits / 2^24 is exact in fp32.
        inverse_steps = np.append(1 / np.diff(E2M1_MAGNITUDES), 0).astype(np.float32)
        code = jnp.sum(a >= magnitudes[1:], axis=-1)
        lower = magnitudes[code]
        fraction = (a[..., 0] - lower) * jnp.asarray(inverse_steps)[code]
        top_bits = jnp.asarray(random_bits, jnp.uint32) >> 8
        uniform = top_bits.astype(jnp.float32) * np.float32(2.0**-24)
        # A subnormal |v| reads as 0 where subnormals are flushed, yet its fraction is positive: a zero draw rounds up.
        zero_draw_rounds_up = (top_bits == 0) & (a_bits > to_bits(lower))
        code = code + ((uniform < fraction) | zero_draw_rounds_up).astype(code.dtype)
    code = code | ((to_bits(values) >> 31).astype(code.dtype) << 3)
    return jnp.where(is_nan(values), 0, code).astype(jnp.uint8)


def decode_e2m1(codes) -> Array:
    """e2m1 codes (0..15, one per element) -> fp32 values."""
    codes = jnp.asarray(codes, jnp.uint8)
    value = jnp.asarray(E2M1_MAGNITUDES, jnp.float32)[codes & 0x7]
    return jnp.where((codes & 0x8) != 0, -value, value)


def pack_fp4(codes) -> Array:
    """Two e2m1 codes per byte along the last dim: element 2i in the LOW nibble, 2i+1 in the HIGH."""
    codes = jnp.asarray(codes, jnp.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {codes.shape[-1]}; pad it")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed) -> Array:
    """Inverse of pack_fp4: uint8 [..., C // 2] -> codes [..., C]."""
    packed = jnp.asarray(packed, jnp.uint8)
    return jnp.stack((packed & 0xF, packed >> 4), axis=-1).reshape(*packed.shape[:-1], -1)


# ----------------------------------------------------------------------------- scales


def scale_from_amax(amax, fmax: float, *, power_2_scale: bool = False, amax_epsilon: float = 0.0) -> Array:
    """fp32 scale = fmax / max(amax, eps); 1 for amax 0/inf/NaN, fp32 max on overflow, optionally 2^floor."""
    amax = jnp.asarray(amax, jnp.float32)
    epsilon = np.float32(amax_epsilon)
    amax = jnp.where(magnitude_bits(amax) < to_bits(epsilon), epsilon, amax)  # NaN stays NaN
    scale = divide(fmax, amax)  # correctly rounded on every backend
    scale = jnp.where(jnp.isinf(scale), jnp.float32(FP32_MAX), scale)
    scale = jnp.where((magnitude_bits(amax) == 0) | ~jnp.isfinite(amax), jnp.float32(1.0), scale)
    if power_2_scale:  # keep the exponent bits only (the scale is positive): rounds down
        scale = from_bits(to_bits(scale) & np.uint32(0x7F800000))
    return scale


def e8m0_from_amax(amax, fmt: str, rounding: str = "up") -> Array:
    """MXFP8 block scale as a biased exponent (uint8): 2^(e - 127) >= amax / fmax ("up") or OCP "floor"."""
    f = FORMATS[fmt]
    amax = jnp.asarray(amax, jnp.float32)
    if rounding == "up":  # TransformerEngine's float_to_e8m0: a ratio <= 2^-127 gives 0
        ratio_bits = to_bits(multiply(amax, np.float32(1.0 / f.max)))  # exact even when subnormal
        exponent = ((ratio_bits >> 23) & 0xFF).astype(jnp.int32) + ((ratio_bits & 0x7FFFFF) != 0)
        exponent = jnp.where(ratio_bits <= E8M0_UP_ZERO_BITS, 0, exponent)
    elif rounding == "floor":  # floor(log2(amax)) - emax_elem, biased; subnormal amax -> 0
        exponent = jnp.clip(((to_bits(amax) >> 23) & 0xFF).astype(jnp.int32) - f.max_exponent, 0, 254)
    else:
        raise ValueError(f"scale_rounding={rounding!r}: use 'up' (TransformerEngine, JAX) or 'floor' (OCP MX)")
    exponent = jnp.where(jnp.isinf(amax), E8M0_INF_CODE, exponent)
    exponent = jnp.where(is_nan(amax), FORMATS["e8m0"].nan_code, exponent)
    return exponent.astype(jnp.uint8)


def _power_of_two_bits(exponent_of_two) -> Array:
    """Bits of 2^k for integer k: k = -127 gives a subnormal, k outside [-127, 127] NaN bits (code 0xFF)."""
    k = jnp.asarray(exponent_of_two, jnp.int32)
    bits = jnp.where(k == -127, np.uint32(0x00400000), (jnp.clip(k, -126, 127) + 127).astype(jnp.uint32) << 23)
    return jnp.where((k < -127) | (k > 127), np.uint32(0x7FC00000), bits)


def e8m0_encode_multiplier(exponent, rounding: str = "up") -> Array:
    """The exact fp32 factor 2^(127 - e) that maps a block onto the element grid (NaN for code 0xFF).

    "up" leaves a block of code 0 unscaled (factor 1), as TransformerEngine does: its amax is at most
    2^-127 * fmax, so its elements cast to +-0 either way, without a 2^127 that could reach fmax.
    """
    e = jnp.asarray(exponent, jnp.uint8).astype(jnp.int32)
    multiplier = from_bits(_power_of_two_bits(127 - e))
    return jnp.where(e == 0, jnp.float32(1.0), multiplier) if rounding == "up" else multiplier


# ----------------------------------------------------------------------------- randomness, Hadamard

# lowbias32 (C. Wellons): a 32-bit integer mixer that torch (int64), Triton and jnp (uint32)
# compute identically, so stochastic rounding needs no shared random tensor.
HASH_MULTIPLIERS = (np.uint32(0x7FEB352D), np.uint32(0x846CA68B))
HASH_SHIFTS = (16, 15, 16)
_MASK32 = 0xFFFFFFFF


def hash32(x) -> Array:
    """lowbias32 of each uint32 value (multiplications wrap mod 2^32)."""
    x = jnp.asarray(x, jnp.uint32)
    x = x ^ (x >> HASH_SHIFTS[0])
    x = x * HASH_MULTIPLIERS[0]
    x = x ^ (x >> HASH_SHIFTS[1])
    x = x * HASH_MULTIPLIERS[1]
    return x ^ (x >> HASH_SHIFTS[2])


def seed_as_uint32(seed) -> Array:
    """A seed (a Python int of any size, or an integer jax scalar) reduced mod 2^32, as a uint32 scalar."""
    if isinstance(seed, (int, np.integer)):
        return jnp.asarray(np.uint32(int(seed) & _MASK32))
    return jnp.asarray(seed).astype(jnp.uint32)  # integer conversion wraps mod 2^32


def stochastic_rounding_bits(seed, index) -> Array:
    """32 random bits per element: hash32(index mod 2^32 XOR hash32(seed mod 2^32))."""
    return hash32(jnp.asarray(index, jnp.uint32) ^ hash32(seed_as_uint32(seed)))


HADAMARD_SIZE = 16
HADAMARD_SIGN_BITS = 0b1001_0110_1100_1010  # bit i set: sign i is -1 (fixed, arbitrary)


def hadamard_signs() -> Array:
    """The fixed +-1 diagonal of the random Hadamard transform, fp32 [16]."""
    bits = (HADAMARD_SIGN_BITS >> np.arange(HADAMARD_SIZE)) & 1
    return jnp.asarray(1 - 2 * bits, jnp.float32)


def _apply_signs(tiles: Array) -> Array:
    """tiles * signs, as a sign-bit flip (exact for subnormals too)."""
    flips = (HADAMARD_SIGN_BITS >> np.arange(HADAMARD_SIZE, dtype=np.uint32)) & 1
    return from_bits(to_bits(tiles) ^ (jnp.asarray(flips, jnp.uint32) * SIGN_BIT))


def random_hadamard_transform(x, *, inverse: bool = False) -> Array:
    """(1/4) H16 diag(signs) on each 16-element tile of the last dim (inverse: diag(signs) (1/4) H16).

    Fixed fp32 order every implementation follows: signs, then butterflies of stride 1, 2, 4, 8
    (element i pairs with i + h where bit h of i is 0: (a, b) -> (a + b, a - b)), then * 0.25.
    """
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[-1] % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform needs a last dim divisible by 16, got shape {x.shape}")
    tiles = x.astype(jnp.float32).reshape(-1, HADAMARD_SIZE)
    if not inverse:
        tiles = _apply_signs(tiles)
    for stride in (1, 2, 4, 8):
        pairs = tiles.reshape(-1, HADAMARD_SIZE // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0:1], pairs[:, :, 1:2]
        both = add(jnp.concatenate((a, a), axis=2), jnp.concatenate((b, negate(b)), axis=2))  # (a + b, a - b)
        tiles = both.reshape(-1, HADAMARD_SIZE)
    tiles = scale_down_by_power_of_two(tiles, 2)  # * 0.25
    if inverse:
        tiles = _apply_signs(tiles)
    return tiles.reshape(x.shape)
