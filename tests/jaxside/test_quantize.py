"""jaxside quantization alone (no torch) against independent models: ml_dtypes casts, float64 numpy math.

All 256 codes of each 8-bit format both ways, e2m1 and packing, the hash, the Hadamard transform,
the exact-fp32 helpers against numpy's IEEE arithmetic (subnormals included), dequantize(quantize(x))
error bounds per scheme, scales, and 50 steps of delayed scaling against a float64 model.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxside import _fp32
from jaxside import formats as F
from twinspec import formats as spec
from jaxside import quantize as Q
from tests.transformer_engine_models import transformer_engine_e8m0

ML_DTYPES = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e8m0": ml_dtypes.float8_e8m0fnu}
SHAPE = (64, 160)  # the bridge test's shape: one compile serves both files in one session


def _same_floats(got, expected) -> np.ndarray:
    """Elementwise: identical bits, or both NaN."""
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    return (got.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(got) & np.isnan(expected))


def _clip_cast_model(values: np.ndarray, fmt: str) -> np.ndarray:
    """ml_dtypes' cast after clipping to +-max; NaN (and, but in e2m1, +-inf) -> the canonical code (the
    contract's rule: a cast never hides a non-finite value)."""
    fmax = spec.FORMATS[fmt].max
    dtype = ML_DTYPES.get(fmt, ml_dtypes.float4_e2m1fn)
    with np.errstate(invalid="ignore"):
        codes = np.clip(values, -fmax, fmax).astype(dtype).view(np.uint8)
    non_finite = np.isnan(values) | (np.isinf(values) & (fmt != "e2m1"))
    return np.where(non_finite, spec.FORMATS[fmt].nan_code, codes).astype(np.uint8)


def _edge_values(fmt: str) -> np.ndarray:
    """fp32 edge cases from the format's own grid: codes, midpoints (ties), +-1 ulp, beyond max, subnormals."""
    dtype = ML_DTYPES.get(fmt, ml_dtypes.float4_e2m1fn)
    codes = np.arange(256 if fmt != "e2m1" else 16, dtype=np.uint8)
    grid = np.unique(np.abs(codes.view(dtype).astype(np.float64)))
    grid = grid[np.isfinite(grid)]
    midpoints = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    fmax = np.float32(grid[-1])
    magnitudes = np.concatenate(
        [
            grid.astype(np.float32),
            midpoints,
            np.nextafter(midpoints, np.float32(np.inf)),
            np.nextafter(midpoints, np.float32(0)),
            [
                np.nextafter(fmax, np.float32(np.inf)),
                fmax * 1.5,
                3e38,
                np.inf,
                grid[1] / 2,
                grid[1] / 4,
                1e-40,
                1e-45,
                0.0,
            ],
        ]
    ).astype(np.float32)
    return np.concatenate([magnitudes, -magnitudes, np.array([np.nan], np.float32)])


# ----------------------------------------------------------------------------- 8-bit formats, both ways


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e8m0"])
def test_all_256_codes_decode_like_ml_dtypes(fmt):
    codes = np.arange(256, dtype=np.uint8)
    expected = codes.view(ML_DTYPES[fmt]).astype(np.float32)
    assert _same_floats(F.decode_fp8(codes, fmt), expected).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_all_256_codes_and_edges_encode_like_ml_dtypes_after_the_clip(fmt):
    decoded = np.arange(256, dtype=np.uint8).view(ML_DTYPES[fmt]).astype(np.float32)
    every_bf16 = np.arange(2**16, dtype=np.uint16).view(ml_dtypes.bfloat16).astype(np.float32)
    values = np.concatenate([decoded, _edge_values(fmt), every_bf16])
    got = np.asarray(jax.jit(partial(F.encode_fp8, fmt=fmt))(values))
    np.testing.assert_array_equal(got, _clip_cast_model(values, fmt))
    # Each finite code comes back as itself; NaN codes and e5m2's inf codes as the canonical NaN byte.
    finite = np.isfinite(decoded)
    np.testing.assert_array_equal(got[:256][finite], np.arange(256)[finite])
    assert set(got[:256][~finite]) == {0x7F}


