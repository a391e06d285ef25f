"""Triton twins of kernels.formats: casts as integer bit operations, block scales, the hash, the RHT.

Why bit operations: the interpreter's own fp8/bf16 casts round wrongly and do not saturate
(../shared/notes/cpu-feasibility.md), and integer arithmetic means the same thing on every
backend. The one float operation in a cast is an IEEE fp32 add that rounds subnormal results
(correctly rounded everywhere, never fused: its operand comes from a bitcast). The
interpreter also mis-scales bf16 subnormals when upcasting, so bf16 is widened by its bits
(`to_f32`). A format reaches a kernel as the constexprs of `format_constants` (one table, no
per-format copies). Codes are int32 tensors holding the byte.
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

from kernels.formats import FORMATS, HADAMARD_SIGN_BITS, HASH_MULTIPLIERS

# Globals a @triton.jit function reads must be constexprs.
_HADAMARD_SIGN_BITS = tl.constexpr(HADAMARD_SIGN_BITS)
_HASH_MULTIPLIER_1 = tl.constexpr(HASH_MULTIPLIERS[0])
_HASH_MULTIPLIER_2 = tl.constexpr(HASH_MULTIPLIERS[1])
_FP32_MAX_BITS = tl.constexpr(0x7F7FFFFF)
_FP32_INF_BITS = tl.constexpr(0x7F800000)
_FP32_NAN_BITS = tl.constexpr(0x7FC00000)


def format_constants(fmt: str, prefix: str = "") -> dict[str, int]:
    """The constexprs that describe `fmt` to the cast helpers (keys optionally prefixed)."""
    f = FORMATS[fmt]
    max_bits = struct.unpack("<i", struct.pack("<f", f.max))[0]
    values = {
        "EXPONENT_BITS": f.exponent_bits, "MANTISSA_BITS": f.mantissa_bits, "MAX_BITS": max_bits, "NAN_CODE": f.nan_code
    }
    return {prefix + key: value for key, value in values.items()}


@triton.jit
def _bits_f32(like, BITS: tl.constexpr):
    """A tensor shaped like `like` filled with the fp32 whose bits are BITS (NaN, max...)."""
    return tl.full(like.shape, BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _magnitude_code(
    magnitude, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, ROUND_TO_NEAREST: tl.constexpr
):
    """Code of a non-negative fp32 (as int32 bits, at most the format's max): nearest-even or truncated."""
    BIAS: tl.constexpr = (1 << (EXPONENT_BITS - 1)) - 1
    SHIFT: tl.constexpr = 23 - MANTISSA_BITS
    # Normal range: drop SHIFT mantissa bits (a carry rolls into the exponent), then rebias.
    if ROUND_TO_NEAREST:
        normal = (magnitude + ((1 << (SHIFT - 1)) - 1) + ((magnitude >> SHIFT) & 1)) >> SHIFT
    else:
        normal = magnitude >> SHIFT
    normal = normal - ((127 - BIAS) << MANTISSA_BITS)
    # Subnormal range: count units of the smallest subnormal, 2^(1 - BIAS - MANTISSA_BITS).
    value = magnitude.to(tl.float32, bitcast=True)
    if ROUND_TO_NEAREST:  # add 2^(24 - BIAS - MANTISSA_BITS), whose fp32 ulp is that unit: IEEE add rounds to even
        MAGIC_BITS: tl.constexpr = (151 - BIAS - MANTISSA_BITS) << 23
        subnormal = (value + _bits_f32(value, MAGIC_BITS)).to(tl.int32, bitcast=True) - MAGIC_BITS
    else:  # exact power-of-two product, then truncation toward zero
        subnormal = (value * _bits_f32(value, (126 + BIAS + MANTISSA_BITS) << 23)).to(tl.int32)
    return tl.where(magnitude >= ((128 - BIAS) << 23), normal, subnormal)


@triton.jit
def f32_to_code(
    x, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr
):
    """fp32 -> code (int32): canonical NaN, saturate to +-max (inf too), round to nearest even."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    code = _magnitude_code(tl.minimum(magnitude, MAX_BITS), EXPONENT_BITS, MANTISSA_BITS, True)
    code = code | (((bits >> 31) & 1) << (EXPONENT_BITS + MANTISSA_BITS))
    return tl.where(magnitude > 0x7F800000, NAN_CODE, code)


@triton.jit
def code_to_f32(code, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, NAN_MAGNITUDE: tl.constexpr):
    """Code (int32) -> fp32; NAN_MAGNITUDE is the magnitude code that means NaN (-1: none)."""
    BIAS: tl.constexpr = (1 << (EXPONENT_BITS - 1)) - 1
    magnitude = code & ((1 << (EXPONENT_BITS + MANTISSA_BITS)) - 1)
    exponent = magnitude >> MANTISSA_BITS
    mantissa = magnitude & ((1 << MANTISSA_BITS) - 1)
    normal = (((exponent + (127 - BIAS)) << 23) | (mantissa << (23 - MANTISSA_BITS))).to(tl.float32, bitcast=True)
    # A subnormal is mantissa * 2^(1 - BIAS - MANTISSA_BITS): an exact product with that power of two.
    unit = tl.full(code.shape, (128 - BIAS - MANTISSA_BITS) << 23, tl.int32).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * unit, normal)
    value = tl.where((code >> (EXPONENT_BITS + MANTISSA_BITS)) & 1 == 1, -value, value)
    return tl.where(magnitude == NAN_MAGNITUDE, _bits_f32(value, _FP32_NAN_BITS), value)


@triton.jit
def f32_to_e4m3_code(x):
    """e4m3 (max 448 = 0x43E00000, NaN 0x7F): the NVFP4 block scales."""
    return f32_to_code(x, 4, 3, 0x43E00000, 0x7F)


@triton.jit
def e4m3_code_to_f32(code):
    return code_to_f32(code, 4, 3, 0x7F)


@triton.jit
def f32_to_e2m1_code(x):
    """e2m1 (max 6 = 0x40C00000, NaN -> 0): the NVFP4 elements, nearest-even."""
    return f32_to_code(x, 2, 1, 0x40C00000, 0)


@triton.jit
def f32_to_e2m1_code_stochastic(x, random_bits):
    """e2m1 with stochastic rounding: up iff top-24-bits / 2^24 < (|x| - lower) / (upper - lower)."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = tl.minimum(bits & 0x7FFFFFFF, 0x40C00000)
    lower_code = _magnitude_code(magnitude, 2, 1, False)
    lower = code_to_f32(lower_code, 2, 1, -1)
    upper = code_to_f32(tl.minimum(lower_code + 1, 7), 2, 1, -1)
    step = tl.where(upper > lower, upper - lower, 1.0)  # a power of two: the quotient is exact
    fraction = tl.where(upper > lower, tl.math.div_rn(magnitude.to(tl.float32, bitcast=True) - lower, step), 0.0)
    uniform = (random_bits >> 8).to(tl.float32) * (1.0 / 16777216.0)
    code = lower_code + (uniform < fraction).to(tl.int32)
    code = code | (((bits >> 31) & 1) << 3)
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0, code)


