"""Number formats and the element-level pieces of quantization, in plain torch.

The building blocks of `fp8kernels.reference` (the spec): torch's dtype of each format, element
casts, fp32 and e8m0 block scales, FP4 packing, the stochastic-rounding hash and the random Hadamard
transform (the format table and the other constants are in twinspec.formats). `fp8kernels._casts`
holds the Triton twins; docs/quantization.md states the rules.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from twinspec.formats import E2M1_MAGNITUDES, E8M0_INF_CODE, E8M0_UP_ZERO_BITS, FORMATS, FP32_MAX, ONE_BITS
from twinspec.formats import HADAMARD_SIGN_BITS, HADAMARD_SIZE, HASH_MULTIPLIERS, HASH_SHIFTS, MASK32

# torch's dtype of each format it casts to (e2m1 has none: it is packed by hand)
TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e8m0": torch.float8_e8m0fnu}


def row_block_scales(rows: int, blocks: int, device: torch.device) -> Tensor:
    """An fp32 scale_inv buffer [rows, blocks] for 1x128 blocks, stored rows-contiguous (strides (1, rows)).

    cuBLASLt's 1x128 block scaling reads the scales of an operand [rows, K] M-major (N-major for B): a
    quantizer that writes them so spares the GEMM a relayout launch per operand (the wgrad pair at 8192^3
    on the H200: 958 TFLOP/s against 949 with the relayouts, benchmarks/RESULTS.md 2026-12-03).
    The values are the spec's; only the storage order differs from the reference's row-major one.
    """
    if blocks == 1:  # the same memory, with the strides torch's views want of a last dim
        return torch.empty(rows, 1, dtype=torch.float32, device=device)
    return torch.empty(blocks, rows, dtype=torch.float32, device=device).t()


# ----------------------------------------------------------------------------- element casts


def encode_fp8(values: Tensor, fmt: str) -> Tensor:
    """fp32 values -> uint8 codes of e4m3/e5m2: NaN and +-inf -> the canonical NaN, finite values saturate
    to +-max, round to nearest even."""
    f = FORMATS[fmt]
    codes = values.float().clamp(-f.max, f.max).to(TORCH_DTYPES[fmt]).view(torch.uint8)
    return torch.where(values.isfinite(), codes, f.nan_code)


def decode_fp8(codes: Tensor, fmt: str) -> Tensor:
    """uint8 codes of e4m3/e5m2/e8m0 -> fp32 values (NaN codes -> NaN)."""
    return codes.view(TORCH_DTYPES[fmt]).float()


def encode_e2m1(values: Tensor, random_bits: Tensor | None = None) -> Tensor:
    """fp32 values -> e2m1 codes (uint8, 0..15), nearest-even, or stochastic given 32-bit `random_bits`."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=values.device)
    a = values.float().abs().clamp(max=FORMATS["e2m1"].max)[..., None]  # NaN stays NaN
    if random_bits is None:
        # Count the midpoints below |v|; exactly on one, move up only from an odd code (ties to even).
        midpoints = (magnitudes[1:] + magnitudes[:-1]) / 2
        lower_code_is_odd = torch.arange(7, device=values.device) % 2 == 1
        code = ((a > midpoints) | ((a == midpoints) & lower_code_is_odd)).sum(-1)
    else:
        # Round up with probability (|v| - lower) / (upper - lower); the grid step is a power of 2,
        # so the fraction is exact, and uniform = top 24 random bits / 2^24 is exact in fp32.
        code = (a >= magnitudes[1:]).sum(-1)
        lower = magnitudes[code]
        upper = magnitudes[(code + 1).clamp(max=7)]
        fraction = torch.where(upper > lower, (a[..., 0] - lower) / (upper - lower), 0.0)
        uniform = (random_bits >> 8).float() * 2.0**-24
        code = code + (uniform < fraction).long()
    code = code | (torch.signbit(values).long() << 3)
    return torch.where(values.isnan(), 0, code).to(torch.uint8)


