"""Triton quantizers: the functions and signatures of fp8kernels.reference, returning the same bytes.

Formulas: docs/quantization.md; each launcher must match the reference function of its name.
Launches: tensorwise current scaling and NVFP4 need the global amax before any cast, so they
take two launches (`_amax_kernel` with an atomic max, then the cast kernel). Delayed-scaling
tensorwise, block and MXFP8 take one. `quantize_tensorwise_split` quantizes consecutive row groups
of x (MoE experts), each with its own scale, in one launch (TransformerEngine's split quantize: a
Triton launch costs the host tens of microseconds). Every cast kernel reads x once and writes the
rowwise and the transposed columnwise copies. An empty x (nothing to launch) or a device without a
Triton backend (CPU without TRITON_INTERPRET=1) goes to the reference.
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
import triton
from torch import Tensor

from fp8kernels import reference
from fp8kernels._backend import Backend, backend_for
from fp8kernels._casts import format_constants
from fp8kernels._checks import check_global_amax, check_scale_or_amax, check_splits, check_stochastic_seed, matrix_view
from fp8kernels._launch import Launcher
from fp8kernels._quantize_kernels import _amax_kernel, _blockwise_kernel, _mxfp8_kernel, _nvfp4_kernel, _tensorwise_kernel
from fp8kernels.formats import row_block_scales, stochastic_key
from twinspec.checks import check_block, check_divisible, check_roles, element_format
from twinspec.formats import FP8_FORMATS
from fp8kernels.reference import Quantized


def configs(*shapes: tuple[int, ...]) -> list[dict]:
    """Launch configurations from (BLOCK_M, BLOCK_K, num_warps[, register cap]) tuples."""
    return [{"BLOCK_M": m, "BLOCK_K": k, "num_warps": w, **({"maxnreg": cap[0]} if cap else {})} for m, k, w, *cap in shapes]


def _tiles(*shapes: tuple[int, ...]) -> list[dict]:
    """Autotune candidates; 128x128 first: the interpreter runs only the first and pays per program.
    Chosen from offline sm_90 builds (Triton 3.6): 64 elements per thread take the fewest instructions
    per element, 32 per thread the fewest registers (more warps per SM); a register cap trades a few
    spills for one more program an SM."""
    return configs((128, 128, 8), *shapes)


_ROLES = ["M", "K", "ROWWISE", "COLUMNWISE"]  # autotune key of the cast kernels, with what changes their work
# kernel name -> (kernel, autotune candidates on GPU, autotune key). PACK4 (tensorwise, 128x128 blocks)
# wants four row repeats per thread, i.e. BLOCK_M = 16 * num_warps at BLOCK_K = 128 (32 * num_warps at 64).
_KERNELS = {
    "amax": (_amax_kernel, _tiles((64, 256, 4), (64, 512, 8)), ["M", "K", "HADAMARD"]),
    "tensorwise": (_tensorwise_kernel, _tiles((64, 128, 4), (128, 64, 4)), [*_ROLES, "SPLIT"]),
    # The 128x128 tile of blockwise needs 100+ registers a thread, one program per SM: the register caps
    # allow two (a few spills), so that one program's loads overlap the other's casts.
    "blockwise": (
        _blockwise_kernel,
        [{"BLOCK": 128, "num_warps": w, **cap} for w, cap in ((8, {}), (16, {}), (16, {"maxnreg": 64}), (8, {"maxnreg": 128}))],
        [*_ROLES, "SQUARE"],
    ),
    "mxfp8": (_mxfp8_kernel, _tiles((64, 128, 4), (64, 64, 4)), _ROLES),  # the H200 sweep's best two
    # the H200 sweep's best: 1x16 at 64x64 capped at 72 registers (7 programs an SM, not 6), RHT at
    # 64x64 with 8 warps, 16x16 (one cast for both copies) at 64x128 capped at 80 or 128x64
    "nvfp4": (
        _nvfp4_kernel,
        _tiles((64, 64, 4, 72), (64, 64, 8), (64, 128, 4, 80), (128, 64, 4)),
        [*_ROLES, "SQUARE", "HADAMARD", "STOCHASTIC"],
    ),
}


# Split quantize: group row counts reach the kernel in units of up to 16 rows (what Triton specializes an int for).
_ROW_UNIT_MAX = 16
# fp32 elements from one scale_inv to the next: cuBLASLt refuses a scale pointer off a 16-byte boundary
# (CUBLAS_STATUS_NOT_SUPPORTED on the H200 for group scales packed 4 bytes apart).
_SCALE_STRIDE = 4

# Smaller tensors take the first candidate: tuning them would cost more than it saves.
_AUTOTUNE_MIN_ELEMENTS = 1 << 22


@functools.cache
def _kernel(name: str, tuned: bool) -> tuple[Launcher, dict]:
    """(launcher, launch meta-parameters): autotuned over its candidates once per key (built on first use: the
    config list depends on the backend), or its first candidate, launched without autotuning (the tuning
    would cost more than it saves)."""
    kernel, candidates, key = _KERNELS[name]
    if tuned:
        return Launcher(kernel, candidates, key), {}
    return Launcher(kernel), candidates[0]


def _launch(name: str, x2d: Tensor, *buffers: Tensor, splits: list[int] | None = None, **meta) -> None:
    """Launch kernel `name` over the tiles of x2d [M, K]: (x, *buffers, M, K, strides, **meta); with `splits`,
    over each row group's tiles (at least one row of tiles per group)."""
    M, K = x2d.shape
    kernel, config = _kernel(name, tuned=M * K >= _AUTOTUNE_MIN_ELEMENTS)

    def grid(meta):
        block_m = meta.get("BLOCK_M", meta.get("BLOCK"))
        block_k = meta.get("BLOCK_K", meta.get("BLOCK"))
        if splits is None:
            return triton.cdiv(M, block_m), triton.cdiv(K, block_k)
        return sum(max(triton.cdiv(m, block_m), 1) for m in splits), triton.cdiv(K, block_k)

    kernel[grid](x2d, *buffers, M, K, x2d.stride(0), x2d.stride(1), **meta, **config)


