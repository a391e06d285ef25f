"""The @triton.jit quantization kernels behind fp8kernels.quantize (one program = one tile of x).

Every kernel loads a [BLOCK_M, BLOCK_K] tile of x once and writes both the rowwise codes
([M, K]) and the columnwise ones (the rowwise quantization of x.T, stored [K, M]) from it.
Casts, scales and the Hadamard transform come from fp8kernels._casts; amaxes are int32 bits of |x|,
NaN winning as torch.amax propagates it: block amaxes by a NaN-propagating float max (|.| is free
on it), tile and global ones by an integer max of the bits (integer max is float max there).

Why they are shaped this way (each choice read off the sm_90 SASS of Triton 3.6, the GPU's):
- The casts are bound by the integer pipe, so each tile first checks from its amaxes and
  scales that no value is NaN or past the rounding limit and then casts on the short
  IN_RANGE path of f32_to_code (`_cast`); tiles with NaN, inf or overflow take the full one.
  Compiled (HARDWARE_CAST, set by fp8kernels.quantize off the interpreter), that path is the GPU's
  fp8 cvt: sm_90 SASS of Triton 3.9 executes ~12 instead of ~18 instructions per element
  (tensorwise, 64x128 tile); the bit operations stay the spec the interpreter checks.
- One scale per tile (tensorwise, 128x128): the codes are cast once and transposed as whole
  int32 words. With PACK4 (M % 4 == 0) the tile's rows are interleaved so that a thread's four
  row repeats are four consecutive x rows, packed into one word in registers; shared memory
  then moves 4 bytes per access instead of 1.
- Scales along the columns (1x128, MXFP8, NVFP4): the bf16 tile is transposed first and each
  operand is split into runs (fp8kernels._casts.split_runs: element j of every 16 consecutive
  elements of an operand row, as 16 tensors). That puts each run in one thread, so Triton
  transposes with ldmatrix.trans, block maxima are register maxima, each block scale is
  computed once, and the codes are packed into int32 words in registers (`_store_runs`).
- Loads are 128-bit; stores are 128-bit (fp8) or 64-bit (a 16-block of e2m1); masks stay
  uniform per vector because Triton specializes sizes divisible by 16.
"""

from __future__ import annotations

import triton
import triton.language as tl

from fp8kernels._casts import (
    abs_bits,
    e2m1_top_code_doubled,
    e4m3_code_to_f32,
    e8m0_encode_multiplier,
    e8m0_from_amax_bits,
    f32_to_code,
    f32_to_e2m1_code,
    f32_to_e2m1_code_stochastic,
    f32_to_e4m3_code,
    hadamard_runs,
    hash32,
    join_runs,
    rounding_limit,
    row_amax_bits,
    runs_amax_bits,
    runs_f32,
    scale_from_amax,
    split_runs,
    to_f32,
)
from twinspec.formats import NVFP4_GLOBAL_MAX

_NVFP4_GLOBAL_MAX = tl.constexpr(NVFP4_GLOBAL_MAX)
_FP32_INF_BITS = tl.constexpr(0x7F800000)
_E2M1_LIMIT = tl.constexpr(7.0)  # the midpoint above e2m1's max 6


# ----------------------------------------------------------------------------- tiles


