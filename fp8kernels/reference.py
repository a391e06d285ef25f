"""The pure-torch spec of every quantizer: readable and slow; its bytes are the ones to match.

docs/quantization.md is the contract. `fp8kernels.quantize` (Triton, on GPU and in the
interpreter) and `jaxside` expose the same functions and must return identical bytes.

Vocabulary: `x` is viewed as a matrix [M, K]. Every quantization works on an *operand*
[R, C] row by row: the rowwise copy quantizes x itself, the columnwise copy quantizes x.T
([K, M]). Element casts: x * scale in fp32, NaN -> the format's canonical NaN byte, clamp to
+-max, round to nearest even (subnormals included). The element-level pieces live in
`fp8kernels.formats` and are re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fp8kernels._checks import check_global_amax, check_scale_or_amax, check_splits, check_stochastic_seed, matrix_view
from fp8kernels.formats import (
    decode_e2m1,
    decode_fp8,
    e8m0_encode_multiplier,
    e8m0_from_amax,
    encode_e2m1,
    encode_fp8,
    hadamard_signs,
    hash32,
    pack_fp4,
    random_hadamard_transform,
    scale_from_amax,
    stochastic_rounding_bits,
    unpack_fp4,
)
from twinspec.checks import check_block, check_divisible, check_roles, element_format
from twinspec.formats import FORMATS, FP8_FORMATS, FP32_MAX, NVFP4_GLOBAL_MAX, SCHEME_BLOCKS


@dataclass
class Quantized:
    """The bytes of one quantized tensor; `scale_inv` is the stored scale (x ~ q * scale_inv)."""

    scheme: str  # a key of SCHEME_BLOCKS
    fmt: str  # "e4m3" | "e5m2" | "e2m1"
    shape: tuple[int, ...]  # logical shape of the input
    data: Tensor | None  # rowwise bytes, uint8 [M, K] (nvfp4: [M, K // 2])
    scale_inv: Tensor | None
    columnwise_data: Tensor | None  # rowwise quantization of x.T: uint8 [K, M] (nvfp4: [K, M // 2])
    columnwise_scale_inv: Tensor | None
    amax: Tensor | None  # fp32 (1,): amax of x (tensorwise), the rowwise global amax (nvfp4)
    columnwise_amax: Tensor | None = None  # nvfp4: global amax of the columnwise operand (after the RHT)
    hadamard: bool = False  # nvfp4: the columnwise operand is random_hadamard_transform(x.T)


# ----------------------------------------------------------------------------- amax and blocks


def tensor_amax(x2d: Tensor) -> Tensor:
    """max |x| as fp32 (1,); NaN if any element is NaN; 0 for an empty tensor."""
    if x2d.numel() == 0:
        return torch.zeros(1, device=x2d.device)
    return x2d.float().abs().amax().reshape(1)


def group_amaxes(x2d: Tensor, m_splits: list[int]) -> Tensor:
    """tensor_amax of each group of consecutive rows (m_splits[g] rows in group g) as fp32 (G,): one torch
    reduction for all groups (cheaper on the host than a launch per group); 0 for an empty group."""
    parts = x2d.split(m_splits)
    filled = [part for part in parts if part.numel()]  # torch's inf-norm refuses empty tensors
    norms = iter(torch._foreach_norm(filled, ord=math.inf, dtype=torch.float32) if filled else ())
    zero = torch.zeros((), device=x2d.device)
    return torch.stack([next(norms) if part.numel() else zero for part in parts])


def block_amax(operand: Tensor, block: tuple[int, int]) -> Tensor:
    """max |x| per block [rows, cols] of the operand (partial edge blocks allowed), NaN-propagating."""
    rows, cols = operand.shape
    block_rows, block_cols = block
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    padded = torch.zeros(row_blocks * block_rows, col_blocks * block_cols, device=operand.device)
    padded[:rows, :cols] = operand.abs()
    return padded.reshape(row_blocks, block_rows, col_blocks, block_cols).amax(dim=(1, 3))


def expand_blocks(per_block: Tensor, block: tuple[int, int], shape: tuple[int, int]) -> Tensor:
    """One value per block -> one per element of an operand of `shape`."""
    full = per_block.repeat_interleave(block[0], dim=0).repeat_interleave(block[1], dim=1)
    return full[: shape[0], : shape[1]]


# ----------------------------------------------------------------------------- quantizers


def quantize_tensorwise(
    x: Tensor,
    fmt: str = "e4m3",
    scale: Tensor | None = None,
    *,
    amax: Tensor | None = None,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Quantized:
    """One fp32 scale for the tensor: current scaling (scale=None) or a given delayed-scaling scale.

    Current scaling scales from x's amax, or from a given `amax` (fp32, one element: that of all the
    shards x is one of, so that each casts as the whole tensor would). The result's amax is x's own.
    """
    f = element_format(fmt, FP8_FORMATS)
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    check_scale_or_amax(scale, amax, power_2_scale, amax_epsilon, x.device)
    x2d = x2d.float()
    x_amax = tensor_amax(x2d)  # measured in every mode: delayed scaling records it in the history
    if scale is None:
        from_amax = x_amax if amax is None else amax.reshape(1)
        scale = scale_from_amax(from_amax, f.max, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    else:
        scale = scale.reshape(1)
    scale_inv = 1.0 / scale
    return Quantized(
        "tensorwise",
        fmt,
        shape,
        data=encode_fp8(x2d * scale, fmt) if rowwise else None,
        scale_inv=scale_inv if rowwise else None,
        columnwise_data=encode_fp8(x2d.T * scale, fmt).contiguous() if columnwise else None,
        columnwise_scale_inv=scale_inv.clone() if columnwise else None,
        amax=x_amax,
    )


def quantize_tensorwise_split(
    x: Tensor,
    m_splits: list[int],
    fmt: str = "e4m3",
    scales: Tensor | None = None,
    *,
    amaxes: Tensor | None = None,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
) -> list[Quantized]:
    """quantize_tensorwise of each group of consecutive rows of x ([M, K]; m_splits[g] rows in group g), with
    scales[g] (delayed scaling) or the scale from amaxes[g] (current scaling; by default the group's own amax).
    Group g's result is that of its rows alone, shaped [m_splits[g], K]."""
    element_format(fmt, FP8_FORMATS)
    check_roles(rowwise, columnwise)
    x2d, _ = matrix_view(x)
    splits = check_splits(m_splits, x2d.shape[0])
    check_scale_or_amax(scales, amaxes, power_2_scale, amax_epsilon, x.device, groups=len(splits))
    current = {"power_2_scale": power_2_scale, "amax_epsilon": amax_epsilon}
    return [
        quantize_tensorwise(
            part, fmt, None if scales is None else scales[g : g + 1], **current,
            amax=None if amaxes is None else amaxes[g : g + 1], rowwise=rowwise, columnwise=columnwise,
        )  # fmt: skip
        for g, part in enumerate(x2d.split(splits))
    ]


def _blockwise_operand(operand: Tensor, fmt: str, block: tuple[int, int], power_2_scale: bool) -> tuple[Tensor, Tensor]:
    """(codes, fp32 scale_inv per block) of one operand."""
    scale = scale_from_amax(block_amax(operand, block), FORMATS[fmt].max, power_2_scale=power_2_scale)
    codes = encode_fp8(operand * expand_blocks(scale, block, operand.shape), fmt)
    return codes, 1.0 / scale


def quantize_blockwise(
    x: Tensor,
    fmt: str = "e4m3",
    block: tuple[int, int] = (1, 128),
    *,
    power_2_scale: bool = True,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Quantized:
    """fp32 scale per 1x128 (activations, grads) or 128x128 (weights) block; edge blocks may be partial."""
    element_format(fmt, FP8_FORMATS)
    block = check_block(block, ((1, 128), (128, 128)), "quantize_blockwise")
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    x2d = x2d.float()
    data, scale_inv = _blockwise_operand(x2d, fmt, block, power_2_scale) if rowwise else (None, None)
    col_data, col_scale_inv = _blockwise_operand(x2d.T, fmt, block, power_2_scale) if columnwise else (None, None)
    scheme = f"block{block[0]}x{block[1]}"
    return Quantized(scheme, fmt, shape, data, scale_inv, col_data, col_scale_inv, amax=None)


def _mxfp8_operand(operand: Tensor, fmt: str, scale_rounding: str) -> tuple[Tensor, Tensor]:
    """(codes, e8m0 scale per 32 elements) of one operand."""
    exponent = e8m0_from_amax(block_amax(operand, (1, 32)), fmt, scale_rounding)
    multiplier = e8m0_encode_multiplier(exponent, scale_rounding)
    return encode_fp8(operand * expand_blocks(multiplier, (1, 32), operand.shape), fmt), exponent


def quantize_mxfp8(
    x: Tensor, fmt: str = "e4m3", *, scale_rounding: str = "up", rowwise: bool = True, columnwise: bool = False
) -> Quantized:
    """E8M0 scale per 32 consecutive elements of an operand row (OCP MX)."""
    element_format(fmt, FP8_FORMATS)
    if scale_rounding not in ("up", "floor"):
        raise ValueError(f"scale_rounding={scale_rounding!r}: use 'up' (TransformerEngine, JAX) or 'floor' (OCP MX)")
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    x2d = x2d.float()
    data = scale_inv = col_data = col_scale_inv = None
    if rowwise:
        check_divisible(x2d.shape[1], 32, "mxfp8", "rowwise")
        data, scale_inv = _mxfp8_operand(x2d, fmt, scale_rounding)
    if columnwise:
        check_divisible(x2d.shape[0], 32, "mxfp8", "columnwise")
        col_data, col_scale_inv = _mxfp8_operand(x2d.T, fmt, scale_rounding)
    return Quantized("mxfp8", fmt, shape, data, scale_inv, col_data, col_scale_inv, amax=None)


def nvfp4_global_encode(global_amax: Tensor) -> Tensor:
    """(448 * 6) / global_amax in fp32; 1 for amax 0/inf/NaN, fp32 max on overflow."""
    return scale_from_amax(global_amax, NVFP4_GLOBAL_MAX)


def _nvfp4_operand(
    operand: Tensor, global_amax: Tensor, block: tuple[int, int], stochastic_seed: int | Tensor | None
) -> tuple[Tensor, Tensor]:
    """(packed e2m1 bytes, e4m3 scale per block) of one operand."""
    global_encode = nvfp4_global_encode(global_amax)
    amax_per_block = block_amax(operand, block)
    # A tensor divisor: CUDA torch turns division by a Python scalar into a multiply by its reciprocal.
    e2m1_max = torch.full_like(amax_per_block, FORMATS["e2m1"].max)
    block_scale = encode_fp8(amax_per_block / e2m1_max * global_encode, "e4m3")
    block_scale_f32 = decode_fp8(block_scale, "e4m3")
    encode = torch.where(block_scale_f32 == 0, 0.0, global_encode / block_scale_f32)
    values = operand * expand_blocks(encode, block, operand.shape)
    random_bits = None
    if stochastic_seed is not None:
        index = torch.arange(operand.numel(), device=operand.device).reshape(operand.shape)
        random_bits = stochastic_rounding_bits(stochastic_seed, index)
    return pack_fp4(encode_e2m1(values, random_bits)), block_scale


def quantize_nvfp4(
    x: Tensor,
    *,
    block: tuple[int, int] = (1, 16),
    hadamard: bool = False,
    stochastic_seed: int | Tensor | None = None,
    rowwise: bool = True,
    columnwise: bool = False,
    global_amax: Tensor | None = None,
) -> Quantized:
    """E2M1 values, an e4m3 scale per 1x16 or 16x16 block and an fp32 global scale from the operand's amax.

    `global_amax` (fp32, one element) replaces x's own amax: that of the whole tensor when x is one
    shard of it, so every shard casts as the whole tensor would. It cannot stand for the amax of a
    Hadamard-rotated columnwise copy.
    """
    block = check_block(block, ((1, 16), (16, 16)), "quantize_nvfp4")
    check_roles(rowwise, columnwise)
    check_stochastic_seed(stochastic_seed)
    check_global_amax(global_amax, hadamard and columnwise, x.device)
    x2d, shape = matrix_view(x)
    x2d = x2d.float()
    amax = tensor_amax(x2d) if global_amax is None else global_amax.reshape(1).float()
    data = scale_inv = col_data = col_scale_inv = col_amax = None
    if rowwise:
        check_divisible(x2d.shape[1], 16, "nvfp4", "rowwise")
        data, scale_inv = _nvfp4_operand(x2d, amax, block, stochastic_seed)
    if columnwise:
        check_divisible(x2d.shape[0], 16, "nvfp4", "columnwise")
        operand = random_hadamard_transform(x2d.T) if hadamard else x2d.T
        col_amax = tensor_amax(operand) if hadamard else amax  # x.T's amax is x's (or the given one)
        col_data, col_scale_inv = _nvfp4_operand(operand, col_amax, block, stochastic_seed)
    scheme = f"nvfp4_{block[0]}x{block[1]}"
    return Quantized(scheme, "e2m1", shape, data, scale_inv, col_data, col_scale_inv, amax, col_amax, hadamard)


# ----------------------------------------------------------------------------- dequantize


def dequantize(q: Quantized, dtype: torch.dtype = torch.float32, *, columnwise: bool = False) -> Tensor:
    """Values of the rowwise (or columnwise) copy, in x's shape; a Hadamard-rotated copy is rotated back."""
    data = q.columnwise_data if columnwise else q.data
    scale_inv = q.columnwise_scale_inv if columnwise else q.scale_inv
    if data is None:
        raise ValueError(f"this Quantized has no {'columnwise' if columnwise else 'rowwise'} copy; quantize with it")
    block = SCHEME_BLOCKS[q.scheme]
    if q.fmt == "e2m1":
        global_amax = q.columnwise_amax if columnwise else q.amax
        values = decode_e2m1(unpack_fp4(data))
        values = values * expand_blocks(decode_fp8(scale_inv, "e4m3"), block, values.shape)
        values = values / nvfp4_global_encode(global_amax)
        if columnwise and q.hadamard:
            values = random_hadamard_transform(values, inverse=True)
    elif q.scheme == "mxfp8":
        values = decode_fp8(data, q.fmt) * expand_blocks(decode_fp8(scale_inv, "e8m0"), block, data.shape)
    elif block is None:
        values = decode_fp8(data, q.fmt) * scale_inv
    else:
        values = decode_fp8(data, q.fmt) * expand_blocks(scale_inv, block, data.shape)
    if columnwise:
        values = values.T
    return values.reshape(q.shape).to(dtype)


# ----------------------------------------------------------------------------- delayed scaling


def delayed_scaling_update(
    amax_history: Tensor, scale: Tensor, fmax: float, *, margin: float = 0, algo: str = "max"
) -> tuple[Tensor, Tensor]:
    """One delayed-scaling step: a new scale from the history, then the history rolled (row 0 zeroed).

    amax_history is [history_len, ...] with row 0 the slot the next quantizations write;
    scale is [...]. Returns new tensors; the inputs are not modified. A non-finite amax in row 0
    (a step whose tensors held inf or NaN: GradScaler skips it) is refused: the scale stays and
    the history records 0 in its place, so it does not freeze the scale for history_len steps.
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo={algo!r}: use 'max' or 'most_recent'")
    refused = ~amax_history[0].isfinite()
    history = amax_history.clone()
    history[0] = torch.where(refused, 0.0, amax_history[0])
    amax = history.amax(dim=0) if algo == "max" else history[0]
    new_scale = torch.full_like(amax, fmax) / amax / (2.0**margin)
    new_scale = torch.where(new_scale.isinf(), FP32_MAX, new_scale)
    new_scale = torch.where((amax > 0) & amax.isfinite() & ~refused, new_scale, scale)
    new_history = torch.roll(history, -1, dims=0)
    new_history[0] = 0
    return new_history, new_scale


__all__ = [
    "FORMATS",
    "SCHEME_BLOCKS",
    "Quantized",
    "block_amax",
    "decode_e2m1",
    "decode_fp8",
    "delayed_scaling_update",
    "dequantize",
    "e8m0_encode_multiplier",
    "e8m0_from_amax",
    "encode_e2m1",
    "encode_fp8",
    "group_amaxes",
    "hadamard_signs",
    "hash32",
    "nvfp4_global_encode",
    "pack_fp4",
    "quantize_blockwise",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "quantize_tensorwise",
    "quantize_tensorwise_split",
    "random_hadamard_transform",
    "scale_from_amax",
    "stochastic_rounding_bits",
    "tensor_amax",
    "unpack_fp4",
]
