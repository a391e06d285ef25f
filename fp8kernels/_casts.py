"""Triton twins of fp8kernels.formats: casts as bit operations, block scales, the hash, the RHT.

Why not Triton's casts: the interpreter's own fp8/bf16 casts round wrongly and do not saturate
(../shared/notes/cpu-feasibility.md). Our casts use integer bit operations plus IEEE fp32
arithmetic that is exact or explicitly rounded (products by powers of two, one fma), which
means the same thing in numpy and on the GPU; rounding with the fp32 pipe instead of the
integer one is what makes them fast on Hopper (see f32_to_code). The interpreter also
mis-scales bf16 subnormals when upcasting, so bf16 is widened by its bits (`to_f32`). A format
reaches a kernel as the constexprs of `format_constants` (one table, no per-format copies).
Codes are int32 tensors holding the byte. The "runs" helpers at the end lay a tile out for
per-block work (see there).
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Mapping
from types import MappingProxyType

import triton
import triton.language as tl

from twinspec.formats import FORMATS, HADAMARD_SIGN_BITS, HASH_MULTIPLIERS

# Globals a @triton.jit function reads must be constexprs.
_HADAMARD_SIGN_BITS = tl.constexpr(HADAMARD_SIGN_BITS)
_HASH_MULTIPLIER_1 = tl.constexpr(HASH_MULTIPLIERS[0])
_HASH_MULTIPLIER_2 = tl.constexpr(HASH_MULTIPLIERS[1])
_FP32_MAX_BITS = tl.constexpr(0x7F7FFFFF)
_FP32_INF_BITS = tl.constexpr(0x7F800000)
_FP32_NAN_BITS = tl.constexpr(0x7FC00000)


@functools.cache  # read-only: every launch splats it
def format_constants(fmt: str, prefix: str = "") -> Mapping[str, int]:
    """The constexprs that describe `fmt` to the cast helpers (keys optionally prefixed)."""
    f = FORMATS[fmt]
    max_bits = struct.unpack("<i", struct.pack("<f", f.max))[0]
    values = {
        "EXPONENT_BITS": f.exponent_bits, "MANTISSA_BITS": f.mantissa_bits, "MAX_BITS": max_bits, "NAN_CODE": f.nan_code
    }
    return MappingProxyType({prefix + key: value for key, value in values.items()})


@triton.jit
def _bits_f32(like, BITS: tl.constexpr):
    """A tensor shaped like `like` filled with the fp32 whose bits are BITS (NaN, max...)."""
    return tl.full(like.shape, BITS, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_code(
    x, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    IN_RANGE: tl.constexpr = False, TOP: tl.constexpr = False, HARDWARE: tl.constexpr = False,
):
    """fp32 -> code (int32): NaN_CODE for NaN (and for +-inf in the fp8 formats), saturate finite values to
    +-max (e2m1, which has no NaN: inf too), round to nearest even.

    Rounding with float ops rather than integer ones: on Hopper the integer pipe is half as wide as
    the fp32 one and the casts were bound by it. Scaling by 2^(BIAS - 127) puts the format's exponent
    in fp32's exponent field and its subnormals on fp32's subnormals, so the code is a shift of the
    scaled value's bits. magic = 2^(max(exponent(value), 1 - BIAS) + 23 - MANTISSA_BITS), scaled alike,
    makes fp32's ulp of value * 2^(BIAS - 127) + magic the scaled grid step at value: one fma (the
    product is exact inside it) rounds to the grid, ties to even, and taking magic away is exact. The
    add is an explicit fma on purpose: ptxas may reassociate a plain add and a plain sub of magic.

    IN_RANGE: the caller has checked (once per tile, see `rounding_limit`) that no x is NaN and every
    |x| is below the rounding limit, so the clamp and the NaN test are skipped and the sign comes from
    x * 0 (+-0) on the fp32 pipe. TOP: the code in the top bits of the int32, zeros below (packing
    codes into words then takes one shift each). No nested helpers: the interpreter pays per jit call.

    HARDWARE (compiled kernels only, fp8 formats, with IN_RANGE): the cvt.rn.satfinite of sm_89+, one
    instruction per two values instead of ~10 each. For finite values below the rounding limit round to
    nearest even has one answer, so the bytes are the same; NaN, inf and overflow never reach it (its
    NaN sign and the interpreter's wrong casts do not matter here).
    """
    if HARDWARE and IN_RANGE and EXPONENT_BITS >= 4:
        code = _hardware_fp8_code(x, EXPONENT_BITS, TOP)
    else:
        BIAS: tl.constexpr = (1 << (EXPONENT_BITS - 1)) - 1
        SHIFT: tl.constexpr = 23 - MANTISSA_BITS
        TO_MAGIC: tl.constexpr = 2.0 ** (SHIFT + BIAS - 127)  # a normal fp32: value's exponent, shifted
        UNBIAS: tl.constexpr = 2.0 ** (BIAS - 127)
        if IN_RANGE:
            value = tl.abs(x)
            sign = (x * 0.0).to(tl.int32, bitcast=True)
        else:
            bits = x.to(tl.int32, bitcast=True)
            magnitude = bits & 0x7FFFFFFF
            value = tl.minimum(magnitude, MAX_BITS).to(tl.float32, bitcast=True)
            sign = bits & -2147483648
        exponent = (value * TO_MAGIC).to(tl.int32, bitcast=True) & 0x7F800000
        magic = tl.maximum(exponent, (SHIFT + 1) << 23).to(tl.float32, bitcast=True)  # floor: 2^(1 - BIAS + SHIFT)
        grid = (tl.fma(value, UNBIAS, magic) - magic).to(tl.int32, bitcast=True)  # the code at bit SHIFT
        # The code's bits to the top of the word under the sign (one shift-add), then down.
        SIGN_SHIFT: tl.constexpr = 31 - EXPONENT_BITS - MANTISSA_BITS
        code = (grid << (8 - EXPONENT_BITS)) + sign
        if not TOP:
            code = (code.to(tl.uint32, bitcast=True) >> SIGN_SHIFT).to(tl.int32)
        if not IN_RANGE:
            # fp8 (EXPONENT_BITS >= 4): a non-finite value is never hidden by saturation
            NON_FINITE_BITS: tl.constexpr = 0x7F800000 if EXPONENT_BITS >= 4 else 0x7F800001
            code = tl.where(magnitude >= NON_FINITE_BITS, NAN_CODE << (SIGN_SHIFT if TOP else 0), code)
    return code


@triton.jit
def _hardware_fp8_code(x, EXPONENT_BITS: tl.constexpr, TOP: tl.constexpr):
    """e4m3 (EXPONENT_BITS 4) or e5m2 code of in-range x by the GPU's cvt.rn.satfinite (compiled kernels only)."""
    if EXPONENT_BITS == 4:
        narrow = x.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        narrow = x.to(tl.float8e5, fp_downcast_rounding="rtne")
    code = narrow.to(tl.uint8, bitcast=True).to(tl.int32)
    if TOP:
        code = code << 24
    return code


@triton.jit
def rounding_limit(MAX_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr):
    """The midpoint above the format's max (448 -> 464 for e4m3): every |x| below it rounds to at most max."""
    return tl.full([], MAX_BITS + (1 << (22 - MANTISSA_BITS)), tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def code_to_f32(code, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, NAN_MAGNITUDE: tl.constexpr):
    """Code (int32) -> fp32; NAN_MAGNITUDE is the magnitude code that means NaN (-1: none).

    The magnitude code laid into fp32's exponent and mantissa fields is the value * 2^(BIAS - 127),
    subnormals included (the mirror of f32_to_code), so one exact product decodes it.
    """
    BIAS: tl.constexpr = (1 << (EXPONENT_BITS - 1)) - 1
    magnitude = code & ((1 << (EXPONENT_BITS + MANTISSA_BITS)) - 1)
    value = (magnitude << (23 - MANTISSA_BITS)).to(tl.float32, bitcast=True) * 2.0 ** (127 - BIAS)
    value = tl.where((code >> (EXPONENT_BITS + MANTISSA_BITS)) & 1 == 1, -value, value)
    return tl.where(magnitude == NAN_MAGNITUDE, _bits_f32(value, _FP32_NAN_BITS), value)


@triton.jit
def f32_to_e4m3_code(x, HARDWARE: tl.constexpr = False):
    """e4m3 (max 448 = 0x43E00000, NaN 0x7F): the NVFP4 block scales.

    HARDWARE (compiled kernels): the GPU's cvt.rn.satfinite, which saturates past max as f32_to_code
    does; NaN and inf (which it would saturate) are set apart, for the canonical code.
    """
    if HARDWARE:
        non_finite = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) >= _FP32_INF_BITS
        return tl.where(non_finite, 0x7F, _hardware_fp8_code(x, 4, False))
    return f32_to_code(x, 4, 3, 0x43E00000, 0x7F)


@triton.jit
def e4m3_code_to_f32(code, HARDWARE: tl.constexpr = False):
    if HARDWARE:  # the GPU's exact e4m3 -> fp32 cvt (compiled kernels)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return code_to_f32(code, 4, 3, 0x7F)


@triton.jit
def f32_to_e2m1_code(x, TOP: tl.constexpr = False):
    """e2m1 (max 6 = 0x40C00000, NaN -> 0): the NVFP4 elements, nearest-even."""
    return f32_to_code(x, 2, 1, 0x40C00000, 0, False, TOP)


@triton.jit
def e2m1_top_code_doubled(doubled):
    """e2m1 code of doubled / 2, which the caller has checked (per tile) is below 7 in magnitude, nearest
    even, in the top nibble, with junk in bits 6..8 (_packed_runs drops it): five instructions, against
    nine on the general f32_to_code path.

    magic = 2^max(exponent(|doubled|), 1) is 2^(e2m1 exponent + 1), and its fp32 ulp is 2^-22 times the
    grid step at doubled / 2, so one fma, t = magic + |doubled| * 2^-22, rounds to the grid (ties to
    even): t's low bits hold the grid index n, its exponent field 128 + the e2m1 exponent E. The code
    is n + 2E; one 32-bit integer multiply-add, t * (2^28 + 2^6) + sign, puts n at bit 28 and E's low
    bits at bit 29 (the rest of the exponent overflows away), and n * 2^6 at bits 6..8.
    """
    value = tl.abs(doubled)
    magic = (tl.maximum(value, 2.0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    t = tl.fma(value, 2.0**-22, magic).to(tl.uint32, bitcast=True)
    sign = (doubled * 0.0).to(tl.uint32, bitcast=True)
    return (t * ((1 << 28) + (1 << 6)) + sign).to(tl.int32, bitcast=True)


@triton.jit
def f32_to_e2m1_code_stochastic(x, random_bits):
    """e2m1 with stochastic rounding: up iff top-24-bits / 2^24 < (|x| - lower) / (upper - lower).

    Float ops as in f32_to_code: n = |x| rounded to the grid (nearest), lower = n or the grid point
    below it, the step g = magic * 2^-23 is a power of two, so r = |x| - lower and uniform * g are
    exact and up iff uniform * g < r.
    """
    bits = x.to(tl.int32, bitcast=True)
    value = tl.minimum(bits & 0x7FFFFFFF, 0x40C00000).to(tl.float32, bitcast=True)  # |x| clamped to 6
    exponent = (value * 2.0**-104).to(tl.int32, bitcast=True) & 0x7F800000
    magic = tl.maximum(exponent, 23 << 23).to(tl.float32, bitcast=True)  # 2^(max(exponent, 0) + 22 - 126)
    nearest = tl.fma(value, 2.0**-126, magic) - magic  # the nearest grid value * 2^-126: the code at bit 22
    below = value - nearest * 2.0**126  # exact: |below| <= half a step
    step = magic * 2.0**103
    remainder = tl.where(below < 0, below + step, below)
    code = (nearest.to(tl.int32, bitcast=True) >> 22) - (below < 0).to(tl.int32)
    uniform_step = (random_bits >> 8).to(tl.float32) * (step * 2.0**-24)
    code = code + (uniform_step < remainder).to(tl.int32)
    code = code | ((bits >> 28) & 8)
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
    """MXFP8 biased block exponent from |amax| bits: round up of amax * fp32(1/fmax) (0 for a ratio at
    most 2^-127, as TransformerEngine), or OCP floor."""
    if ROUND_UP:
        ratio = (amax_bits.to(tl.float32, bitcast=True) * INV_FMAX).to(tl.int32, bitcast=True)
        exponent = ((ratio >> 23) & 0xFF) + ((ratio & 0x7FFFFF) != 0).to(tl.int32)
        exponent = tl.where(ratio <= 0x00400000, 0, exponent)
    else:
        exponent = tl.minimum(tl.maximum(((amax_bits >> 23) & 0xFF) - MAX_EXPONENT, 0), 254)
    exponent = tl.where(amax_bits == 0x7F800000, 0xFE, exponent)
    return tl.where(amax_bits > 0x7F800000, 0xFF, exponent)


@triton.jit
def e8m0_encode_multiplier(exponent, ROUND_UP: tl.constexpr):
    """2^(127 - e) exactly in fp32 (2^-127 is subnormal); NaN for e = 0xFF; ROUND_UP: 1 for e = 0 (unscaled)."""
    bits = tl.where(exponent == 254, 0x00400000, (254 - exponent) << 23)
    if ROUND_UP:
        bits = tl.where(exponent == 0, 0x3F800000, bits)
    multiplier = bits.to(tl.float32, bitcast=True)
    return tl.where(exponent == 0xFF, _bits_f32(multiplier, _FP32_NAN_BITS), multiplier)


@triton.jit
def hash32(x):
    """lowbias32 on uint32 (wrapping multiplies), as fp8kernels.formats.hash32."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, _HASH_MULTIPLIER_1, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, _HASH_MULTIPLIER_2, tl.uint32)
    return x ^ (x >> 16)


# ----------------------------------------------------------------------------- runs
# A run is BLOCK consecutive elements of an operand row; "runs" is a tuple of BLOCK tensors holding
# element j of every run. Splitting a tile this way puts each run in one thread's registers (Triton
# must, to split), which Triton 3.x layouts otherwise do not guarantee: block maxima become register
# maxima, each block scale is computed once, and a transposed tile moves through shared memory with
# ldmatrix.trans. Joining the runs back into one tensor lets Triton re-layout them, so they stay apart.


@triton.jit
def split_runs(tile, LOG2_RUN: tl.constexpr):
    """[R, C] -> tuple of 2**LOG2_RUN tensors [R, C // 2**LOG2_RUN]: element j of every run along C.

    Each split halves the runs by their top index bit, so the pieces come out in index order.
    """
    R: tl.constexpr = tile.shape[0]
    C: tl.constexpr = tile.shape[1]
    RUN: tl.constexpr = 1 << LOG2_RUN
    runs = (tl.reshape(tile, [R, C // RUN, RUN]),)
    for level in tl.static_range(LOG2_RUN):
        pieces = ()
        for p in tl.static_range(1 << level):
            low, high = tl.split(tl.permute(tl.reshape(runs[p], [R, C // RUN, 2, RUN >> (level + 1)]), [0, 1, 3, 2]))
            pieces = pieces + (low, high)
        runs = pieces
    out = ()
    for j in tl.static_range(RUN):
        out = out + (tl.reshape(runs[j], [R, C // RUN]),)
    return out


@triton.jit
def join_runs(runs):
    """Inverse of split_runs: a tuple of 2**n tensors [R, C'] -> [R, C' * 2**n]."""
    R: tl.constexpr = runs[0].shape[0]
    C: tl.constexpr = runs[0].shape[1]
    pieces = ()
    for j in tl.static_range(len(runs)):
        pieces = pieces + (tl.reshape(runs[j], [R, C, 1]),)
    for level in tl.static_range(len(runs).bit_length() - 1):  # concatenate neighbouring pieces
        joined = ()
        for p in tl.static_range(len(pieces) // 2):
            low = pieces[2 * p]
            high = pieces[2 * p + 1]
            pair = tl.permute(tl.join(low, high), [0, 1, 3, 2])
            joined = joined + (tl.reshape(pair, [R, C, 2 * low.shape[2]]),)
        pieces = joined
    return tl.reshape(pieces[0], [R, C * len(runs)])


@triton.jit
def runs_f32(runs):
    """Upcast each run, as to_f32 inline (the interpreter pays per jit call); split before upcasting,
    so that a transposed tile moves 2-byte bf16 through shared memory, not fp32."""
    values = ()
    for j in tl.static_range(len(runs)):
        run = runs[j]
        if run.dtype == tl.bfloat16:
            run = (run.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
        values = values + (run.to(tl.float32),)
    return values


@triton.jit
def _max_propagating_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def runs_amax_bits(values):
    """Block amax bits (NaN wins: some NaN's bits) over a tuple of fp32 runs: one register max per
    element, a float max whose |.| costs no instruction (an integer max of |bits| takes two)."""
    amax = tl.abs(values[0])
    for j in tl.static_range(1, len(values)):
        amax = _max_propagating_nan(amax, tl.abs(values[j]))
    return amax.to(tl.int32, bitcast=True)


@triton.jit
def row_amax_bits(values, FLOAT: tl.constexpr):
    """amax bits of each row of fp32 values [R, C] (NaN wins). FLOAT (compiled kernels): a float max
    reduction, as runs_amax_bits; the interpreter runs such a reduction one element at a time in
    Python, so there it is the integer max of |bits| (the same bits, but for which NaN)."""
    if FLOAT:
        return tl.reduce(tl.abs(values), 1, _max_propagating_nan).to(tl.int32, bitcast=True)
    return tl.max(abs_bits(values), axis=1)


@triton.jit
def hadamard_runs(runs):
    """The random Hadamard transform of 16-element tiles held as 16 tensors (element i of every tile),
    in the reference's order: signs, butterflies of stride 1, 2, 4, 8 ((a, b) -> (a + b, a - b)), * 1/4."""
    x = ()
    for i in tl.static_range(16):
        if (_HADAMARD_SIGN_BITS >> i) & 1:
            x = x + (-runs[i],)
        else:
            x = x + (runs[i],)
    for stage in tl.static_range(4):  # stride 1 << stage
        y = ()
        for i in tl.static_range(16):
            if (i >> stage) & 1:
                y = y + (x[i - (1 << stage)] - x[i],)
            else:
                y = y + (x[i] + x[i + (1 << stage)],)
        x = y
    out = ()
    for i in tl.static_range(16):
        out = out + (x[i] * 0.25,)
    return out
