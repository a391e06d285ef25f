"""IEEE fp32 arithmetic (round to nearest even, gradual underflow) on backends that flush subnormals.

XLA on CPU computes with flush-to-zero and denormals-are-zero, on purpose (jax-ml/jax#16200): a
subnormal operand reads as +-0 and a subnormal result is written as +-0. torch keeps them, and
quantized bytes depend on them: a block of fp32 subnormals scaled up by 2^127, a `1 / scale` below
2^-126, an e8m0 ratio `amax / fmax` below 2^-126. The functions here return the IEEE result on every
backend: no float operation's result depends on a subnormal operand or result (a subnormal travels
as its integer significand).

Division is worse: XLA rewrites `a / broadcast(b)` as `a * (1 / b)` (one rounding more), and on GPU
its fp32 division is not correctly rounded (1 ulp off, seen on an H200 with jax 0.11). So `multiply`
and `divide` round with integer operations only: the exact product of the significands, or their
long division, then one round-to-nearest-even step shared by normal, subnormal and overflowing
results. They give the same bits on every backend.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import Array, lax

# uint32 constants (a Python int above 2^31 would not pass as a weakly typed jnp scalar)
SIGN_BIT = np.uint32(0x80000000)
MAGNITUDE_MASK = np.uint32(0x7FFFFFFF)
FRACTION_MASK = np.uint32(0x007FFFFF)
IMPLICIT_BIT = np.uint32(0x00800000)  # also the bits of 2^-126, the smallest normal
INF_BITS = np.uint32(0x7F800000)
_TINY_SUM_BITS = np.uint32((127 - 60) << 23)  # 2^-60: below it `add` works on operands scaled by 2^64


def to_bits(x) -> Array:
    """The uint32 bit pattern of fp32 values."""
    return lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)


def from_bits(bits) -> Array:
    """fp32 values from uint32 bit patterns."""
    return lax.bitcast_convert_type(jnp.asarray(bits, jnp.uint32), jnp.float32)


def magnitude_bits(x) -> Array:
    """Bits of |x|: for non-negative floats the integer order is the float order (NaN above inf)."""
    return to_bits(x) & MAGNITUDE_MASK


def is_nan(x) -> Array:
    """NaN test on the bits."""
    return magnitude_bits(x) > INF_BITS


def is_finite(x) -> Array:
    """Finite test on the bits."""
    return magnitude_bits(x) < INF_BITS


def is_subnormal(x) -> Array:
    """Nonzero and below 2^-126 in magnitude."""
    magnitude = magnitude_bits(x)
    return (magnitude != 0) & (magnitude < IMPLICIT_BIT)


def significand_exponent(x) -> tuple[Array, Array]:
    """(significand uint32 < 2^24, exponent int32) with |x| = significand * 2^exponent, for finite x."""
    magnitude = magnitude_bits(x)
    field = (magnitude >> 23).astype(jnp.int32)
    significand = jnp.where(field == 0, magnitude, (magnitude & FRACTION_MASK) | IMPLICIT_BIT)
    return significand, jnp.maximum(field, 1) - 150


def power_of_two(exponent) -> Array:
    """2^exponent as fp32 for integer exponents in [-126, 127]."""
    return from_bits((jnp.asarray(exponent, jnp.int32) + 127).astype(jnp.uint32) << 23)


def max_magnitude(x, axis=None) -> Array:
    """max |x| over `axis`, compared as integers (exact for subnormals); NaN if any is NaN; 0 if empty."""
    largest = jnp.max(magnitude_bits(x), axis=axis, initial=0)
    return jnp.where(largest > INF_BITS, jnp.float32(jnp.nan), from_bits(largest))


def negate(x) -> Array:
    """-x by flipping the sign bit (exact for every value, subnormals included)."""
    return from_bits(to_bits(x) ^ SIGN_BIT)


# ----------------------------------------------------------------------------- multiply, divide


def _normalize(significand: Array, exponent: Array) -> tuple[Array, Array]:
    """Shift a nonzero significand (< 2^24) up into [2^23, 2^24), lowering the exponent to match."""
    shift = jnp.maximum(lax.clz(significand).astype(jnp.int32) - 8, 0)
    return significand << shift.astype(jnp.uint32), exponent - shift


def _round_shift_right(value: Array, shift: Array) -> Array:
    """value / 2^shift rounded to nearest, ties to even, for uint32 values and shift in [0, 31]."""
    shift = shift.astype(jnp.uint32)
    quotient = value >> shift
    remainder = value & ((jnp.uint32(1) << shift) - 1)
    half = jnp.where(shift == 0, 0, jnp.uint32(1) << ((shift - 1) & 31))
    odd = (quotient & 1) == 1
    round_up = (shift > 0) & ((remainder > half) | ((remainder == half) & odd))
    return quotient + round_up.astype(jnp.uint32)


def _round_to_bits(value: Array, sticky: Array, exponent: Array) -> Array:
    """fp32 magnitude bits of (value + f) * 2^exponent, f in [0, 1) nonzero iff `sticky`, rounded to nearest even.

    value is uint32 in [2^24, 2^26): at least one bit below the 24 a normal keeps. Below 2^-126 the
    grid is coarser (subnormals), so more bits go; a carry out of the significand lands in the
    exponent field, up to inf.
    """
    length = 32 - lax.clz(value).astype(jnp.int32)
    field = exponent + length + 126  # biased exponent of the leading bit
    shift = length - 24 + jnp.maximum(1 - field, 0)
    with_sticky = (value << 1) | sticky.astype(jnp.uint32)  # the sticky bit sits below the half bit
    rounded = _round_shift_right(with_sticky, jnp.clip(shift + 1, 0, 31))
    bits = ((jnp.maximum(field, 1) - 1).astype(jnp.uint32) << 23) + rounded
    return jnp.where(field >= 255, INF_BITS, jnp.minimum(bits, INF_BITS))


def _product_words(a: Array, b: Array) -> tuple[Array, Array]:
    """a * b for a, b < 2^24 (uint32) as (high, low) 32-bit words, from 16-bit halves."""
    a_high, a_low = a >> 16, a & 0xFFFF
    b_high, b_low = b >> 16, b & 0xFFFF
    low = a_low * b_low
    middle = a_high * b_low + a_low * b_high  # < 2^25
    low_sum = low + (middle << 16)  # wraps mod 2^32
    carry = (low_sum < low).astype(jnp.uint32)
    return a_high * b_high + (middle >> 16) + carry, low_sum


def _nonfinite_product(x: Array, s: Array) -> Array:
    """IEEE x * s where x or s is inf or NaN; a subnormal factor is read as +-2^-126 (DAZ would make inf * it NaN)."""
    smallest_normal = from_bits(IMPLICIT_BIT)
    x = jnp.where(is_subnormal(x), jnp.copysign(smallest_normal, x), x)
    s = jnp.where(is_subnormal(s), jnp.copysign(smallest_normal, s), s)
    return x * s


def multiply(x, s) -> Array:
    """x * s as IEEE fp32 rounds it, subnormal operands and results included."""
    x, s = jnp.broadcast_arrays(jnp.asarray(x, jnp.float32), jnp.asarray(s, jnp.float32))
    sign = (to_bits(x) ^ to_bits(s)) & SIGN_BIT
    sig_x, exp_x = _normalize(*significand_exponent(x))
    sig_s, exp_s = _normalize(*significand_exponent(s))
    high, low = _product_words(sig_x, sig_s)  # the exact product, in [2^46, 2^48)
    top = (high << 10) | (low >> 22)  # its top 26 bits; the 22 below only matter as a sticky bit
    magnitude = _round_to_bits(top, (low & 0x3FFFFF) != 0, exp_x + exp_s + 22)
    magnitude = jnp.where((sig_x == 0) | (sig_s == 0), 0, magnitude)
    product = from_bits(magnitude | sign)
    return jnp.where(is_finite(x) & is_finite(s), product, _nonfinite_product(x, s))


def _long_divide(numerator: Array, divisor: Array) -> tuple[Array, Array]:
    """(floor(numerator * 2^25 / divisor), whether a remainder is left) for both in [2^23, 2^24)."""
    quotient, remainder = jnp.zeros_like(numerator), numerator
    for step in (8, 8, 8, 1):  # remainder < 2^24, so remainder << 8 fits 32 bits
        remainder = remainder << step
        quotient = (quotient << step) + lax.div(remainder, divisor)
        remainder = lax.rem(remainder, divisor)
    return quotient, remainder != 0


def _special_quotient(n: Array, d: Array, sign: Array) -> Array:
    """IEEE n / d where an operand is 0, inf or NaN."""
    n_magnitude, d_magnitude = magnitude_bits(n), magnitude_bits(d)
    both_inf = (n_magnitude == INF_BITS) & (d_magnitude == INF_BITS)
    nan = is_nan(n) | is_nan(d) | both_inf | ((n_magnitude == 0) & (d_magnitude == 0))
    infinite = (n_magnitude == INF_BITS) | (d_magnitude == 0)
    magnitude = jnp.where(infinite, INF_BITS, np.uint32(0))
    return jnp.where(nan, jnp.float32(jnp.nan), from_bits(magnitude | sign))


def divide(n, d) -> Array:
    """n / d as IEEE fp32 rounds it, subnormal operands and results included."""
    n, d = jnp.broadcast_arrays(jnp.asarray(n, jnp.float32), jnp.asarray(d, jnp.float32))
    sign = (to_bits(n) ^ to_bits(d)) & SIGN_BIT
    sig_n, exp_n = _normalize(*significand_exponent(n))
    sig_d, exp_d = _normalize(*significand_exponent(d))
    regular = is_finite(n) & is_finite(d) & (sig_n != 0) & (sig_d != 0)
    quotient, sticky = _long_divide(sig_n, jnp.where(regular, sig_d, IMPLICIT_BIT))  # no integer division by 0
    magnitude = _round_to_bits(quotient, sticky, exp_n - exp_d - 25)
    return jnp.where(regular, from_bits(magnitude | sign), _special_quotient(n, d, sign))


def scale_down_by_power_of_two(x, k: int) -> Array:
    """x / 2^k for a static k >= 1, as IEEE rounds it (exact unless the result is subnormal)."""
    x = jnp.asarray(x, jnp.float32)
    magnitude = magnitude_bits(x)
    field = (magnitude >> 23).astype(jnp.int32)
    significand, _ = significand_exponent(x)
    # Below 2^-126 the result's bits are the significand shifted right, rounded to nearest even.
    subnormal = _round_shift_right(significand, jnp.clip(1 - jnp.maximum(field, 1) + k, 0, 31))
    magnitude = jnp.where(field - k >= 1, magnitude - np.uint32(k << 23), subnormal)
    return jnp.where(is_finite(x), from_bits(magnitude | (to_bits(x) & SIGN_BIT)), x)


def _scale_up_by_2_64(x: Array) -> Array:
    """x * 2^64 for |x| < 2^-60 (exact: the result is normal)."""
    significand, _ = significand_exponent(x)
    from_subnormal = significand.astype(jnp.float32) * power_of_two(64 - 149)
    scaled = jnp.where(is_subnormal(x), from_subnormal, from_bits(magnitude_bits(x) + np.uint32(64 << 23)))
    scaled = jnp.where(magnitude_bits(x) == 0, 0.0, scaled)
    return from_bits(to_bits(scaled) | (to_bits(x) & SIGN_BIT))


def add(a, b) -> Array:
    """a + b as IEEE fp32 rounds it, subnormal operands and results included."""
    a, b = jnp.broadcast_arrays(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32))
    # Below 2^-60 both are normal once scaled by 2^64 (exactly); the sum rounds as it would unscaled
    # (a subnormal-range sum is exact there) and scales back. Above, a subnormal term is under half
    # an ulp of the other and IEEE drops it, as a flushing backend does.
    tiny = jnp.maximum(magnitude_bits(a), magnitude_bits(b)) < _TINY_SUM_BITS
    scaled_sum = scale_down_by_power_of_two(_scale_up_by_2_64(a) + _scale_up_by_2_64(b), 64)
    return jnp.where(tiny, scaled_sum, a + b)