def _e8m0_model(amax: np.ndarray, fmt: str, rounding: str) -> np.ndarray:
    """float64 log2 model: up = ceil(log2(fp32(amax * fp32(1 / fmax)))), 0 for a ratio <= 2^-127 (TransformerEngine's
    float_to_e8m0), floor = floor(log2(amax)) - emax."""
    f = spec.FORMATS[fmt]
    codes = []
    for a in amax.astype(np.float32):
        if np.isnan(a):
            codes.append(0xFF)
        elif np.isinf(a):
            codes.append(0xFE)
        elif a == 0 and not a.view(np.uint32):
            codes.append(0)
        elif rounding == "up":
            ratio = a * np.float32(1.0 / f.max)  # numpy keeps subnormals: the IEEE product
            codes.append(0 if ratio <= 2.0**-127 else max(1, math.ceil(math.log2(ratio)) + 127))
        else:
            codes.append(min(max(math.floor(math.log2(a)) - f.max_exponent + 127, 0), 254))
    return np.array(codes, np.uint8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_e8m0_scales_both_roundings_match_the_log2_model(fmt):
    powers = np.float32(2.0) ** np.arange(-149, 128, dtype=np.float64).astype(np.float32)
    grid = np.abs(_edge_values(fmt))
    amax = np.concatenate(
        [powers, np.nextafter(powers, np.float32(np.inf)), grid, grid * np.float32(2.0**-120), [np.nan]]
    )
    for rounding in ("up", "floor"):
        got = np.asarray(jax.jit(partial(F.e8m0_from_amax, fmt=fmt, rounding=rounding))(amax))
        np.testing.assert_array_equal(got, _e8m0_model(amax, fmt, rounding), err_msg=rounding)


@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_e8m0_multiplier_is_the_exact_power_of_two(rounding):
    exponent = np.arange(256, dtype=np.uint8)
    got = np.asarray(F.e8m0_encode_multiplier(exponent, rounding))
    expected = np.array([2.0 ** (127 - e) if e < 255 else np.nan for e in range(256)], np.float64).astype(np.float32)
    expected[0] = 1.0 if rounding == "up" else expected[0]  # "up" leaves code-0 blocks unscaled, as TE does
    assert _same_floats(got, expected).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_up_gives_a_tiny_block_code_0_and_leaves_it_unscaled(fmt):
    """Issue 29, finding 10: a block whose amax / fmax is at most 2^-127 gets E8M0 code 0 (not 1) and its
    elements are cast unscaled, so they are +-0, as TransformerEngine's MXFP8 cast writes them."""
    fmax = spec.FORMATS[fmt].max
    boundary = np.float32(fmax * 2.0**-127)  # amax * fp32(1/fmax) lands near 2^-127 around here
    amaxes = [1e-45, 1e-40, 2.0**-126, boundary * np.float32(0.5), boundary, boundary * np.float32(1.01), 2.0**-110]
    x = np.zeros((len(amaxes), 32), np.float32)
    for row, amax in enumerate(amaxes):
        x[row] = np.float32(amax) * np.linspace(-1, 1, 32, dtype=np.float32)
        x[row, 7] = np.float32(amax)
    q = Q.quantize_mxfp8(x, fmt)
    expected = [transformer_engine_e8m0(float(np.float32(a)), fmax) for a in amaxes]
    np.testing.assert_array_equal(np.asarray(q.scale_inv)[:, 0], expected)
    assert expected[:4] == [0, 0, 0, 0] and expected[-1] > 1  # the test spans both sides of the rule
    zero_rows = np.asarray(expected) == 0
    np.testing.assert_array_equal(np.asarray(q.data)[zero_rows] & 0x7F, 0)  # +-0: signs kept
    np.testing.assert_array_equal(np.asarray(q.data)[zero_rows] >> 7, np.signbit(x[zero_rows]))


# ----------------------------------------------------------------------------- e2m1, packing


def test_e2m1_codes_both_ways_like_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(
        np.asarray(F.decode_e2m1(codes)), codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    )
    values = np.concatenate([np.asarray(F.decode_e2m1(codes)), _edge_values("e2m1")])
    np.testing.assert_array_equal(np.asarray(jax.jit(F.encode_e2m1)(values)), _clip_cast_model(values, "e2m1"))


def test_pack_fp4_puts_element_2i_in_the_low_nibble():
    np.testing.assert_array_equal(np.asarray(F.pack_fp4(np.array([[1, 2, 3, 4]], np.uint8))), [[0x21, 0x43]])
    codes = np.random.default_rng(0).integers(0, 16, (5, 12)).astype(np.uint8)
    np.testing.assert_array_equal(np.asarray(F.unpack_fp4(F.pack_fp4(codes))), codes)
    with pytest.raises(ValueError, match="even last dim"):
        F.pack_fp4(np.zeros((2, 3), np.uint8))


def _lowbias32(value: int) -> int:
    """lowbias32 on Python ints (the published constants), the independent model of hash32."""
    value &= 0xFFFFFFFF
    value ^= value >> 16
    value = (value * 0x7FEB352D) & 0xFFFFFFFF
    value ^= value >> 15
    value = (value * 0x846CA68B) & 0xFFFFFFFF
    return value ^ (value >> 16)


def test_stochastic_bits_are_lowbias32_of_index_xor_hashed_seed():
    index = np.array([0, 1, 2, 1000, 2**31 - 1, 2**31, 2**32 - 1], np.uint32)
    for seed in (0, 7, -3, 2**40 + 7):
        key = _lowbias32(seed)
        expected = np.array([_lowbias32(int(i) ^ key) for i in index], np.uint32)
        np.testing.assert_array_equal(np.asarray(F.stochastic_rounding_bits(seed, index)), expected)


def test_stochastic_e2m1_follows_the_rule_and_is_unbiased():
    rng = np.random.default_rng(1)
    values = np.concatenate([rng.uniform(-7, 7, 4000), [0.3, -0.3, 1e-40, -1e-40, 6.0, 0.0]]).astype(np.float32)
    bits = np.array(F.stochastic_rounding_bits(11, np.arange(values.size, dtype=np.uint32)))
    bits[-6:] = 0  # a zero draw rounds every value above its lower neighbour up, subnormals included
    got = np.asarray(jax.jit(F.encode_e2m1)(values, bits))
    grid = np.array(spec.E2M1_MAGNITUDES)
    a = np.minimum(np.abs(values.astype(np.float64)), 6.0)
    lower = np.searchsorted(grid, a, side="right") - 1
    upper = np.minimum(lower + 1, 7)
    fraction = np.divide(a - grid[lower], grid[upper] - grid[lower], out=np.zeros_like(a), where=upper > lower)
    code = lower + ((bits >> 8) * 2.0**-24 < fraction)
    np.testing.assert_array_equal(got, code | (np.signbit(values) << 3))
    # Over many draws the mean is the value itself (unbiased): 1.3 is 1.0 + 0.6 * 0.5.
    draws = np.asarray(F.stochastic_rounding_bits(5, np.arange(20000, dtype=np.uint32)))
    rounded = np.asarray(F.decode_e2m1(jax.jit(F.encode_e2m1)(np.full(20000, 1.3, np.float32), draws)))
    assert abs(rounded.mean() - 1.3) < 4 * 0.5 * math.sqrt(0.6 * 0.4 / 20000)


# ----------------------------------------------------------------------------- Hadamard


def _hadamard_model(tiles: np.ndarray) -> np.ndarray:
    """float64 (1/4) H16 diag(signs), H16 the Sylvester matrix H[i, j] = (-1)^popcount(i & j)."""
    index = np.arange(16)
    h16 = (-1.0) ** np.array([[bin(i & j).count("1") for j in index] for i in index])
    return tiles.astype(np.float64) * np.asarray(F.hadamard_signs()) @ h16.T / 4


def _butterfly_in_numpy(tiles: np.ndarray) -> np.ndarray:
    """The contract's fixed fp32 order (signs, strides 1, 2, 4, 8, then * 0.25) in numpy's IEEE fp32."""
    tiles = tiles.astype(np.float32) * np.asarray(F.hadamard_signs())
    for stride in (1, 2, 4, 8):
        pairs = tiles.reshape(-1, 16 // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        tiles = np.stack((a + b, a - b), axis=2).reshape(-1, 16)
    return tiles * np.float32(0.25)


def test_hadamard_transform_is_the_orthonormal_rotation_in_a_fixed_fp32_order():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    rotate = jax.jit(F.random_hadamard_transform)
    y = np.asarray(rotate(x))
    model = _hadamard_model(x.reshape(-1, 16)).reshape(x.shape)
    assert np.abs(y - model).max() <= 8 * 2.0**-24 * np.abs(x).max() * 4
    back = np.asarray(jax.jit(partial(F.random_hadamard_transform, inverse=True))(y))
    assert np.abs(back - x).max() <= 32 * 2.0**-24 * np.abs(x).max()
    # Bit for bit with numpy's IEEE fp32 in the same order, on normal, tiny and subnormal tiles.
    subnormal = rng.integers(0, 1 << 23, (8, 64), dtype=np.uint32) | (
        rng.integers(0, 2, (8, 64), dtype=np.uint32) << 31
    )
    mixed = np.concatenate([x, x * np.float32(2.0**-115), subnormal.view(np.float32)])
    assert _same_floats(
        jax.jit(F.random_hadamard_transform)(mixed), _butterfly_in_numpy(mixed.reshape(-1, 16)).reshape(mixed.shape)
    ).all()


# ----------------------------------------------------------------------------- exact fp32 helpers vs numpy


def _random_floats(rng, n: int, low_field: int, high_field: int) -> np.ndarray:
    field = rng.integers(low_field, high_field, n).astype(np.uint32)
    fraction = np.where(rng.random(n) < 0.1, 0, rng.integers(0, 1 << 23, n)).astype(np.uint32)
    sign = rng.integers(0, 2, n).astype(np.uint32) << 31
    return ((field << 23) | fraction | sign).view(np.float32)


def test_fp32_helpers_give_numpys_ieee_results_with_subnormals():
    rng = np.random.default_rng(3)
    n = 50000
    specials = rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 2.0**-126, 3e38], np.float32), n)
    small, big, anything = (
        _random_floats(rng, n, 0, 40),
        _random_floats(rng, n, 100, 255),
        _random_floats(rng, n, 0, 256),
    )
    normal_divisor = _random_floats(rng, n, 1, 255)
    cases = {  # numpy's fp32 operations are the IEEE reference (it keeps subnormals)
        "multiply small*big": (_fp32.multiply, small, big, np.multiply),
        "multiply any*any": (_fp32.multiply, anything, anything[::-1], np.multiply),
        "multiply specials": (_fp32.multiply, specials, anything, np.multiply),
        "divide small/normal": (_fp32.divide, small, normal_divisor, np.divide),
        "divide any/normal": (_fp32.divide, anything, normal_divisor, np.divide),
        "divide by a scalar": (_fp32.divide, small, np.float32(6.0), np.divide),
        "add small+small": (_fp32.add, small, small[::-1], np.add),
        "add any+specials": (_fp32.add, anything, specials, np.add),
        "quarter": (_fp32.scale_down_by_power_of_two, anything, 2, lambda v, k: v * np.float32(0.25)),
    }
    failures = []
    for name, (function, a, b, numpy_op) in cases.items():
        got = np.asarray(jax.jit(function, static_argnums=(1,) if name == "quarter" else ())(a, b))
        with np.errstate(all="ignore"):
            same = _same_floats(got, numpy_op(a, b))
        if not same.all():
            b_shown = b if np.ndim(b) == 0 else b[~same][:3]
            failures.append(
                f"{name}: {int((~same).sum())} differ, e.g. {a[~same][:3]} and {b_shown} -> {got[~same][:3]}"
            )
    assert not failures, "\n".join(failures)
    assert _same_floats(
        _fp32.max_magnitude(small.reshape(100, -1), axis=1), np.abs(small.reshape(100, -1)).max(axis=1)
    ).all()


