"""The @triton.jit quantization kernels behind kernels.quantize (one program = one tile of x).

Every kernel loads a [BLOCK_M, BLOCK_K] tile of x once and writes both the rowwise codes
([M, K]) and the columnwise ones (the rowwise quantization of x.T, stored [K, M]) from it.
Casts, scales and the Hadamard transform come from kernels._casts; amaxes are taken on the
int32 bits of |x|, where integer max is float max and NaN wins (as torch.amax propagates it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels._casts import (
    abs_bits,
    e4m3_code_to_f32,
    e8m0_encode_multiplier,
    e8m0_from_amax_bits,
    f32_to_code,
    f32_to_e2m1_code,
    f32_to_e2m1_code_stochastic,
    f32_to_e4m3_code,
    hadamard_rows,
    hash32,
    scale_from_amax,
    to_f32,
)
from kernels.formats import NVFP4_GLOBAL_MAX

_NVFP4_GLOBAL_MAX = tl.constexpr(NVFP4_GLOBAL_MAX)


@triton.jit
def _load_tile(x_ptr, M, K, stride_m, stride_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's tile of x as fp32 (0 outside x) with its row and column indices (int64)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_k, mask=inside, other=0.0)
    return to_f32(x), rows, cols


@triton.jit
def _store_tile(out_ptr, values, rows, cols, R, C):
    """Store a tile into a row-major [R, C] uint8 (or fp32) buffer, masked to its bounds."""
    inside = (rows[:, None] < R) & (cols[None, :] < C)
    tl.store(out_ptr + rows[:, None] * C + cols[None, :], values.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _tile_max(magnitude):
    return tl.max(tl.max(magnitude, axis=1), axis=0)


@triton.jit
def _reciprocal_rn(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


@triton.jit
def _amax_kernel(
    x_ptr, amax_bits_ptr,  # x [M, K]; int32[2]: amax of x, amax of RHT(x.T)
    M, K, stride_m, stride_k,
    HADAMARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Global amax by atomic max of the tiles' |x| bits (the first launch of current scaling and NVFP4)."""
    x, rows, cols = _load_tile(x_ptr, M, K, stride_m, stride_k, BLOCK_M, BLOCK_K)
    tl.atomic_max(amax_bits_ptr, _tile_max(abs_bits(x)))
    if HADAMARD:  # the columnwise NVFP4 operand is RHT(x.T): its 16-tiles run down x's columns
        rotated = hadamard_rows(tl.trans(x), BLOCK_K, BLOCK_M)
        tl.atomic_max(amax_bits_ptr + 1, _tile_max(abs_bits(rotated)))


