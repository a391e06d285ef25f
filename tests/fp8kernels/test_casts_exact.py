"""The Triton bit-operation helpers (fp8kernels._casts) byte-for-byte against fp8kernels.formats.

Each helper runs elementwise over a format's edge set (generated from the spec) in one small
kernel, in the interpreter on CPU and compiled on CUDA (`-m gpu`).
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from fp8kernels import _casts, formats
from tests.fp8kernels.format_models import edge_values
from tests.fp8kernels.devices import DEVICES

BLOCK = 1024


@triton.jit
def _elementwise_kernel(
    x_ptr, bits_ptr, out_ptr, n, OP: tl.constexpr, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr,
    MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr, BLOCK: tl.constexpr,
):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if OP == "encode":
        out = _casts.f32_to_code(x, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
    elif OP == "encode_in_range":  # the fast path the kernels take once a tile is known to be in range
        out = _casts.f32_to_code(x, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, True)
    elif OP == "e2m1_doubled":  # the NVFP4 kernels' in-range e2m1 cast, fed twice the value
        out = _casts.e2m1_top_code_doubled(x * 2.0)
    elif OP == "encode_hardware":  # the GPU's cvt, which compiled kernels use on in-range fp8 tiles
        out = _casts.f32_to_code(x, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, True, False, True)
    elif OP == "e2m1_stochastic":
        random_bits = tl.load(bits_ptr + offsets, mask=mask, other=0).to(tl.uint32)
        out = _casts.f32_to_e2m1_code_stochastic(x, random_bits)
    elif OP == "bf16":
        out = _casts.f32_to_bf16_bits(x).to(tl.int32)
    elif OP == "hash":
        out = _casts.hash32(x.to(tl.int32, bitcast=True).to(tl.uint32)).to(tl.int32, bitcast=True)
    elif OP == "e8m0_up":
        out = _casts.e8m0_from_amax_bits(_casts.abs_bits(x), 1.0 / 448.0, 8, True)
    elif OP == "e8m0_floor":
        out = _casts.e8m0_from_amax_bits(_casts.abs_bits(x), 1.0 / 448.0, 8, False)
    elif OP == "e8m0_multiplier_up":  # x holds e8m0 codes as fp32 integers
        out = _casts.e8m0_encode_multiplier(x.to(tl.int32), True).to(tl.int32, bitcast=True)
    elif OP == "e8m0_multiplier_floor":
        out = _casts.e8m0_encode_multiplier(x.to(tl.int32), False).to(tl.int32, bitcast=True)
    elif OP == "e4m3_scale":  # the NVFP4 block-scale cast
        out = _casts.f32_to_e4m3_code(x)
    elif OP == "e4m3_scale_hardware":  # the same with the GPU's cvt (compiled kernels)
        out = _casts.f32_to_e4m3_code(x, True)
    else:  # "decode": x holds e4m3 codes as fp32 integers
        out = _casts.e4m3_code_to_f32(x.to(tl.int32)).to(tl.int32, bitcast=True)
    tl.store(out_ptr + offsets, out, mask=mask)


def _run(op: str, x: torch.Tensor, fmt: str = "e4m3", random_bits: torch.Tensor | None = None) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    bits = random_bits if random_bits is not None else out
    grid = (triton.cdiv(x.numel(), BLOCK),)
    _elementwise_kernel[grid](x, bits, out, x.numel(), op, **_casts.format_constants(fmt), BLOCK=BLOCK)
    return out


def _first_difference(x: torch.Tensor, got: torch.Tensor, expected: torch.Tensor) -> str:
    i = int((got != expected).nonzero()[0, 0])
    count = int((got != expected).sum())
    return f"{count} differ; first at {i}: x={float(x[i])!r} triton={int(got[i]):#x} reference={int(expected[i]):#x}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_bit_cast_equals_reference_on_edge_values(device, fmt):
    generator = torch.Generator().manual_seed(0)
    x = torch.cat([edge_values(fmt), torch.randn(3000, generator=generator) * formats.FORMATS[fmt].max / 3])
    expected = formats.encode_e2m1(x) if fmt == "e2m1" else formats.encode_fp8(x, fmt)
    got = _run("encode", x.to(device), fmt).cpu()
    assert torch.equal(got, expected.int()), _first_difference(x, got, expected.int())


def _below_rounding_limit(fmt: str, seed: int) -> torch.Tensor:
    """The edge set and random values of `fmt` whose magnitude is below its rounding limit, the largest included."""
    generator = torch.Generator().manual_seed(seed)
    f = formats.FORMATS[fmt]
    limit = f.max + 2.0 ** (math.floor(math.log2(f.max)) - f.mantissa_bits - 1)
    x = torch.cat([edge_values(fmt), torch.randn(3000, generator=generator) * f.max / 3])
    x = x[x.abs() < limit]
    below_limit = torch.nextafter(torch.tensor(limit), torch.tensor(0.0))  # the largest fp32 below it
    return torch.cat([x, below_limit[None], -below_limit[None]])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_in_range_cast_equals_reference_below_the_rounding_limit(device, fmt):
    """The IN_RANGE fast path skips the clamp and the NaN test: below the rounding limit (the midpoint
    above max, itself excluded) it must give the full cast's bytes, ties and subnormals included."""
    x = _below_rounding_limit(fmt, 4)
    expected = formats.encode_e2m1(x) if fmt == "e2m1" else formats.encode_fp8(x, fmt)
    got = _run("encode_in_range", x.to(device), fmt).cpu()
    assert torch.equal(got, expected.int()), _first_difference(x, got, expected.int())