@triton.jit
def _load_tile(
    x_ptr, row_tile, M, K, stride_m, stride_k, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PACK4: tl.constexpr,
    EVEN: tl.constexpr = False,
):
    """Tile (row_tile, program_id(1)) of x in its own dtype (0 outside x) with its row and column indices (int64).

    PACK4: tile row q * (BLOCK_M // 4) + t holds x row 4t + q (see _store_transposed).
    EVEN: the tiles cover x exactly (no masks: fewer instructions and registers, see _nvfp4_kernel).
    """
    i = tl.arange(0, BLOCK_M)
    if PACK4:
        i = 4 * (i % (BLOCK_M // 4)) + i // (BLOCK_M // 4)
    rows = row_tile.to(tl.int64) * BLOCK_M + i
    cols = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    pointers = x_ptr + rows[:, None] * stride_m + cols[None, :] * stride_k
    if EVEN:
        return tl.load(pointers), rows, cols
    return tl.load(pointers, mask=(rows[:, None] < M) & (cols[None, :] < K), other=0.0), rows, cols


@triton.jit
def _store_tile(out_ptr, values, rows, cols, R, C, EVEN: tl.constexpr = False):
    """Store a tile into a row-major [R, C] buffer of out_ptr's type, masked to its bounds unless EVEN (inside)."""
    pointers = out_ptr + rows[:, None] * C + cols[None, :]
    if EVEN:
        tl.store(pointers, values.to(out_ptr.dtype.element_ty))
    else:
        tl.store(pointers, values.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < R) & (cols[None, :] < C))


@triton.jit
def _store_transposed(out_ptr, codes, rows, cols, M, K, row_tile, BLOCK_M: tl.constexpr, PACK4: tl.constexpr):
    """Store the transpose of tile row_tile's byte codes (int32 0..255) into the row-major [K, M] uint8 buffer."""
    if PACK4:  # rows interleaved by _load_tile: one int32 holds rows 4t..4t+3
        Q: tl.constexpr = BLOCK_M // 4
        # A sum, not shifts and ors of split pieces: for those, Triton 3.6 recomputes the whole
        # cast in the transposed layout instead of transposing the words.
        words = tl.sum(tl.reshape(codes, [4, Q, codes.shape[1]]) << (8 * tl.arange(0, 4))[:, None, None], axis=0)
        word_cols = row_tile.to(tl.int64) * Q + tl.arange(0, Q)
        _store_tile(out_ptr.to(tl.pointer_type(tl.int32)), tl.trans(words), cols, word_cols, K, M // 4)
    else:
        _store_tile(out_ptr, tl.trans(codes), cols, rows, K, M)


@triton.jit
def _horner(codes, first: tl.constexpr, count: tl.constexpr, BITS: tl.constexpr):
    """unit = (unit >> BITS) + code over codes[first:first + count]: one instruction a code (LEA.HI),
    the first code ends lowest."""
    unit = codes[first].to(tl.uint32, bitcast=True)
    for i in tl.static_range(1, count):
        unit = (unit >> BITS) + codes[first + i].to(tl.uint32, bitcast=True)
    return unit


@triton.jit
def _packed_runs(codes, BITS: tl.constexpr, WORDS: tl.constexpr, JUNK: tl.constexpr = 0):
    """Code runs (a tuple of int32 tensors [ROWS, COLS / n], each code in the top BITS bits) packed in
    operand order: little-endian int32 words [ROWS, COLS * BITS / 32] (WORDS), else bytes.

    Horner's rule (_horner) from the first code; a byte takes its codes' top bits down at the end.
    JUNK: the codes may carry junk below that bit (e2m1_top_code_doubled). Horner's shifts drop the
    junk of every code but the last TAIL, which are packed apart and masked once a unit; the junk
    left in each part stays below its codes, so it never carries into them.
    """
    N: tl.constexpr = len(codes)
    PER: tl.constexpr = 32 // BITS if WORDS else 8 // BITS  # codes per unit
    DOWN: tl.constexpr = 32 - BITS * PER  # the final shift of a unit
    TAIL: tl.constexpr = max(0, -((DOWN - JUNK) // BITS))  # codes shifted by less than JUNK in all
    TAIL_MASK: tl.constexpr = (0xFFFFFFFF << (32 - BITS * TAIL)) & 0xFFFFFFFF
    packed = ()
    for w in tl.static_range(N // PER):
        unit = _horner(codes, w * PER, PER - TAIL, BITS)
        if TAIL > 0:
            tail = _horner(codes, w * PER + PER - TAIL, TAIL, BITS) & TAIL_MASK
            unit = (unit >> (BITS * TAIL)) + tail
        packed = packed + ((unit >> DOWN).to(tl.int32),)
    return join_runs(packed)


@triton.jit
def _store_runs(
    out_ptr, codes, rows, first_col, R, C, BITS: tl.constexpr, WORDS: tl.constexpr, EVEN: tl.constexpr = False,
    JUNK: tl.constexpr = 0,
):
    """Store code runs (see _packed_runs) into a row-major [R, C * BITS / 8] byte buffer from operand
    column first_col: as int32 words (WORDS: C * BITS % 32 == 0), else as bytes (masked store).
    Returns the packed tile (NVFP4 16x16 transposes it for the columnwise copy)."""
    PER: tl.constexpr = 32 // BITS if WORDS else 8 // BITS
    if WORDS:
        out_ptr = out_ptr.to(tl.pointer_type(tl.int32))
    tile = _packed_runs(codes, BITS, WORDS, JUNK)
    cols = first_col // PER + tl.arange(0, tile.shape[1])
    _store_tile(out_ptr, tile, rows, cols, R, C // PER, EVEN)
    return tile


@triton.jit
def _tile_max(values):
    return tl.max(tl.max(values, axis=1), axis=0)


@triton.jit
def _all_below(values, limit):
    """Whether every |value| of a 2-D tensor is below limit (False if any is NaN)."""
    return _tile_max(values.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True) < limit


@triton.jit
def _reciprocal_rn(x):
    return tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x)


# ----------------------------------------------------------------------------- casts of a tile


@triton.jit
def _cast(
    y, in_range, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, HARDWARE: tl.constexpr,
):
    """f32_to_code of a tile, on the short IN_RANGE path when the whole tile is known to be in range."""
    if in_range:
        codes = f32_to_code(y, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, True, False, HARDWARE)
    else:
        codes = f32_to_code(y, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, False)
    return codes


@triton.jit
def _cast_runs(
    runs, scale, EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr,
    NAN_CODE: tl.constexpr, IN_RANGE: tl.constexpr, HARDWARE: tl.constexpr,
):
    """Codes of fp32 runs * scale (one scale per run element): a tuple like runs."""
    codes = ()
    for j in tl.static_range(len(runs)):
        y = runs[j] * scale
        codes = codes + (f32_to_code(y, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, IN_RANGE, True, HARDWARE),)
    return codes


@triton.jit
def _fp8_operand(
    runs, scale, in_range, out_ptr, rows, first_col, R, C,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    WORDS: tl.constexpr, HARDWARE: tl.constexpr,
):
    """Cast the runs of an operand tile (scale: one per block, shaped like a run) and store the bytes."""
    if in_range:
        codes = _cast_runs(runs, scale, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, True, HARDWARE)
    else:
        codes = _cast_runs(runs, scale, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, False, False)
    _store_runs(out_ptr, codes, rows, first_col, R, C, 8, WORDS)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _amax_kernel(
    x_ptr, amax_bits_ptr,  # x [M, K]; int32 [amax of x] (HADAMARD: [amax of x, amax of RHT(x.T)])
    M, K, stride_m, stride_k,
    HADAMARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Global amax by atomic max of the tiles' |x| bits (the first launch of current scaling and NVFP4)."""
    x, rows, cols = _load_tile(x_ptr, tl.program_id(0), M, K, stride_m, stride_k, BLOCK_M, BLOCK_K, False)
    tl.atomic_max(amax_bits_ptr, _tile_max(abs_bits(x)))
    if HADAMARD:  # the columnwise NVFP4 operand is RHT(x.T): its 16-tiles run down x's columns
        rotated = hadamard_runs(runs_f32(split_runs(tl.trans(x), 4)))
        tl.atomic_max(amax_bits_ptr + 1, _tile_max(runs_amax_bits(rotated)))


@triton.jit
def _group_rows(group_starts_ptr, group, ROW_UNIT: tl.constexpr):
    """(first row, row count) of a group; starts are stored in units of ROW_UNIT rows, so that Triton sees the
    count's divisibility (uniform masks, wide transposed stores) as it does for a whole tensor's M argument."""
    first = tl.load(group_starts_ptr + group)
    return first.to(tl.int64) * ROW_UNIT, (tl.load(group_starts_ptr + group + 1) - first) * ROW_UNIT


@triton.jit
def _group_tile(group_starts_ptr, num_groups, BLOCK_M: tl.constexpr, ROW_UNIT: tl.constexpr):
    """(group, row tile within that group) of this program: the groups own consecutive runs of row tiles,
    at least one each (an empty group's writes its scale_inv)."""
    pid = tl.program_id(0)
    group = pid * 0
    first_tile = pid * 0
    tiles_before = pid * 0
    for g in range(num_groups):
        _, rows = _group_rows(group_starts_ptr, g, ROW_UNIT)
        tiles = tl.maximum(tl.cdiv(rows, BLOCK_M), 1)
        here = (pid >= tiles_before) & (pid < tiles_before + tiles)
        group = tl.where(here, g, group)
        first_tile = tl.where(here, tiles_before, first_tile)
        tiles_before += tiles
    return group, pid - first_tile


@triton.jit
def _tensorwise_kernel(
    x_ptr, data_ptr, columnwise_ptr,  # x [M, K]; uint8 [M, K] and [K, M] (SPLIT: group g's [K, m_g] from K * start_g)
    given_ptr, amax_bits_ptr,  # fp32 (G,): the given scales or amaxes (GIVEN); int32 (G,): amax bits
    scale_inv_ptr, columnwise_scale_inv_ptr,  # fp32 (G,) each (SPLIT: SCALE_STRIDE apart): the same values, one buffer per copy
    group_starts_ptr, num_groups,  # SPLIT: int32 [G + 1], each group's first row, then M (/ ROW_UNIT); else unused
    M, K, stride_m, stride_k,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    FMAX: tl.constexpr, POWER_2: tl.constexpr, EPSILON: tl.constexpr,
    GIVEN: tl.constexpr,  # "scale" (delayed scaling), "amax" (to scale from: reduced over shards) or "" (none)
    SPLIT: tl.constexpr, ROW_UNIT: tl.constexpr,  # row groups of x, each quantized as a tensor of its own
    SCALE_STRIDE: tl.constexpr,  # SPLIT: fp32 elements between two groups' scale_inv (16-byte aligned for cuBLASLt)
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, PACK4: tl.constexpr, HARDWARE_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """x * scale -> fp8 rowwise and transposed; a given scale or amax lets x's amax fuse into this pass.

    SPLIT (TransformerEngine's split quantize): one launch quantizes every group of rows with its own scale.
    """
    row_tile = tl.program_id(0)
    if SPLIT:  # from here on x, M, the copies and the per-tensor values are this program's group's
        group, row_tile = _group_tile(group_starts_ptr, num_groups, BLOCK_M, ROW_UNIT)
        first_row, M = _group_rows(group_starts_ptr, group, ROW_UNIT)
        x_ptr += first_row * stride_m
        data_ptr += first_row * K
        columnwise_ptr += first_row * K
        given_ptr += group
        amax_bits_ptr += group
        scale_inv_ptr += group * SCALE_STRIDE
        columnwise_scale_inv_ptr += group * SCALE_STRIDE
    x, rows, cols = _load_tile(x_ptr, row_tile, M, K, stride_m, stride_k, BLOCK_M, BLOCK_K, PACK4)
    x = to_f32(x)
    if GIVEN == "":  # the global amax of the first launch: finite means every |x * scale| <= max (up to rounding)
        amax_bits = tl.load(amax_bits_ptr)
        scale = scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FMAX, POWER_2, EPSILON)
    else:  # in range when this tile's amax is (a given amax may come from a reduction that lost a NaN)
        amax_bits = _tile_max(abs_bits(x))
        tl.atomic_max(amax_bits_ptr, amax_bits)
        if GIVEN == "scale":
            scale = tl.load(given_ptr)
        else:
            scale = scale_from_amax(tl.load(given_ptr), FMAX, POWER_2, EPSILON)
    in_range = tl.abs(amax_bits.to(tl.float32, bitcast=True) * scale) < rounding_limit(MAX_BITS, MANTISSA_BITS)
    codes = _cast(x * scale, in_range, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, HARDWARE_CAST)
    if ROWWISE:
        _store_tile(data_ptr, codes, rows, cols, M, K)
    if COLUMNWISE:
        _store_transposed(columnwise_ptr, codes, rows, cols, M, K, row_tile, BLOCK_M, PACK4)
    if (row_tile == 0) & (tl.program_id(1) == 0):
        scale_inv = _reciprocal_rn(scale)
        if ROWWISE:
            tl.store(scale_inv_ptr, scale_inv)
        if COLUMNWISE:
            tl.store(columnwise_scale_inv_ptr, scale_inv)


@triton.jit
def _blockwise_kernel(
    x_ptr, data_ptr, scale_inv_ptr, columnwise_ptr, columnwise_scale_inv_ptr,
    M, K, stride_m, stride_k,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    FMAX: tl.constexpr, POWER_2: tl.constexpr, SQUARE: tl.constexpr,  # SQUARE: 128x128 blocks, else 1x128
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, PACK4: tl.constexpr, HARDWARE_CAST: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """fp32-scaled blocks; the tile is one 128x128 block, or 128 row blocks and 128 column blocks of 1x128.

    A block's scale is fmax / its amax, so a finite block is in range.
    """
    x, rows, cols = _load_tile(x_ptr, tl.program_id(0), M, K, stride_m, stride_k, BLOCK, BLOCK, PACK4 and SQUARE)
    row_blocks = tl.cdiv(M, BLOCK)
    col_blocks = tl.cdiv(K, BLOCK)
    if SQUARE:  # one scale; the columnwise copy is the transpose of the rowwise one
        values = to_f32(x)
        amax_bits = _tile_max(abs_bits(values))
        scale = scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FMAX, POWER_2, 0.0)
        codes = _cast(
            values * scale, amax_bits < _FP32_INF_BITS, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, HARDWARE_CAST,
        )
        if ROWWISE:
            _store_tile(data_ptr, codes, rows, cols, M, K)
            tl.store(scale_inv_ptr + tl.program_id(0) * col_blocks + tl.program_id(1), _reciprocal_rn(scale))
        if COLUMNWISE:
            _store_transposed(columnwise_ptr, codes, rows, cols, M, K, tl.program_id(0), BLOCK, PACK4)
            tl.store(columnwise_scale_inv_ptr + tl.program_id(1) * row_blocks + tl.program_id(0), _reciprocal_rn(scale))
    else:
        # The columnwise copy first: in this order the sm_90 build takes 135 registers, not 188.
        if COLUMNWISE:  # a 1x128 block of x.T per column of the tile: 8 runs of 16 down each column
            runs = runs_f32(split_runs(tl.trans(x), 4))  # 16 tensors [BLOCK, BLOCK // 16]
            partial = runs_amax_bits(runs)
            amax_bits = tl.max(partial, axis=1)
            scale = scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FMAX, POWER_2, 0.0)
            in_range = tl.max(amax_bits, axis=0) < _FP32_INF_BITS
            _fp8_operand(
                runs, tl.broadcast_to(scale[:, None], partial.shape), in_range, columnwise_ptr, cols,
                tl.program_id(0) * BLOCK, K, M, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, PACK4, HARDWARE_CAST,
            )
            # scale_inv [K, row_blocks] stored K-contiguous (fp8kernels.formats.row_block_scales)
            tl.store(columnwise_scale_inv_ptr + tl.program_id(0) * K + cols, _reciprocal_rn(scale), mask=cols < K)
        if ROWWISE:  # a 1x128 block per row of the tile
            values = to_f32(x)
            amax_bits = row_amax_bits(values, HARDWARE_CAST)
            scale = scale_from_amax(amax_bits.to(tl.float32, bitcast=True), FMAX, POWER_2, 0.0)
            in_range = tl.max(amax_bits, axis=0) < _FP32_INF_BITS
            codes = _cast(
                values * scale[:, None], in_range, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, HARDWARE_CAST,
            )
            _store_tile(data_ptr, codes, rows, cols, M, K)
            # scale_inv [M, col_blocks] stored M-contiguous (fp8kernels.formats.row_block_scales)
            tl.store(scale_inv_ptr + tl.program_id(1) * M + rows, _reciprocal_rn(scale), mask=rows < M)


@triton.jit
def _mxfp8_operand(
    tile, rows, first_col, R, C, data_ptr, scale_ptr,  # tile: [ROWS, COLS] of an operand [R, C]
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    INV_FMAX: tl.constexpr, MAX_EXPONENT: tl.constexpr, ROUND_UP: tl.constexpr, HARDWARE_CAST: tl.constexpr,
):
    """E8M0 scale per 32 elements of an operand row and the codes, stored (C % 32 == 0).

    Rounding the scale up keeps a finite block within max; rounding it down (floor) does not, so
    a floor tile is in range only when every block's amax * multiplier is.
    """
    runs = runs_f32(split_runs(tile, 4))  # 16 tensors [ROWS, COLS // 16]: half a block each
    ROWS: tl.constexpr = tile.shape[0]
    HALVES: tl.constexpr = tile.shape[1] // 16
    amax = tl.max(tl.reshape(runs_amax_bits(runs), [ROWS, HALVES // 2, 2]), axis=2)
    exponent = e8m0_from_amax_bits(amax, INV_FMAX, MAX_EXPONENT, ROUND_UP)
    multiplier = e8m0_encode_multiplier(exponent, ROUND_UP)
    in_range = _all_below(amax.to(tl.float32, bitcast=True) * multiplier, rounding_limit(MAX_BITS, MANTISSA_BITS))
    multiplier = tl.reshape(tl.broadcast_to(multiplier[:, :, None], [ROWS, HALVES // 2, 2]), [ROWS, HALVES])
    _fp8_operand(
        runs, multiplier, in_range, data_ptr, rows, first_col, R, C,
        EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, True, HARDWARE_CAST,
    )
    scale_cols = first_col // 32 + tl.arange(0, amax.shape[1])
    _store_tile(scale_ptr, exponent, rows, scale_cols, R, C // 32)


@triton.jit
def _mxfp8_kernel(
    x_ptr, data_ptr, scale_ptr, columnwise_ptr, columnwise_scale_ptr,  # scales: uint8 [M, K/32], [K, M/32]
    M, K, stride_m, stride_k,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    INV_FMAX: tl.constexpr, MAX_EXPONENT: tl.constexpr, ROUND_UP: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, HARDWARE_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """E8M0 scale per 32 elements along rows (rowwise) and along columns (columnwise) of one tile."""
    x, rows, cols = _load_tile(x_ptr, tl.program_id(0), M, K, stride_m, stride_k, BLOCK_M, BLOCK_K, False)
    if ROWWISE:
        _mxfp8_operand(
            x, rows, tl.program_id(1) * BLOCK_K, M, K, data_ptr, scale_ptr,
            EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, INV_FMAX, MAX_EXPONENT, ROUND_UP, HARDWARE_CAST,
        )
    if COLUMNWISE:
        _mxfp8_operand(
            tl.trans(x), cols, tl.program_id(0) * BLOCK_M, K, M, columnwise_ptr, columnwise_scale_ptr,
            EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE, INV_FMAX, MAX_EXPONENT, ROUND_UP, HARDWARE_CAST,
        )


@triton.jit
def _e2m1_runs(values, encode, index, key, STOCHASTIC: tl.constexpr, IN_RANGE: tl.constexpr):
    """e2m1 codes (top nibble) of runs * encode; stochastic rounding hashes (index + j) ^ key for run j.
    IN_RANGE: encode is twice the block encode and every |value * encode| is below 14; the codes carry
    junk below bit 9 (e2m1_top_code_doubled)."""
    codes = ()
    for j in tl.static_range(len(values)):
        if STOCHASTIC:
            code = f32_to_e2m1_code_stochastic(values[j] * encode, hash32((index + j) ^ key)) << 28
        elif IN_RANGE:
            code = e2m1_top_code_doubled(values[j] * encode)
        else:
            code = f32_to_e2m1_code(values[j] * encode, True)
        codes = codes + (code,)
    return codes


@triton.jit
def _nvfp4_global_encode(amax_bits_ptr):
    return scale_from_amax(tl.load(amax_bits_ptr).to(tl.float32, bitcast=True), _NVFP4_GLOBAL_MAX, False, 0.0)


@triton.jit
def _nvfp4_codes(
    tile, first_row, first_col, C, global_encode, key,  # tile: [ROWS, COLS] of an operand [R, C]
    SQUARE: tl.constexpr, HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr, HARDWARE_CAST: tl.constexpr,
):
    """E2M1 codes (runs, top nibble) and e4m3 block scales ([ROWS or ROWS / 16, COLS / 16]) of an operand tile.

    HARDWARE_CAST: the block scales are encoded and decoded by the GPU's e4m3 cvt.
    """
    ROWS: tl.constexpr = tile.shape[0]
    BLOCKS: tl.constexpr = tile.shape[1] // 16
    values = runs_f32(split_runs(tile, 4))  # 16 tensors [ROWS, BLOCKS]
    if HADAMARD:
        values = hadamard_runs(values)
    amax = runs_amax_bits(values)
    if SQUARE:  # 16x16 blocks: the max over 16 operand rows too
        amax = tl.max(tl.reshape(amax, [ROWS // 16, 16, BLOCKS]), axis=1)
    amax = amax.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, tl.full(amax.shape, 6.0, tl.float32)) * global_encode
    block_scale = f32_to_e4m3_code(scale, HARDWARE_CAST)
    block_scale_f32 = e4m3_code_to_f32(block_scale, HARDWARE_CAST)
    encode = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32) * global_encode, block_scale_f32)
    encode = tl.where(block_scale_f32 == 0, 0.0, encode)
    # The short path scales by 2 * encode (e2m1_top_code_doubled); an encode that doubles to inf
    # fails the test (inf, or NaN against an amax of 0) and takes the general path.
    in_range = _all_below(amax * (encode * 2.0), 2 * _E2M1_LIMIT)
    if SQUARE:  # each block's encode on its 16 operand rows
        encode = tl.reshape(tl.broadcast_to(encode[:, None, :], [ROWS // 16, 16, BLOCKS]), [ROWS, BLOCKS])
    if STOCHASTIC:  # element index in the operand, mod 2^32, hashed with the seed's key
        rows = first_row + tl.arange(0, ROWS)
        index = (rows[:, None] * C + first_col + 16 * tl.arange(0, BLOCKS)[None, :]).to(tl.uint32)
        codes = _e2m1_runs(values, encode, index, key.to(tl.uint32, bitcast=True), True, False)
    elif in_range:
        codes = _e2m1_runs(values, encode * 2.0, encode, key, False, True)
    else:
        codes = _e2m1_runs(values, encode, encode, key, False, False)
    return codes, block_scale


@triton.jit
def _store_block_scales(block_scale, first_row, first_col, R, C, scale_ptr, SQUARE: tl.constexpr, EVEN: tl.constexpr):
    """Store an operand tile's e4m3 block scales: one row per operand row, or per 16 of them (SQUARE)."""
    scale_rows = first_row // (16 if SQUARE else 1) + tl.arange(0, block_scale.shape[0])
    scale_cols = first_col // 16 + tl.arange(0, block_scale.shape[1])
    _store_tile(scale_ptr, block_scale, scale_rows, scale_cols, tl.cdiv(R, 16) if SQUARE else R, C // 16, EVEN)


@triton.jit
def _swap_units(words, D: tl.constexpr, BITS: tl.constexpr, LOW: tl.constexpr):
    """A round of the 8x8 nibble transpose: words r and r + D (r & D == 0) trade units of BITS bits
    (LOW: the even units' mask). r keeps its even units and takes r + D's into its odd slots; r + D
    gets r's odd units into its even slots. Right shifts are masked, so int32's sign fill never shows."""
    out = ()
    for r in tl.static_range(8):
        if r & D:
            out = out + (((words[r - D] >> BITS) & LOW) | (words[r] & ~LOW),)
        else:
            out = out + ((words[r] & LOW) | ((words[r + D] << BITS) & ~LOW),)
    return out


@triton.jit
def _transposed_nibble_words(words):
    """int32 words [R, C / 8] of a nibble matrix (8 nibbles of a row each, first lowest) -> the words
    [C, R / 8] of its transpose. The words cross shared memory whole (8 nibbles a move); each thread
    then holds 8 rows' words of 8 columns and transposes that 8x8 block of nibbles in registers, by
    swapping halves, then bytes, then nibbles: fewer instructions (sm_90 SASS) than moving each
    nibble through shared memory as a byte."""
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    rows8 = split_runs(tl.trans(words), 3)  # 8 tensors [W, R / 8]: j = the words of rows 8h + j
    columns8 = _swap_units(_swap_units(_swap_units(rows8, 4, 16, 0x0000FFFF), 2, 8, 0x00FF00FF), 1, 4, 0x0F0F0F0F)
    joined = tl.reshape(join_runs(columns8), [W, R // 8, 8])  # [g, h, c]: column 8g + c, rows 8h..8h + 7
    return tl.reshape(tl.permute(joined, [0, 2, 1]), [W * 8, R // 8])


@triton.heuristics({"EVEN": lambda args: args["M"] % args["BLOCK_M"] == 0 and args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _nvfp4_kernel(
    x_ptr, data_ptr, scale_ptr, columnwise_ptr, columnwise_scale_ptr, amax_bits_ptr,
    key_ptr,  # int32 (1,): hash32(seed), for stochastic rounding; read from memory so a CUDA graph follows it
    M, K, stride_m, stride_k,
    SQUARE: tl.constexpr, HADAMARD: tl.constexpr, STOCHASTIC: tl.constexpr,
    ROWWISE: tl.constexpr, COLUMNWISE: tl.constexpr, HARDWARE_CAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
):
    """E2M1 with e4m3 block scales under the global scale from _amax_kernel; RHT on the columnwise operand.

    16x16 blocks without RHT and stochastic rounding give x.T the transposed codes and scales of x,
    so both copies come from one cast.
    """
    x, rows, cols = _load_tile(x_ptr, tl.program_id(0), M, K, stride_m, stride_k, BLOCK_M, BLOCK_K, False, EVEN)
    first_row = tl.program_id(0).to(tl.int64) * BLOCK_M
    first_col = tl.program_id(1) * BLOCK_K
    SHARED: tl.constexpr = SQUARE and not HADAMARD and not STOCHASTIC and ROWWISE and COLUMNWISE
    global_encode = _nvfp4_global_encode(amax_bits_ptr)
    key = tl.load(key_ptr) if STOCHASTIC else 0
    if ROWWISE:
        codes, block_scale = _nvfp4_codes(
            x, first_row, first_col, K, global_encode, key, SQUARE, False, STOCHASTIC, HARDWARE_CAST,
        )
        _store_block_scales(block_scale, first_row, first_col, M, K, scale_ptr, SQUARE, EVEN)
        words = _store_runs(data_ptr, codes, rows, first_col, M, K, 4, True, EVEN, 9)  # [BLOCK_M, BLOCK_K / 8]
        if SHARED:
            _store_block_scales(tl.trans(block_scale), first_col, first_row, K, M, columnwise_scale_ptr, SQUARE, EVEN)
            word_cols = tl.program_id(0) * (BLOCK_M // 8) + tl.arange(0, BLOCK_M // 8)
            words = _transposed_nibble_words(words)
            _store_tile(columnwise_ptr.to(tl.pointer_type(tl.int32)), words, cols, word_cols, K, M // 8, EVEN)
    if COLUMNWISE and not SHARED:  # x.T, whose global amax is the second one when it is rotated
        if HADAMARD:  # RHT(x.T) has an amax of its own
            global_encode = _nvfp4_global_encode(amax_bits_ptr + 1)
        codes, block_scale = _nvfp4_codes(
            tl.trans(x), first_col.to(tl.int64), first_row, M, global_encode, key, SQUARE, HADAMARD, STOCHASTIC,
            HARDWARE_CAST,
        )
        _store_block_scales(block_scale, first_col, first_row, K, M, columnwise_scale_ptr, SQUARE, EVEN)
        _store_runs(columnwise_ptr, codes, cols, first_row, K, M, 4, True, EVEN, 9)