def _bytes(shape: tuple[int, ...], wanted: bool, device: torch.device, dtype: torch.dtype = torch.uint8) -> Tensor:
    """An output buffer, or a one-element placeholder for a copy nobody asked for."""
    return torch.empty(shape if wanted else (1,), dtype=dtype, device=device)


def _block_scales(rows: int, blocks: int, wanted: bool, square: bool, device: torch.device) -> Tensor:
    """A blockwise scale_inv [rows, blocks]: row-major for 128x128 blocks, rows-contiguous for 1x128 (what
    cuBLASLt reads, formats.row_block_scales); a one-element placeholder when that copy is not wanted."""
    if not wanted or square:
        return _bytes((rows, blocks) if wanted else (1,), wanted, device, torch.float32)
    return row_block_scales(rows, blocks, device)


def _pack4(columnwise: bool, *row_counts: int) -> bool:
    """Transposed stores as int32 words of four rows' codes: needs whole words per [K, M] row (of every group)."""
    return columnwise and all(m % 4 == 0 for m in row_counts)


def _hardware_cast(x: Tensor) -> bool:
    """In-range fp8 tiles cast by the GPU's cvt (compiled only: the interpreter's casts are wrong)."""
    return backend_for(x.device) is Backend.TRITON


def _global_amax(x2d: Tensor, hadamard: bool) -> Tensor:
    """int32 bits [amax of x] (hadamard: [amax of x, amax of RHT(x.T)]), from the first launch."""
    amax_bits = torch.zeros(2 if hadamard else 1, dtype=torch.int32, device=x2d.device)
    _launch("amax", x2d, amax_bits, HADAMARD=hadamard)
    return amax_bits