@triton.jit
def to_f32(x):
    """Exact upcast to fp32; bf16 goes through its bits (the interpreter mis-scales bf16 subnormals)."""
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def abs_bits(x):
    """|x| as int32 fp32 bits: integer max is float max for these, and a NaN beats everything."""
    return to_f32(x).to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def f32_to_bf16_bits(x):
    """bf16 bits (uint16) of fp32 x, round to nearest even (overflow -> inf); NaN -> torch's 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, rounded).to(tl.uint16)


@triton.jit
def scale_from_amax(amax, FMAX: tl.constexpr, POWER_2: tl.constexpr, EPSILON: tl.constexpr):
    """fmax / max(amax, eps) correctly rounded; 1 for amax 0/inf/NaN; fp32 max on overflow; 2^floor."""
    amax = tl.where(amax < EPSILON, EPSILON, amax)  # NaN stays NaN
    scale = tl.math.div_rn(tl.full(amax.shape, FMAX, tl.float32), amax)
    scale = tl.where(scale.to(tl.int32, bitcast=True) == _FP32_INF_BITS, _bits_f32(scale, _FP32_MAX_BITS), scale)
    amax_bits = amax.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    scale = tl.where((amax == 0) | (amax_bits >= _FP32_INF_BITS), 1.0, scale)
    if POWER_2:
        scale = (scale.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return scale


@triton.jit
def e8m0_from_amax_bits(amax_bits, INV_FMAX: tl.constexpr, MAX_EXPONENT: tl.constexpr, ROUND_UP: tl.constexpr):
    """MXFP8 biased block exponent from |amax| bits: round up of amax * fp32(1/fmax), or OCP floor."""
    if ROUND_UP:
        ratio = (amax_bits.to(tl.float32, bitcast=True) * INV_FMAX).to(tl.int32, bitcast=True)
        exponent = ((ratio >> 23) & 0xFF) + ((ratio & 0x7FFFFF) != 0).to(tl.int32)
    else:
        exponent = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) - MAX_EXPONENT, 0), 254)
    exponent = tl.where(amax_bits == 0x7F800000, 0xFE, exponent)
    return tl.where(amax_bits > 0x7F800000, 0xFF, exponent)


@triton.jit
def e8m0_encode_multiplier(exponent):
    """2^(127 - e) exactly in fp32 (2^-127 is subnormal); NaN for e = 0xFF."""
    bits = tl.where(exponent == 254, 0x00400000, (254 - exponent) << 23)
    multiplier = bits.to(tl.float32, bitcast=True)
    return tl.where(exponent == 0xFF, _bits_f32(multiplier, _FP32_NAN_BITS), multiplier)


@triton.jit
def hash32(x):
    """lowbias32 on uint32 (wrapping multiplies), as kernels.formats.hash32."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, _HASH_MULTIPLIER_1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, _HASH_MULTIPLIER_2, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _butterfly(x, ROWS: tl.constexpr, COLS: tl.constexpr, STRIDE: tl.constexpr):
    """One Walsh-Hadamard stage: element i pairs with i + STRIDE (bit STRIDE of i clear): (a+b, a-b)."""
    pairs = tl.reshape(x, [ROWS, COLS // (2 * STRIDE), 2, STRIDE])
    a, b = tl.split(tl.permute(pairs, [0, 1, 3, 2]))
    pairs = tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2])
    return tl.reshape(pairs, [ROWS, COLS])


@triton.jit
def hadamard_rows(x, ROWS: tl.constexpr, COLS: tl.constexpr):
    """The random Hadamard transform on each 16-element tile of the rows, in the reference's order."""
    column = tl.arange(0, COLS) % 16
    sign_bits = tl.full(column.shape, _HADAMARD_SIGN_BITS, tl.int32)
    signs = 1.0 - 2.0 * ((sign_bits >> column) & 1).to(tl.float32)
    x = x * signs[None, :]
    x = _butterfly(x, ROWS, COLS, 1)
    x = _butterfly(x, ROWS, COLS, 2)
    x = _butterfly(x, ROWS, COLS, 4)
    x = _butterfly(x, ROWS, COLS, 8)
    return x * 0.25