# ----------------------------------------------------------------------------- quantizers: error bounds and scales


def _random(shape, dtype=np.float32, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 7, shape)).astype(np.float32).astype(dtype)


def _half_ulp(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """Half the grid spacing of `fmt` at |scaled| (the subnormal spacing below the normals)."""
    f = spec.FORMATS[fmt]
    binade = np.floor(np.log2(np.maximum(scaled, 2.0 ** (1 - f.bias))))
    return 0.5 * 2.0 ** (binade - f.mantissa_bits)


def _encode_factors(q: Q.Quantized, columnwise: bool, operand_shape) -> np.ndarray:
    """Per element of the operand: the factor that took it onto the element grid (float64)."""
    scale_inv = np.asarray(q.columnwise_scale_inv if columnwise else q.scale_inv)
    block = spec.SCHEME_BLOCKS[q.scheme]
    if q.scheme == "mxfp8":
        per_block = 2.0 ** (127.0 - scale_inv.astype(np.float64))
    elif q.fmt == "e2m1":
        global_amax = float(np.asarray(q.columnwise_amax if columnwise else q.amax)[0])
        per_block = (448.0 * 6 / global_amax) / scale_inv.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        per_block = 1.0 / scale_inv.astype(np.float64)
    if block is None:
        return np.full(operand_shape, per_block.item())
    return np.repeat(np.repeat(per_block, block[0], 0), block[1], 1)[: operand_shape[0], : operand_shape[1]]


QUANTIZERS = {  # the same static arguments as tests/bridge/test_quantize_cross.py's configurations
    "tensorwise_e4m3": lambda x: Q.quantize_tensorwise(x, "e4m3", columnwise=True),
    "tensorwise_e5m2_pow2": lambda x: Q.quantize_tensorwise(
        x, "e5m2", power_2_scale=True, amax_epsilon=1e-3, columnwise=True
    ),
    "block1x128": lambda x: Q.quantize_blockwise(x, "e4m3", (1, 128), columnwise=True),
    "block128x128_fp32scale": lambda x: Q.quantize_blockwise(
        x, "e4m3", (128, 128), power_2_scale=False, columnwise=True
    ),
    "mxfp8_up": lambda x: Q.quantize_mxfp8(x, "e4m3", scale_rounding="up", columnwise=True),
    "mxfp8_floor_e5m2": lambda x: Q.quantize_mxfp8(x, "e5m2", scale_rounding="floor", columnwise=True),
    "nvfp4_1x16": lambda x: Q.quantize_nvfp4(x, columnwise=True),
    "nvfp4_16x16": lambda x: Q.quantize_nvfp4(x, block=(16, 16), columnwise=True),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_dequantize_stays_within_half_an_ulp(name):
    for dtype in (np.float32, ml_dtypes.bfloat16):
        x = _random(SHAPE, dtype)
        q = QUANTIZERS[name](x)
        x64 = x.astype(np.float64)
        for columnwise in (False, True):
            operand = x64.T if columnwise else x64
            dequantized = np.asarray(Q.dequantize(q, columnwise=columnwise)).astype(np.float64)
            encode = _encode_factors(q, columnwise, operand.shape)
            fmax = spec.FORMATS[q.fmt].max
            scaled = np.abs(operand) * encode
            bound = (_half_ulp(np.minimum(scaled, fmax), q.fmt) + np.maximum(scaled - fmax, 0)) / encode
            bound = bound * (1 + 2.0**-18) + np.abs(operand) * 2.0**-20  # fp32 rounding of the scales
            error = np.abs((dequantized.T if columnwise else dequantized) - operand)
            worst = np.unravel_index(np.argmax(error - bound), error.shape)
            assert np.all(error <= bound), f"{dtype.__name__} columnwise={columnwise} at {worst}: x={operand[worst]}"


def test_stochastic_and_hadamard_nvfp4_stay_within_bounds():
    x = _random(SHAPE)
    q = Q.quantize_nvfp4(x, hadamard=True, stochastic_seed=99, columnwise=True)
    encode = _encode_factors(q, False, x.shape)
    error = np.abs(np.asarray(Q.dequantize(q)) - x)
    assert np.all(error <= 2 * _half_ulp(np.minimum(np.abs(x) * encode, 6.0), "e2m1") / encode * (1 + 2.0**-18) + 1e-30)
    # The columnwise copy is RHT(x.T): its error, rotated, stays within one ulp per 16-element tile.
    rotated = _hadamard_model(x.T.reshape(-1, 16)).reshape(x.T.shape)
    assert float(np.asarray(q.columnwise_amax)[0]) == pytest.approx(np.abs(rotated).max(), rel=1e-6)
    stored = _hadamard_model(np.asarray(Q.dequantize(q, columnwise=True)).T.reshape(-1, 16)).reshape(x.T.shape)
    column_encode = _encode_factors(q, True, rotated.shape)
    bound = 2 * _half_ulp(np.minimum(np.abs(rotated) * column_encode, 6.0), "e2m1") / column_encode
    assert np.all(
        np.linalg.norm((stored - rotated).reshape(-1, 16), axis=1)
        <= np.linalg.norm(bound.reshape(-1, 16), axis=1) * 1.001 + 1e-5
    )


def test_scales_match_float64_models():
    x = _random(SHAPE, ml_dtypes.bfloat16).astype(np.float32)
    x[5, 128:] = 0  # an all-zero 1x128 block: scale 1
    amax = np.abs(x).max()
    q = Q.quantize_tensorwise(x, "e4m3")
    assert float(np.asarray(q.amax)[0]) == amax
    assert np.asarray(q.scale_inv)[0] == np.float32(1.0 / float(np.float32(448.0 / amax)))
    blocks = np.asarray(Q.quantize_blockwise(x, "e4m3", (1, 128), columnwise=True).scale_inv)
    block_amax = np.abs(np.pad(x, ((0, 0), (0, 96)))).reshape(64, 2, 128).max(axis=2)
    expected = np.where(block_amax > 0, 2.0 ** -np.floor(np.log2(448.0 / np.where(block_amax > 0, block_amax, 1))), 1.0)
    np.testing.assert_array_equal(blocks, expected)
    nvfp4 = Q.quantize_nvfp4(x, columnwise=True)
    global_encode = np.float32(448.0 * 6) / np.float32(amax)
    block_scale = (np.abs(x).reshape(64, 10, 16).max(axis=2) / np.float32(6) * global_encode).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(nvfp4.scale_inv), _clip_cast_model(block_scale, "e4m3"))


def test_delayed_scaling_over_50_steps_matches_a_float64_model():
    rng = np.random.default_rng(4)
    amaxes = (rng.uniform(0.1, 10, (50, 3)) * 2.0 ** rng.integers(-30, 30, (50, 3))).astype(np.float32)
    amaxes[9] = [0.0, np.inf, np.nan]
    amaxes[20] = [1e-40, 3e38, 2.0**-126]
    amaxes[21] = [np.nan, 0.0, -np.inf]
    for algo, margin, length in (("max", 0, 16), ("most_recent", 3, 4)):
        history, scale = jnp.zeros((length, 3)), jnp.ones(3)
        model_history, model_scale = np.zeros((length, 3)), np.ones(3, np.float32)
        for step, amax in enumerate(amaxes):
            history = history.at[0].set(amax)
            refused = ~np.isfinite(amax)  # a non-finite step amax is recorded as 0 and keeps the scale
            model_history[0] = np.where(refused, 0.0, amax)
            history, scale = Q.delayed_scaling_update(history, scale, 448.0, margin=margin, algo=algo)
            current = model_history.max(axis=0) if algo == "max" else model_history[0]
            with np.errstate(all="ignore"):
                candidate = (448.0 / current / 2.0**margin).astype(np.float32)
            candidate = np.where(np.isinf(candidate), np.finfo(np.float32).max, candidate)
            model_scale = np.where((current > 0) & np.isfinite(current) & ~refused, candidate, model_scale)
            model_history = np.roll(model_history, -1, axis=0)
            model_history[0] = 0
            np.testing.assert_array_equal(np.asarray(scale), model_scale, f"{algo} step {step}")
            np.testing.assert_array_equal(np.asarray(history), model_history.astype(np.float32), f"{algo} step {step}")


# ----------------------------------------------------------------------------- API: jit, pytree, numpy, errors


def test_quantizers_run_under_jit_with_static_arguments_and_traced_seeds():
    x = _random(SHAPE)
    jitted = jax.jit(Q.quantize_tensorwise, static_argnames=("fmt", "rowwise", "columnwise"))
    inside, outside = (
        jitted(x, "e5m2", jnp.full(1, 0.5), columnwise=True),
        Q.quantize_tensorwise(x, "e5m2", np.full(1, 0.5, np.float32), columnwise=True),
    )
    for name in Q.BUFFERS:
        assert (getattr(inside, name) is None) == (getattr(outside, name) is None), name
        if getattr(inside, name) is not None:
            np.testing.assert_array_equal(
                np.asarray(getattr(inside, name)), np.asarray(getattr(outside, name)), err_msg=name
            )
    # A seed may be a (traced) jax integer: the same bytes as the Python int.
    by_int = Q.quantize_nvfp4(x, hadamard=True, stochastic_seed=2**32 + 5, columnwise=True)
    by_array = Q.quantize_nvfp4(x, hadamard=True, stochastic_seed=jnp.uint32(5), columnwise=True)
    np.testing.assert_array_equal(np.asarray(by_array.data), np.asarray(by_int.data))
    leaves, treedef = jax.tree_util.tree_flatten(by_int)
    assert len(leaves) == 6 and jax.tree_util.tree_unflatten(treedef, leaves).scheme == "nvfp4_1x16"


def test_quantize_numpy_returns_the_buffers_by_name():
    x = _random(SHAPE, ml_dtypes.bfloat16)
    buffers = Q.quantize_numpy(x, "quantize_mxfp8", fmt="e4m3", scale_rounding="up", columnwise=True)
    assert {name: (array.shape, array.dtype) for name, array in buffers.items()} == {
        "data": ((64, 160), np.uint8),
        "scale_inv": ((64, 5), np.uint8),
        "columnwise_data": ((160, 64), np.uint8),
        "columnwise_scale_inv": ((160, 2), np.uint8),
    }
    with pytest.raises(ValueError, match="not a quantizer"):
        Q.quantize_numpy(x, "quantize_everything")


def test_empty_and_high_rank_inputs():
    q = Q.quantize_tensorwise(np.zeros((0, 16), np.float32), columnwise=True)
    assert q.data.shape == (0, 16) and q.columnwise_data.shape == (16, 0) and float(q.scale_inv[0]) == 1.0
    x = _random((2, 32, 160))
    assert Q.dequantize(Q.quantize_tensorwise(x, "e4m3", columnwise=True)).shape == (2, 32, 160)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: Q.quantize_mxfp8(x[:, :48]), ValueError, "multiple of 32"),
        (lambda x: Q.quantize_mxfp8(x[:40], columnwise=True, rowwise=False), ValueError, r"row count \(M"),
        (lambda x: Q.quantize_nvfp4(x[:, :24]), ValueError, "multiple of 16"),
        (lambda x: Q.quantize_blockwise(x, block=(1, 64)), ValueError, "block=.1, 64."),
        (lambda x: Q.quantize_tensorwise(x, "e2m1"), ValueError, "fmt='e2m1'"),
        (lambda x: Q.quantize_tensorwise(x, rowwise=False), ValueError, "ask for at least one"),
        (lambda x: Q.quantize_mxfp8(x, scale_rounding="down"), ValueError, "scale_rounding='down'"),
        (lambda x: Q.quantize_tensorwise(x.astype(np.int32)), TypeError, "int32"),
        (lambda x: Q.quantize_tensorwise(x[0, 0]), ValueError, "0-d"),
        (lambda x: Q.quantize_tensorwise(jnp.asarray(x)[0, 0]), ValueError, "0-d"),
        (lambda x: Q.quantize_tensorwise(x.tolist()), TypeError, "got list"),
        (lambda x: Q.quantize_nvfp4(x, stochastic_seed=1.5), TypeError, "stochastic_seed"),
        (lambda x: Q.quantize_tensorwise(x, "e4m3", np.array([1.0, 2.0], np.float32)), TypeError, "one element"),
        (
            lambda x: Q.quantize_tensorwise(x, "e4m3", np.ones(1, np.float32), power_2_scale=True),
            ValueError,
            "given scale",
        ),
        (lambda x: Q.dequantize(Q.quantize_tensorwise(x), columnwise=True), ValueError, "no columnwise copy"),
        (lambda x: Q.delayed_scaling_update(np.zeros((4, 1)), np.ones(1), 448.0, algo="mean"), ValueError, "'mean'"),
    ],
)
def test_bad_arguments_say_what_to_do(call, error, match):
    with pytest.raises(error, match=match):
        call(_random((64, 64)))