@triton.jit
def _tensorwise_kernel(
    x_ptr, data_ptr, columnwise_ptr,  # x [M, K]; uint8 [M, K] and [K, M]
    scale_ptr, amax_bits_ptr, scale_inv_ptr,  # fp32 (1,) given scale; int32 (1,) amax bits; fp32 (1,)
    M, K, stride_m, stride_k,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    FMAX: tl.constexpr, POWER_2: tl.constexpr, EPSILON: tl.constexpr, GIVEN_SCALE: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """x * scale -> fp8 rowwise and transposed; a given (delayed) scale lets the amax fuse into this pass."""
    x, rows, cols = _load_tile(x_ptr, M, K, stride_m, stride_k, BLOCK_M, BLOCK_K)
    if GIVEN_SCALE:
        scale = tl.load(scale_ptr)
        tl.atomic_max(amax_bits_ptr, _tile_max(abs_bits(x)))
    else:
        scale = scale_from_amax(tl.load(amax_bits_ptr).to(tl.float32, bitcast=True), FMAX, POWER_2, EPSILON)
    codes = f32_to_code(x * scale, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE).to(tl.uint8)
    if ROWWISE:
        _store_tile(data_ptr, codes, rows, cols, M, K)
    if COLUMNWISE:
        _store_tile(columnwise_ptr, tl.trans(codes), cols, rows, K, M)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(scale_inv_ptr, _reciprocal_rn(scale))


@triton.jit
def _blockwise_kernel(
    x_ptr, data_ptr, scale_inv_ptr, columnwise_ptr, columnwise_scale_inv_ptr,
    M, K, stride_m, stride_k,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    FMAX: tl.constexpr, POWER_2: tl.constexpr, SQUARE: tl.constexpr,  # SQUARE: 128x128 blocks, else 1x128
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK: tl.constexpr,
):
    """fp32-scaled blocks; the tile is one 128x128 block, or 128 row blocks and 128 column blocks of 1x128."""
    x, rows, cols = _load_tile(x_ptr, M, K, stride_m, stride_k, BLOCK, BLOCK)
    magnitude = abs_bits(x)
    row_blocks = tl.cdiv(M, BLOCK)
    col_blocks = tl.cdiv(K, BLOCK)
    if SQUARE:  # one scale; the columnwise copy is the transpose of the rowwise one
        scale = scale_from_amax(_tile_max(magnitude).to(tl.float32, bitcast=True), FMAX, POWER_2, 0.0)
        codes = f32_to_code(x * scale, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
        if ROWWISE:
            _store_tile(data_ptr, codes, rows, cols, M, K)
            tl.store(scale_inv_ptr + tl.program_id(0) * col_blocks + tl.program_id(1), _reciprocal_rn(scale))
        if COLUMNWISE:
            _store_tile(columnwise_ptr, tl.trans(codes), cols, rows, K, M)
            tl.store(columnwise_scale_inv_ptr + tl.program_id(1) * row_blocks + tl.program_id(0), _reciprocal_rn(scale))
    else:
        if ROWWISE:  # a 1x128 block per row of the tile
            scale = scale_from_amax(tl.max(magnitude, axis=1).to(tl.float32, bitcast=True), FMAX, POWER_2, 0.0)
            codes = f32_to_code(x * scale[:, None], EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
            _store_tile(data_ptr, codes, rows, cols, M, K)
            tl.store(scale_inv_ptr + rows * col_blocks + tl.program_id(1), _reciprocal_rn(scale), mask=rows < M)
        if COLUMNWISE:  # a 1x128 block of x.T per column of the tile
            scale = scale_from_amax(tl.max(magnitude, axis=0).to(tl.float32, bitcast=True), FMAX, POWER_2, 0.0)
            codes = f32_to_code(x * scale[None, :], EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
            _store_tile(columnwise_ptr, tl.trans(codes), cols, rows, K, M)
            scale_inv_ptrs = columnwise_scale_inv_ptr + cols * row_blocks + tl.program_id(0)
            tl.store(scale_inv_ptrs, _reciprocal_rn(scale), mask=cols < K)


@triton.jit
def _mxfp8_kernel(
    x_ptr, data_ptr, scale_ptr, columnwise_ptr, columnwise_scale_ptr,  # scales: uint8 [M, K/32], [K, M/32]
    M, K, stride_m, stride_k,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    INV_FMAX: tl.constexpr, MAX_EXPONENT: tl.constexpr, ROUND_UP: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """E8M0 scale per 32 elements along rows (rowwise) and along columns (columnwise) of one tile."""
    x, rows, cols = _load_tile(x_ptr, M, K, stride_m, stride_k, BLOCK_M, BLOCK_K)
    magnitude = abs_bits(x)
    if ROWWISE:
        amax = tl.max(tl.reshape(magnitude, [BLOCK_M, BLOCK_K // 32, 32]), axis=2)
        exponent = e8m0_from_amax_bits(amax, INV_FMAX, MAX_EXPONENT, ROUND_UP)
        scaled = tl.reshape(x, [BLOCK_M, BLOCK_K // 32, 32]) * e8m0_encode_multiplier(exponent)[:, :, None]
        codes = f32_to_code(tl.reshape(scaled, [BLOCK_M, BLOCK_K]), EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
        _store_tile(data_ptr, codes, rows, cols, M, K)
        scale_cols = tl.program_id(1) * (BLOCK_K // 32) + tl.arange(0, BLOCK_K // 32)
        _store_tile(scale_ptr, exponent, rows, scale_cols, M, K // 32)
    if COLUMNWISE:
        amax = tl.max(tl.reshape(magnitude, [BLOCK_M // 32, 32, BLOCK_K]), axis=1)
        exponent = e8m0_from_amax_bits(amax, INV_FMAX, MAX_EXPONENT, ROUND_UP)
        scaled = tl.reshape(x, [BLOCK_M // 32, 32, BLOCK_K]) * e8m0_encode_multiplier(exponent)[:, None, :]
        codes = f32_to_code(tl.reshape(scaled, [BLOCK_M, BLOCK_K]), EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
        _store_tile(columnwise_ptr, tl.trans(codes), cols, rows, K, M)
        scale_cols = tl.program_id(0) * (BLOCK_M // 32) + tl.arange(0, BLOCK_M // 32)
        _store_tile(columnwise_scale_ptr, tl.trans(exponent), cols, scale_cols, K, M // 32)


@triton.jit
def _nvfp4_operand_tile(
    x, global_encode, rows, cols, C, key,  # x: a [ROWS, COLS] tile of an operand with C columns
    ROWS: tl.constexpr, COLS: tl.constexpr, SQUARE: tl.constexpr, STOCHASTIC: tl.constexpr,
):
    """(packed e2m1 bytes [ROWS, COLS/2], e4m3 block scales) of one operand tile."""
    magnitude = abs_bits(x)
    if SQUARE:  # 16x16 blocks: [ROWS/16, COLS/16] scales
        block_amax = tl.max(tl.max(tl.reshape(magnitude, [ROWS // 16, 16, COLS // 16, 16]), axis=3), axis=1)
    else:  # 1x16 blocks: [ROWS, COLS/16] scales
        block_amax = tl.max(tl.reshape(magnitude, [ROWS, COLS // 16, 16]), axis=2)
    block_amax = block_amax.to(tl.float32, bitcast=True)
    block_amax_over_6 = tl.math.div_rn(block_amax, tl.full(block_amax.shape, 6.0, tl.float32))
    block_scale = f32_to_e4m3_code(block_amax_over_6 * global_encode)
    block_scale_f32 = e4m3_code_to_f32(block_scale)
    encode = tl.math.div_rn(tl.full(block_scale_f32.shape, 1.0, tl.float32) * global_encode, block_scale_f32)
    encode = tl.where(block_scale_f32 == 0, 0.0, encode)
    if SQUARE:
        values = tl.reshape(x, [ROWS // 16, 16, COLS // 16, 16]) * encode[:, None, :, None]
    else:
        values = tl.reshape(x, [ROWS, COLS // 16, 16]) * encode[:, :, None]
    values = tl.reshape(values, [ROWS, COLS])
    if STOCHASTIC:  # element index in the operand, mod 2^32, hashed with the seed's key
        index = (rows[:, None] * C + cols[None, :]).to(tl.uint32)
        codes = f32_to_e2m1_code_stochastic(values, hash32(index ^ key.to(tl.uint32, bitcast=True)))
    else:
        codes = f32_to_e2m1_code(values)
    low, high = tl.split(tl.reshape(codes, [ROWS, COLS // 2, 2]))
    return low | (high << 4), block_scale


@triton.jit
def _nvfp4_store(
    data_ptr, scale_ptr, packed, block_scale, R, C, ROW_TILE, COL_TILE,
    ROWS: tl.constexpr, COLS: tl.constexpr, SQUARE: tl.constexpr,
):
    """Write one operand tile's packed bytes ([R, C/2]) and block scales ([R or ceil(R/16), C/16])."""
    rows = ROW_TILE.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    packed_cols = COL_TILE.to(tl.int64) * (COLS // 2) + tl.arange(0, COLS // 2)
    _store_tile(data_ptr, packed, rows, packed_cols, R, C // 2)
    scale_cols = COL_TILE.to(tl.int64) * (COLS // 16) + tl.arange(0, COLS // 16)
    if SQUARE:  # one row of scales per 16 operand rows
        scale_rows = ROW_TILE.to(tl.int64) * (ROWS // 16) + tl.arange(0, ROWS // 16)
        _store_tile(scale_ptr, block_scale, scale_rows, scale_cols, tl.cdiv(R, 16), C // 16)
    else:
        _store_tile(scale_ptr, block_scale, rows, scale_cols, R, C // 16)


@triton.jit(do_not_specialize=["key"])
def _nvfp4_kernel(
    x_ptr, data_ptr, scale_ptr, columnwise_ptr, columnwise_scale_ptr, amax_bits_ptr,
    M, K, stride_m, stride_k, key,  # key: hash32(seed) as a signed int32, for stochastic rounding
    SQUARE: tl.constexpr, HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """E2M1 with e4m3 block scales under the global scale from _amax_kernel; RHT on the columnwise operand."""
    x, rows, cols = _load_tile(x_ptr, M, K, stride_m, stride_k, BLOCK_M, BLOCK_K)
    if ROWWISE:
        amax = tl.load(amax_bits_ptr).to(tl.float32, bitcast=True)
        global_encode = scale_from_amax(amax, _NVFP4_GLOBAL_MAX, False, 0.0)
        packed, block_scale = _nvfp4_operand_tile(
            x, global_encode, rows, cols, K, key, BLOCK_M, BLOCK_K, SQUARE, STOCHASTIC
        )
        _nvfp4_store(
            data_ptr, scale_ptr, packed, block_scale, M, K, tl.program_id(0), tl.program_id(1), BLOCK_M, BLOCK_K, SQUARE
        )
    if COLUMNWISE:
        operand = tl.trans(x)  # a [BLOCK_K, BLOCK_M] tile of x.T
        if HADAMARD:
            operand = hadamard_rows(operand, BLOCK_K, BLOCK_M)
            amax = tl.load(amax_bits_ptr + 1).to(tl.float32, bitcast=True)
        else:
            amax = tl.load(amax_bits_ptr).to(tl.float32, bitcast=True)
        global_encode = scale_from_amax(amax, _NVFP4_GLOBAL_MAX, False, 0.0)
        packed, block_scale = _nvfp4_operand_tile(
            operand, global_encode, cols, rows, M, key, BLOCK_K, BLOCK_M, SQUARE, STOCHASTIC
        )
        _nvfp4_store(
            columnwise_ptr, columnwise_scale_ptr, packed, block_scale, K, M, tl.program_id(1), tl.program_id(0),
            BLOCK_K, BLOCK_M, SQUARE,
        )