def decode_e2m1(codes: Tensor) -> Tensor:
    """e2m1 codes (0..15, one per element) -> fp32 values."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, device=codes.device)
    value = magnitudes[(codes & 0x7).long()]
    return torch.where((codes & 0x8) != 0, -value, value)


def pack_fp4(codes: Tensor) -> Tensor:
    """Two e2m1 codes per byte along the last dim: element 2i in the LOW nibble, 2i+1 in the HIGH."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {codes.shape[-1]}; pad it")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_fp4(packed: Tensor) -> Tensor:
    """Inverse of pack_fp4: uint8 [..., C // 2] -> codes [..., C]."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- scales


def scale_from_amax(amax: Tensor, fmax: float, *, power_2_scale: bool = False, amax_epsilon: float = 0.0) -> Tensor:
    """fp32 scale = fmax / max(amax, eps); 1 for amax 0/inf/NaN, fp32 max on overflow, optionally 2^floor."""
    amax = amax.float()
    amax = torch.where(amax < amax_epsilon, amax_epsilon, amax)  # NaN stays NaN
    scale = torch.full_like(amax, fmax) / amax  # IEEE division: correctly rounded
    scale = torch.where(scale.isinf(), FP32_MAX, scale)
    scale = torch.where((amax == 0) | ~amax.isfinite(), 1.0, scale)
    if power_2_scale:  # keep the exponent bits only (the scale is positive): rounds down
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)
    return scale


def e8m0_from_amax(amax: Tensor, fmt: str, rounding: str = "up") -> Tensor:
    """MXFP8 block scale as a biased exponent (uint8): 2^(e - 127) >= amax / fmax ("up") or OCP "floor"."""
    f = FORMATS[fmt]
    amax = amax.float()
    if rounding == "up":  # TransformerEngine's float_to_e8m0: a ratio <= 2^-127 (bits <= 0x400000) gives 0
        ratio = amax * torch.tensor(1.0 / f.max, dtype=torch.float32)
        bits = ratio.view(torch.int32)
        exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
        exponent = torch.where(bits <= E8M0_UP_ZERO_BITS, 0, exponent)
    elif rounding == "floor":  # floor(log2(amax)) - emax_elem, biased; subnormal amax -> 0
        exponent = (((amax.view(torch.int32) >> 23) & 0xFF) - f.max_exponent).clamp(0, 254)
    else:
        raise ValueError(f"scale_rounding={rounding!r}: use 'up' (TransformerEngine, JAX) or 'floor' (OCP MX)")
    exponent = torch.where(amax.isinf(), E8M0_INF_CODE, exponent)
    exponent = torch.where(amax.isnan(), FORMATS["e8m0"].nan_code, exponent)
    return exponent.to(torch.uint8)


def e8m0_encode_multiplier(exponent: Tensor, rounding: str = "up") -> Tensor:
    """The exact fp32 factor 2^(127 - e) that maps a block onto the element grid (NaN for code 0xFF).

    "up" leaves a block of code 0 unscaled (factor 1), as TransformerEngine does: its amax is at most
    2^-127 * fmax, so its elements cast to +-0 either way, without a 2^127 that could reach fmax.
    """
    e = exponent.to(torch.int32)
    bits = torch.where(e == 254, 0x00400000, (254 - e) << 23)  # 2^-127 is an fp32 subnormal
    if rounding == "up":
        bits = torch.where(e == 0, ONE_BITS, bits)
    return torch.where(e == 0xFF, math.nan, bits.view(torch.float32))


# ----------------------------------------------------------------------------- randomness, Hadamard

# lowbias32 (twinspec.formats' HASH_*), in int64 holding 32 bits.


def _mul_mod32(x: Tensor, constant: int) -> Tensor:
    """x * constant mod 2^32 in int64 without overflow: multiply by the constant's 16-bit halves."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & MASK32


def hash32(x: Tensor) -> Tensor:
    """lowbias32 of each value (int64 holding 32 bits) -> int64 holding 32 bits."""
    x = x & MASK32
    x = x ^ (x >> HASH_SHIFTS[0])
    x = _mul_mod32(x, HASH_MULTIPLIERS[0])
    x = x ^ (x >> HASH_SHIFTS[1])
    x = _mul_mod32(x, HASH_MULTIPLIERS[1])
    return x ^ (x >> HASH_SHIFTS[2])


def stochastic_key(seed: int | Tensor, device: torch.device) -> Tensor:
    """hash32(seed mod 2^32) as an int64 scalar on `device`.

    A tensor seed (an integer tensor of one element, e.g. a step counter on the GPU) is read on the device, so
    a CUDA graph that captured the cast draws new bits as the counter advances; an int becomes a fill (no copy).
    """
    if isinstance(seed, Tensor):
        value = seed.reshape(()).to(device=device, dtype=torch.int64)
    else:
        value = torch.full((), seed & MASK32, dtype=torch.int64, device=device)
    return hash32(value)


def stochastic_rounding_bits(seed: int | Tensor, index: Tensor) -> Tensor:
    """32 random bits per element: hash32(index mod 2^32 XOR hash32(seed mod 2^32)) (seed: see stochastic_key)."""
    return hash32((index.long() & MASK32) ^ stochastic_key(seed, index.device))


def hadamard_signs(device: torch.device | str = "cpu") -> Tensor:
    """The fixed +-1 diagonal of the random Hadamard transform, fp32 [16]."""
    bits = (HADAMARD_SIGN_BITS >> torch.arange(HADAMARD_SIZE, device=device)) & 1
    return (1 - 2 * bits).float()


def random_hadamard_transform(x: Tensor, *, inverse: bool = False) -> Tensor:
    """(1/4) H16 diag(signs) on each 16-element tile of the last dim (inverse: diag(signs) (1/4) H16).

    Fixed fp32 order every implementation follows: signs, then butterflies of stride 1, 2, 4, 8
    (element i pairs with i + h where bit h of i is 0: (a, b) -> (a + b, a - b)), then * 0.25.
    """
    if x.shape[-1] % HADAMARD_SIZE:
        raise ValueError(f"the Hadamard transform needs a last dim divisible by 16, got {x.shape[-1]}")
    signs = hadamard_signs(x.device)
    tiles = x.float().reshape(-1, HADAMARD_SIZE)
    if not inverse:
        tiles = tiles * signs
    for stride in (1, 2, 4, 8):
        pairs = tiles.reshape(-1, HADAMARD_SIZE // (2 * stride), 2, stride)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        tiles = torch.stack((a + b, a - b), dim=2).reshape(-1, HADAMARD_SIZE)
    tiles = tiles * 0.25
    if inverse:
        tiles = tiles * signs
    return tiles.reshape(x.shape)