@pytest.mark.parametrize("device", DEVICES)
def test_doubled_e2m1_cast_equals_reference_below_the_rounding_limit(device):
    """e2m1_top_code_doubled: the full cast's code in the top nibble and nothing but junk in bits 6..8
    (which _packed_runs drops), on the edge set and on every bf16 value below the rounding limit."""
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    x = torch.cat([_below_rounding_limit("e2m1", 6), every_bf16[every_bf16.abs() < 7]])
    expected = formats.encode_e2m1(x).int()
    got = _run("e2m1_doubled", x.to(device), "e2m1").cpu()
    assert torch.equal((got >> 28) & 0xF, expected), _first_difference(x, (got >> 28) & 0xF, expected)
    stray = got & 0x0FFFFE3F
    assert not stray.any(), _first_difference(x, stray, torch.zeros_like(stray))


@pytest.mark.parametrize("device", [d for d in DEVICES if d.values[0] == "cuda"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_hardware_cast_equals_reference_below_the_rounding_limit(device, fmt):
    """Compiled kernels cast in-range fp8 tiles with the GPU's cvt.rn.satfinite: same bytes as the spec."""
    x = _below_rounding_limit(fmt, 5)
    expected = formats.encode_fp8(x, fmt).int()
    got = _run("encode_hardware", x.to(device), fmt).cpu()
    assert torch.equal(got, expected), _first_difference(x, got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_rounding_equals_torch(device):
    generator = torch.Generator().manual_seed(2)
    words = torch.randint(-(2**31), 2**31 - 1, (4000,), generator=generator, dtype=torch.int32)
    halfway = (torch.randint(0, 2**15, (1000,), generator=generator, dtype=torch.int32) << 16) | 0x8000  # ties
    specials = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, 3.4028234663852886e38, 1e-45])
    x = torch.cat([words.view(torch.float32), halfway.view(torch.float32), specials])
    expected = x.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF
    expected = torch.where(x.isnan(), 0x7FC0, expected)  # torch keeps some NaN payloads; we write one NaN
    got = _run("bf16", x.to(device)).cpu()
    assert torch.equal(got, expected), _first_difference(x, got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_e2m1_and_hash_equal_reference(device):
    generator = torch.Generator().manual_seed(1)
    x = torch.cat([edge_values("e2m1"), torch.randn(3000, generator=generator) * 3])
    random_bits = formats.stochastic_rounding_bits(42, torch.arange(x.numel()))
    expected = formats.encode_e2m1(x, random_bits).int()
    as_int32 = random_bits.to(torch.int64).where(random_bits < 2**31, random_bits - 2**32).int()  # same 32 bits
    got = _run("e2m1_stochastic", x.to(device), random_bits=as_int32.to(device)).cpu()
    assert torch.equal(got, expected), _first_difference(x, got, expected)
    words = torch.randint(-(2**31), 2**31 - 1, (2000,), generator=generator, dtype=torch.int32)
    got = _run("hash", words.view(torch.float32).to(device)).cpu().long() & 0xFFFFFFFF
    assert torch.equal(got, formats.hash32(words.long() & 0xFFFFFFFF))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_e8m0_equals_reference(device, rounding):
    powers = torch.exp2(torch.arange(-126, 128, dtype=torch.float32))
    special = torch.tensor([0.0, 1e-45, 1e-40, 3.4e38, math.inf, math.nan, 448.0])
    # amaxes whose ratio amax * fp32(1/448) lands on, just above and just below 2^-127 ("up" gives 0 up to it)
    boundary = torch.tensor(448.0 * 2.0**-127) * (1 + torch.arange(-4, 5) * 2.0**-23)
    x = torch.cat([powers, powers * (1 + 2**-23), powers * (1 - 2**-24), special, boundary])
    got = _run(f"e8m0_{rounding}", x.to(device)).cpu()
    assert torch.equal(got, formats.e8m0_from_amax(x, "e4m3", rounding).int())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rounding", ["up", "floor"])
def test_e8m0_multiplier_equals_reference(device, rounding):
    codes = torch.arange(256, dtype=torch.float32)
    got = _run(f"e8m0_multiplier_{rounding}", codes.to(device)).cpu()
    expected = formats.e8m0_encode_multiplier(codes.to(torch.uint8), rounding)
    assert torch.equal(got[:255], expected[:255].view(torch.int32)) and got[255].view(torch.float32).isnan()


def _check_block_scale_cast(device: str, op: str) -> None:
    generator = torch.Generator().manual_seed(7)
    x = torch.cat([edge_values("e4m3"), torch.rand(3000, generator=generator) * 500])
    expected = formats.encode_fp8(x, "e4m3").int()
    got = _run(op, x.to(device)).cpu()
    assert torch.equal(got, expected), _first_difference(x, got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_nvfp4_block_scale_cast_equals_reference(device):
    """The e4m3 cast of NVFP4 block scales: an infinite block amax gives the NaN code, as NaN does."""
    _check_block_scale_cast(device, "e4m3_scale")


@pytest.mark.parametrize("device", [d for d in DEVICES if d.values[0] == "cuda"])
def test_nvfp4_block_scale_hardware_cast_equals_reference(device):
    """Compiled NVFP4 kernels cast block scales with the GPU's cvt, which saturates inf: set apart."""
    _check_block_scale_cast(device, "e4m3_scale_hardware")


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_decode_equals_reference_for_all_codes(device):
    codes = torch.arange(256, dtype=torch.float32)
    got = _run("decode", codes.to(device)).cpu().view(torch.float32)
    expected = formats.decode_fp8(codes.to(torch.uint8), "e4m3")
    assert torch.equal(got.isnan(), expected.isnan())
    assert torch.equal(got[~got.isnan()], expected[~expected.isnan()])
