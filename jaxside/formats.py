"""Number formats and the element-level pieces of quantization, in jnp: the twin of fp8kernels/formats.py.

The dtype of each format (the format table and the other constants are in twinspec.formats), element
casts, fp32 and e8m0 block scales, FP4 packing, the stochastic-rounding hash and the random
Hadamard transform, each returning the same bytes as the torch spec (docs/quantization.md states the rules). Two JAX differences are handled
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
from twinspec.formats import E2M1_MAGNITUDES, E8M0_INF_CODE, E8M0_UP_ZERO_BITS, FORMATS, FP32_MAX
from twinspec.formats import HADAMARD_SIGN_BITS, HADAMARD_SIZE, HASH_MULTIPLIERS, HASH_SHIFTS, MASK32

# The jnp/ml_dtypes dtype of each format JAX casts to (e2m1 has none: it is packed by hand)
DTYPES = {
    "e4m3": np.dtype(ml_dtypes.float8_e4m3fn),
    "e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "e8m0": np.dtype(ml_dtypes.float8_e8m0fnu),
}


# ----------------------------------------------------------------------------- element casts


def encode_fp8(values, fmt: str) -> Array:
    """fp32 values -> uint8 codes of e4m3/e5m2: NaN and +-inf -> the canonical NaN, finite values saturate
    to +-max, round to nearest even."""
    f = FORMATS[fmt]
    values = jnp.asarray(values, jnp.float32)
    # JAX's cast overflows to NaN instead of saturating: clip first (a subnormal input rounds to +-0 either way).
    codes = lax.bitcast_convert_type(jnp.clip(values, -f.max, f.max).astype(DTYPES[fmt]), jnp.uint8)
    return jnp.where(is_finite(values), codes, jnp.uint8(f.nan_code))


def decode_fp8(codes, fmt: str) -> Array:
    """uint8 codes of e4m3/e5m2/e8m0 -> fp32 values (NaN codes -> NaN)."""
    codes = jnp.asarray(codes, jnp.uint8)
    if fmt == "e8m0":  # built from the bits: code 0 is 2^-127, an fp32 subnormal
        return from_bits(_power_of_two_bits(codes.astype(jnp.int32) - 127))
    return lax.bitcast_convert_type(codes, DTYPES[fmt]).astype(jnp.float32)


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
        exponent = jnp.where(ratio_bits <= np.uint32(E8M0_UP_ZERO_BITS), 0, exponent)
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

_HASH_MULTIPLIERS = tuple(map(np.uint32, HASH_MULTIPLIERS))  # lowbias32 on uint32: products wrap mod 2^32


def hash32(x) -> Array:
    """lowbias32 of each uint32 value (multiplications wrap mod 2^32)."""
    x = jnp.asarray(x, jnp.uint32)
    x = x ^ (x >> HASH_SHIFTS[0])
    x = x * _HASH_MULTIPLIERS[0]
    x = x ^ (x >> HASH_SHIFTS[1])
    x = x * _HASH_MULTIPLIERS[1]
    return x ^ (x >> HASH_SHIFTS[2])


def seed_as_uint32(seed) -> Array:
    """A seed (a Python int of any size, or an integer jax scalar) reduced mod 2^32, as a uint32 scalar."""
    if isinstance(seed, (int, np.integer)):
        return jnp.asarray(np.uint32(int(seed) & MASK32))
    return jnp.asarray(seed).astype(jnp.uint32)  # integer conversion wraps mod 2^32


def stochastic_rounding_bits(seed, index) -> Array:
    """32 random bits per element: hash32(index mod 2^32 XOR hash32(seed mod 2^32))."""
    return hash32(jnp.asarray(index, jnp.uint32) ^ hash32(seed_as_uint32(seed)))


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