def _reference_when_nothing_to_launch(launcher):
    """Send empty tensors and devices without a Triton backend to the reference function of that name."""
    reference_quantizer = getattr(reference, launcher.__name__)

    @functools.wraps(launcher)
    def quantize(x, *args, **kwargs):
        if not isinstance(x, Tensor) or x.numel() == 0 or backend_for(x.device) is Backend.REFERENCE:
            return reference_quantizer(x, *args, **kwargs)
        return launcher(x, *args, **kwargs)

    return quantize


def _cast_tensorwise(
    x2d: Tensor, fmt: str, given: Tensor | None, given_kind: str, amax_bits: Tensor, power_2_scale: bool,
    amax_epsilon: float, rowwise: bool, columnwise: bool, splits: list[int] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The cast launch: (data [M, K], columnwise data, scale_inv, columnwise scale_inv), one scale per row
    group of `splits` (columnwise data: group g's [K, m_g] block from element K * start_g; scale_inv
    [G, _SCALE_STRIDE], group g's in row g) or one in all (scale_inv [1, 1])."""
    M, K = x2d.shape
    device = x2d.device
    groups = 1 if splits is None else len(splits)
    data = _bytes((M, K), rowwise, device)
    columnwise_data = _bytes((K, M) if splits is None else (K * M,), columnwise, device)
    scale_inv = torch.empty(groups, 1 if splits is None else _SCALE_STRIDE, dtype=torch.float32, device=device)
    columnwise_scale_inv = torch.empty_like(scale_inv) if columnwise else scale_inv
    group_starts, row_unit = amax_bits, 1  # unused without splits
    if splits is not None:  # pinned and non-blocking on CUDA: a pageable copy would wait for the GPU
        row_unit = math.gcd(_ROW_UNIT_MAX, *splits)  # rows per unit of the table: see _group_rows
        starts = [start // row_unit for start in itertools.accumulate(splits, initial=0)]
        group_starts = torch.tensor(starts, dtype=torch.int32, pin_memory=device.type == "cuda")
        group_starts = group_starts.to(device, non_blocking=True)
    _launch(
        "tensorwise", x2d, data, columnwise_data, scale_inv if given is None else given, amax_bits,
        scale_inv, columnwise_scale_inv, group_starts, groups, splits=splits,
        **format_constants(fmt), FMAX=reference.FORMATS[fmt].max, POWER_2=power_2_scale, EPSILON=float(amax_epsilon),
        GIVEN=given_kind, SPLIT=splits is not None, ROW_UNIT=row_unit, SCALE_STRIDE=_SCALE_STRIDE,
        ROWWISE=rowwise, COLUMNWISE=columnwise,
        PACK4=_pack4(columnwise, *([M] if splits is None else splits)), HARDWARE_CAST=_hardware_cast(x2d),
    )  # fmt: skip
    return data, columnwise_data, scale_inv, columnwise_scale_inv


@_reference_when_nothing_to_launch
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
    """One fp32 scale for the tensor: current scaling (scale=None, from x's amax or a given `amax`) or a given
    delayed-scaling scale. A given scale or amax takes one launch (x's amax is recorded in it), none two."""
    element_format(fmt, FP8_FORMATS)
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    check_scale_or_amax(scale, amax, power_2_scale, amax_epsilon, x.device)
    if scale is None and amax is None:
        amax_bits, given, given_kind = _global_amax(x2d, hadamard=False), None, ""
    else:  # the cast pass records x's amax
        amax_bits = torch.zeros(1, dtype=torch.int32, device=x.device)
        given, given_kind = (scale, "scale") if amax is None else (amax, "amax")
    data, columnwise_data, scale_inv, columnwise_scale_inv = _cast_tensorwise(
        x2d, fmt, given, given_kind, amax_bits, power_2_scale, amax_epsilon, rowwise, columnwise
    )
    scale_inv, columnwise_scale_inv = scale_inv.view(1), columnwise_scale_inv.view(1)
    return Quantized(
        "tensorwise", fmt, shape,
        data=data if rowwise else None,
        scale_inv=scale_inv if rowwise else None,
        columnwise_data=columnwise_data if columnwise else None,
        columnwise_scale_inv=columnwise_scale_inv if columnwise else None,
        amax=amax_bits.view(torch.float32),
    )


@_reference_when_nothing_to_launch
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
    """quantize_tensorwise of each group of consecutive rows (m_splits[g] rows in group g) with scales[g] or from
    amaxes[g] (by default the groups' own, one torch op for all), in ONE cast launch: the same bytes as
    quantizing each group alone. The groups' rowwise copies are row slices of one [M, K] buffer, their
    columnwise copies consecutive [K, m_g] blocks of one buffer (what fp8kernels.grouped_gemm reads)."""
    element_format(fmt, FP8_FORMATS)
    check_roles(rowwise, columnwise)
    x2d, _ = matrix_view(x)
    splits = check_splits(m_splits, x2d.shape[0])
    check_scale_or_amax(scales, amaxes, power_2_scale, amax_epsilon, x.device, groups=len(splits))
    if scales is None and amaxes is None:
        amaxes = reference.group_amaxes(x2d, splits)
    given, given_kind = (scales, "scale") if amaxes is None else (amaxes, "amax")
    amax_bits = torch.zeros(len(splits), dtype=torch.int32, device=x.device)  # the cast pass records each amax
    data, columnwise_data, scale_inv, columnwise_scale_inv = _cast_tensorwise(
        x2d, fmt, given, given_kind, amax_bits, power_2_scale, amax_epsilon, rowwise, columnwise, splits
    )
    K = x2d.shape[1]
    rows = data.split(splits) if rowwise else [None] * len(splits)
    columns = columnwise_data.split([K * m for m in splits]) if columnwise else [None] * len(splits)
    scale_invs, columnwise_scale_invs = scale_inv[:, :1].unbind(), columnwise_scale_inv[:, :1].unbind()
    return [
        Quantized(
            "tensorwise", fmt, (m, K),
            data=rows[g],
            scale_inv=scale_invs[g] if rowwise else None,
            columnwise_data=columns[g].view(K, m) if columnwise else None,
            columnwise_scale_inv=columnwise_scale_invs[g] if columnwise else None,
            amax=amax,
        )  # fmt: skip
        for g, (m, amax) in enumerate(zip(splits, amax_bits.view(torch.float32).split(1), strict=True))
    ]


@_reference_when_nothing_to_launch
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
    M, K = x2d.shape
    row_blocks, col_blocks = triton.cdiv(M, 128), triton.cdiv(K, 128)
    square = block == (128, 128)
    data = _bytes((M, K), rowwise, x.device)
    scale_inv = _block_scales(row_blocks if square else M, col_blocks, rowwise, square, x.device)
    columnwise_data = _bytes((K, M), columnwise, x.device)
    columnwise_scale_inv = _block_scales(col_blocks if square else K, row_blocks, columnwise, square, x.device)
    _launch(
        "blockwise", x2d, data, scale_inv, columnwise_data, columnwise_scale_inv,
        **format_constants(fmt), FMAX=reference.FORMATS[fmt].max, POWER_2=power_2_scale, SQUARE=square,
        ROWWISE=rowwise, COLUMNWISE=columnwise, PACK4=_pack4(columnwise, M), HARDWARE_CAST=_hardware_cast(x),
    )
    return Quantized(
        f"block{block[0]}x{block[1]}", fmt, shape,
        data if rowwise else None, scale_inv if rowwise else None,
        columnwise_data if columnwise else None, columnwise_scale_inv if columnwise else None, amax=None,
    )


@_reference_when_nothing_to_launch
def quantize_mxfp8(
    x: Tensor, fmt: str = "e4m3", *, scale_rounding: str = "up", rowwise: bool = True, columnwise: bool = False
) -> Quantized:
    """E8M0 scale per 32 consecutive elements of an operand row (OCP MX)."""
    f = element_format(fmt, FP8_FORMATS)
    if scale_rounding not in ("up", "floor"):
        raise ValueError(f"scale_rounding={scale_rounding!r}: use 'up' (TransformerEngine, JAX) or 'floor' (OCP MX)")
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    M, K = x2d.shape
    if rowwise:
        check_divisible(K, 32, "mxfp8", "rowwise")
    if columnwise:
        check_divisible(M, 32, "mxfp8", "columnwise")
    data, scale = _bytes((M, K), rowwise, x.device), _bytes((M, K // 32), rowwise, x.device)
    columnwise_data, columnwise_scale = _bytes((K, M), columnwise, x.device), _bytes((K, M // 32), columnwise, x.device)
    _launch(
        "mxfp8", x2d, data, scale, columnwise_data, columnwise_scale,
        **format_constants(fmt), INV_FMAX=1.0 / f.max, MAX_EXPONENT=f.max_exponent, ROUND_UP=scale_rounding == "up",
        ROWWISE=rowwise, COLUMNWISE=columnwise, HARDWARE_CAST=_hardware_cast(x),
    )
    return Quantized(
        "mxfp8", fmt, shape,
        data if rowwise else None, scale if rowwise else None,
        columnwise_data if columnwise else None, columnwise_scale if columnwise else None, amax=None,
    )


def _key_on_device(seed: int | Tensor, device: torch.device) -> Tensor:
    """hash32(seed mod 2^32) as an int32 (1,) device tensor the kernel loads: never a host value, so a captured
    cast follows a seed counter that advances on the device."""
    key = stochastic_key(seed, device)
    return torch.where(key >= 1 << 31, key - (1 << 32), key).to(torch.int32).reshape(1)


@_reference_when_nothing_to_launch
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
    """E2M1 values, an e4m3 scale per 1x16 or 16x16 block and an fp32 global scale from the operand's amax
    (or a given `global_amax`: see fp8kernels.reference.quantize_nvfp4)."""
    block = check_block(block, ((1, 16), (16, 16)), "quantize_nvfp4")
    check_roles(rowwise, columnwise)
    check_stochastic_seed(stochastic_seed)
    check_global_amax(global_amax, hadamard and columnwise, x.device)
    x2d, shape = matrix_view(x)
    M, K = x2d.shape
    if rowwise:
        check_divisible(K, 16, "nvfp4", "rowwise")
    if columnwise:
        check_divisible(M, 16, "nvfp4", "columnwise")
    square = block == (16, 16)
    rotate = hadamard and columnwise
    if global_amax is None:
        amax_bits = _global_amax(x2d, hadamard=rotate)
    else:  # [given amax, unused]: the kernel reads the rotated copy's amax from [1] only when rotating
        amax_bits = torch.cat([global_amax.reshape(1).float(), global_amax.new_zeros(1, dtype=torch.float32)])
        amax_bits = amax_bits.view(torch.int32)
    data = _bytes((M, K // 2), rowwise, x.device)
    scale = _bytes((triton.cdiv(M, 16) if square else M, K // 16), rowwise, x.device)
    columnwise_data = _bytes((K, M // 2), columnwise, x.device)
    columnwise_scale = _bytes((triton.cdiv(K, 16) if square else K, M // 16), columnwise, x.device)
    key = amax_bits if stochastic_seed is None else _key_on_device(stochastic_seed, x.device)  # unread if None
    _launch(
        "nvfp4", x2d, data, scale, columnwise_data, columnwise_scale, amax_bits, key,
        SQUARE=square, HADAMARD=rotate, STOCHASTIC=stochastic_seed is not None,
        ROWWISE=rowwise, COLUMNWISE=columnwise, HARDWARE_CAST=_hardware_cast(x),
    )
    amax = amax_bits.view(torch.float32)
    return Quantized(
        f"nvfp4_{block[0]}x{block[1]}", "e2m1", shape,
        data if rowwise else None, scale if rowwise else None,
        columnwise_data if columnwise else None, columnwise_scale if columnwise else None,
        amax=amax[:1].clone(),
        columnwise_amax=(amax[1:] if rotate else amax[:1].clone()) if columnwise else None,
        hadamard=hadamard,
    )


__all__ = ["quantize_blockwise", "quantize_mxfp8", "quantize_nvfp4", "quantize_tensorwise", "quantize_tensorwise_split"]
