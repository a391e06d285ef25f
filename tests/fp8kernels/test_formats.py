"""fp8kernels.formats against float64 models built from the format specs (tests/fp8kernels/format_models.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8kernels import formats
from tests.fp8kernels.format_models import decode_model, edge_values, format_max, rne_model
from twinspec import formats as spec

FP8 = ["e4m3", "e5m2"]


@pytest.mark.parametrize("fmt", FP8 + ["e8m0"])
def test_all_256_codes_decode_as_the_bit_layout_says(fmt):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    decoded = formats.decode_fp8(codes, fmt).double().numpy()
    expected = np.array([decode_model(c, fmt) for c in range(256)])
    np.testing.assert_array_equal(decoded, expected)  # NaN positions must match too


@pytest.mark.parametrize("fmt", FP8)
def test_all_256_codes_encode_back_to_themselves(fmt):
    values = torch.tensor([decode_model(c, fmt) for c in range(256)], dtype=torch.float32)
    finite = values.isfinite()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert torch.equal(formats.encode_fp8(values[finite], fmt), codes[finite])
    # Every non-finite value (NaN, +-inf) becomes the one canonical NaN byte: a cast never hides it.
    non_finite = torch.cat([values[~finite], torch.tensor([math.inf, -math.inf, -math.nan])])
    assert set(formats.encode_fp8(non_finite, fmt).tolist()) == {spec.FORMATS[fmt].nan_code}


def test_all_16_e2m1_codes_both_ways():
    codes = torch.arange(16, dtype=torch.int32).to(torch.uint8)
    expected = torch.tensor([decode_model(c, "e2m1") for c in range(16)], dtype=torch.float32)
    assert torch.equal(formats.decode_e2m1(codes), expected)
    assert torch.equal(formats.encode_e2m1(expected), codes)  # -0.0 keeps its sign: code 8


@pytest.mark.parametrize("fmt", FP8)
def test_fp8_encode_matches_the_float64_rounding_model(fmt):
    values = edge_values(fmt)
    generator = torch.Generator().manual_seed(0)
    values = torch.cat([values, torch.randn(4000, generator=generator) * format_max(fmt) / 4])
    got = formats.encode_fp8(values, fmt).numpy()
    np.testing.assert_array_equal(got, rne_model(values.numpy(), fmt))


def test_e2m1_encode_matches_the_float64_rounding_model():
    values = edge_values("e2m1")
    got = formats.encode_e2m1(values).numpy()
    np.testing.assert_array_equal(got, rne_model(values.numpy(), "e2m1"))


def test_fp4_packing_puts_the_even_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0]], dtype=torch.uint8)
    packed = formats.pack_fp4(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F]]
    assert torch.equal(formats.unpack_fp4(packed), codes)
    with pytest.raises(ValueError, match="even last dim"):
        formats.pack_fp4(codes[:, :5])


# ----------------------------------------------------------------------------- scales


def _fp32(value: float) -> float:
    return float(np.float32(value))


def _scale_model(amax: float, fmax: float, power_2: bool, eps: float) -> float:
    amax = max(amax, _fp32(eps)) if not math.isnan(amax) else amax
    if amax == 0 or not math.isfinite(amax):
        return 1.0
    with np.errstate(over="ignore"):
        scale = float(np.float32(fmax / amax))  # f64 then f32: innocuous double rounding for a quotient
    scale = min(scale, float(np.finfo(np.float32).max))
    if power_2:
        scale = 2.0 ** math.floor(math.log2(scale))
    return scale


AMAXES = [0.0, 1e-45, 1e-40, 1e-38, 3e-3, 0.7, 1.0, 447.9, 448.0, 1e6, 3.4e38, math.inf, math.nan]


@pytest.mark.parametrize("power_2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_scale_from_amax_matches_float64_model(power_2, eps):
    amax = torch.tensor(AMAXES, dtype=torch.float32)
    got = formats.scale_from_amax(amax, 448.0, power_2_scale=power_2, amax_epsilon=eps)
    expected = [_scale_model(float(a), 448.0, power_2, eps) for a in amax]
    assert got.double().tolist() == expected


def _e8m0_model(amax: float, fmt: str, rounding: str) -> int:
    if math.isnan(amax):
        return 0xFF
    if math.isinf(amax):
        return 0xFE
    if amax == 0:
        return 0
    fmax = format_max(fmt)
    if rounding == "up":  # TransformerEngine's float_to_e8m0 of the fp32 ratio, in float64 terms
        ratio = float(np.float32(amax) * np.float32(1 / fmax))  # the fp32 product the contract names
        if ratio <= 2.0**-127:
            return 0
        mantissa, exponent = math.frexp(ratio)  # ratio = mantissa * 2^exponent, mantissa in [0.5, 1)
        ceil_log2 = exponent - 1 if mantissa == 0.5 else exponent
        return max(ceil_log2 + 127, 1)  # a ratio in (2^-127, 2^-126) rounds up to the smallest normal exponent
    floor_log2 = math.frexp(amax)[1] - 1
    return min(max(floor_log2 - math.floor(math.log2(fmax)) + 127, 0), 254)


@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_e8m0_matches_float64_log2_model(fmt, rounding):
    generator = torch.Generator().manual_seed(1)
    log_uniform = torch.exp2(torch.rand(2000, generator=generator) * 250 - 125)
    powers = torch.exp2(torch.arange(-126, 128, dtype=torch.float32))
    special = torch.tensor([0.0, 1e-45, 1e-40, 3.4e38, math.inf, math.nan, 448.0, 57344.0])
    amax = torch.cat([log_uniform, powers, powers * (1 + 2**-23), powers * (1 - 2**-24), special])
    got = formats.e8m0_from_amax(amax, fmt, rounding).tolist()
    assert got == [_e8m0_model(float(a), fmt, rounding) for a in amax]


@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_e8m0_multiplier_is_the_exact_inverse_power_of_two(rounding):
    exponents = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    got = formats.e8m0_encode_multiplier(exponents, rounding).double().tolist()
    assert got[1:255] == [2.0 ** (127 - e) for e in range(1, 255)]
    assert got[0] == (1.0 if rounding == "up" else 2.0**127)  # "up" leaves code-0 blocks unscaled, as TE does
    assert math.isnan(got[255])


# ----------------------------------------------------------------------------- randomness, Hadamard


def _lowbias32_model(x: int) -> int:
    mask = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & mask
    x ^= x >> 15
    x = (x * 0x846CA68B) & mask
    return x ^ (x >> 16)


def test_hash32_matches_python_integers():
    inputs = [0, 1, 2, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]
    got = formats.hash32(torch.tensor(inputs, dtype=torch.int64)).tolist()
    assert got == [_lowbias32_model(v) for v in inputs]
    bits = formats.stochastic_rounding_bits(7, torch.arange(3))
    assert bits.tolist() == [_lowbias32_model(i ^ _lowbias32_model(7)) for i in range(3)]


def test_stochastic_rounding_is_unbiased_and_reproducible():
    targets = torch.tensor([0.1, 0.3, 0.8, 1.2, 1.9, 2.7, 3.3, 5.1, -0.4, -4.5])
    repeats = 20000
    values = targets.repeat_interleave(repeats)
    index = torch.arange(values.numel())
    codes = formats.encode_e2m1(values, formats.stochastic_rounding_bits(1234, index))
    means = formats.decode_e2m1(codes).double().reshape(-1, repeats).mean(dim=1)
    # Per target the result is lower or upper with p = fraction: std of the mean <= step / 2 / sqrt(n).
    steps = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5, 1.0, 1.0, 2.0, 0.5, 2.0], dtype=torch.float64)
    assert torch.all((means - targets.double()).abs() < 5 * steps / 2 / repeats**0.5), means
    again = formats.encode_e2m1(values, formats.stochastic_rounding_bits(1234, index))
    other_seed = formats.encode_e2m1(values, formats.stochastic_rounding_bits(1235, index))
    assert torch.equal(codes, again)
    assert not torch.equal(codes, other_seed)
    # Values on the grid never move; NaN is still code 0.
    grid = formats.decode_e2m1(torch.arange(16, dtype=torch.int32).to(torch.uint8))
    assert torch.equal(formats.encode_e2m1(grid, formats.stochastic_rounding_bits(5, torch.arange(16))),
                       formats.encode_e2m1(grid))
    nan_code = formats.encode_e2m1(torch.tensor([math.nan]), formats.stochastic_rounding_bits(5, torch.arange(1)))
    assert nan_code.tolist() == [0]


def _hadamard16_float64() -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(4):  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def test_hadamard_matches_the_explicit_matrix_and_inverts():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(6, 48, generator=generator) * 10
    signs = torch.tensor([-1.0 if spec.HADAMARD_SIGN_BITS >> i & 1 else 1.0 for i in range(16)], dtype=torch.float64)
    matrix = 0.25 * _hadamard16_float64() @ torch.diag(signs)  # y = M v per 16-tile
    expected = (x.double().reshape(-1, 16) @ matrix.T).reshape(x.shape)
    got = formats.random_hadamard_transform(x)
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(formats.random_hadamard_transform(got, inverse=True), x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divisible by 16"):
        formats.random_hadamard_transform(x[:, :40])
