"""Scaled FP8 GEMM in Triton: out[M, N] = A[M, K] @ B[N, K]^T of dequantized operands, fp32 accumulation.

The spec is `fp8kernels.gemm_reference.scaled_mm` (same signature; its docstring lists the fprop, dgrad
and wgrad operand layouts). Results match it within fp32 accumulation rounding, not bit for bit.

How each scaling family reaches the tensor cores (one kernel; the family is a constexpr):

- tensorwise: fp8 x fp8 dots over the whole K; the two per-tensor scale_invs multiply once at the end.
- block (1x128 and/or 128x128): BLOCK_K divides 128, so a K tile sits in one scale block; each
  tile's fp8 x fp8 partial product is scaled by a_scale[m, kb] * b_scale[n, kb] and added in fp32.
- In both, Hopper's fp8 MMA sums in reduced precision until promoted to fp32; Triton's sm90 default
  never promotes (max_num_imprecise_acc = 2^30), so the dots here promote once per K tile
  (<= 128 elements), like TransformerEngine's split accumulator.
- mxfp8, nvfp4: EMULATED. Hopper has no MXFP8/NVFP4 tensor cores, so the prologue of each K tile
  dequantizes the codes by their block scales into bf16 (exact: e4m3/e5m2 times a power of two,
  e2m1 times an e4m3 scale, both fit bf16's 8-bit significand) and the dot runs in bf16. NVFP4's
  fp32 global scales are not exact in bf16; they multiply the accumulator once at the end.

Under the Triton interpreter every code is decoded with integer bit operations and the dot runs
in fp32: the interpreter's bf16 dot is wrong and its fp8 upcast turns NaN/inf codes into finite
numbers (../shared/notes/cpu-feasibility.md). bf16 outputs are rounded to nearest even with bit
operations (the interpreter's `.to(tl.bfloat16)` truncates).

On CUDA, `CUDA_PATHS` (a measured table) sends each family where it runs fastest: per-tensor and
128-block GEMMs to cuBLASLt (`torch._scaled_mm`, or `torch.nn.functional.scaled_mm` for the 1x128 x 1x128
wgrad pair) where it takes the case (a block GEMM's bias added by `_finish` after an fp32 product); MXFP8
and NVFP4 to `_scaled_mm_dequantized`: one launch writes each operand dequantized to bf16 (the same exact
values as this kernel's prologue), cuBLAS multiplies them on the bf16 tensor cores with fp32 output, and
one launch applies NVFP4's global scales, the bias and the output rounding (`_finish_kernel`, this
kernel's epilogue). Everything else runs this kernel.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from fp8kernels import gemm_reference
from fp8kernels._backend import Backend, backend_for, interpreting
from fp8kernels._casts import code_to_f32, e4m3_code_to_f32, f32_to_bf16_bits, format_constants, scale_from_amax
from fp8kernels._launch import Launcher
from fp8kernels.formats import TORCH_DTYPES
from twinspec.formats import NVFP4_GLOBAL_MAX, SCHEME_BLOCKS
from fp8kernels.gemm_reference import GemmOperand, check_gemm, gemm_operand
from fp8kernels.reference import Quantized

# How scaled_mm runs each scaling family on CUDA, measured by benchmarks/bench/bench_gemm.py (8192^3, bf16 out,
# one H200). "cublaslt" where _torch_scaled_mm_takes the case (else this Triton kernel); "dequantize":
# _scaled_mm_dequantized; "triton": this kernel.
# - tensorwise: torch._scaled_mm 1273 TFLOP/s, this kernel 934 (2026-11-30).
# - block 1x128 x 128x128 (fprop, dgrad): torch._scaled_mm 1103, this kernel 535 (2026-11-30). The block modes
#   take no bias: with one, cuBLASLt writes fp32 and _finish adds it (LayerNormMLP's biased fprops had fallen to
#   this kernel: 16.9 ms of its 65.9 ms step each, benchmarks/profile/profile_mlp.py, 2026-12-03).
# - block 1x128 x 1x128 (wgrad): F.scaled_mm 958 with our rows-contiguous scales, 949 with row-major ones (two
#   relayout launches; torch 2.11's _scaled_mm refuses the pair), this kernel 338 (2026-12-03).
# - mxfp8, nvfp4 (emulated): dequantize + cuBLAS bf16 697 / 629, this kernel 242 / 160 (2026-12-02).
CUDA_PATHS = {"tensorwise": "cublaslt", "block": "cublaslt", "mxfp8": "dequantize", "nvfp4": "dequantize"}
# 128-block pairs (A, B rows per scale) cuBLASLt runs, and through which torch entry point: _scaled_mm infers
# 1x128 x 128x128 from the scales' shapes; only F.scaled_mm (torch >= 2.10) names 1x128 x 1x128.
_CUBLAS_BLOCK_PAIRS = {(1, 128): "_scaled_mm", (1, 1): "F.scaled_mm"}
# cuBLASLt reads the 128x128 scales [K/128, N/128] with a leading dim of K/128 floats that must be
# 16-byte aligned: torch 2.11 does not check it, and with K/128 = 6 or 10 (K = 768, 1280) it returned
# wrong products (relative error 0.4 to 5e7 on the H200, found by benchmarks/diagnose/check_step_gemms.py when the
# 125M Llama trained NaN from step 0 under Float8BlockScaling). So K/128 must be a multiple of 4.
_BLOCKWISE_K_MULTIPLE = 4 * 128
_cublas_refused: set[tuple[int, int]] = set()  # block pairs this torch build refused: this kernel from then on

_NVFP4_GLOBAL_MAX = tl.constexpr(NVFP4_GLOBAL_MAX)
_GROUP_M = 8  # tiles of A rows swept together, so their B tiles stay in L2
_TUNE_FROM = 2048 * 2048  # output elements from which autotuning pays for its compiles

# Autotune candidates, the first one is the interpreter's (large tiles: it pays per program).
# fp8 dots: BLOCK_K must divide 128 (a block-scaled K tile must sit in one scale block).
_FP8_TILES = [
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 5},
]
# emulated (bf16 dots after a dequantizing prologue): BLOCK_K a multiple of 32 (MXFP8 blocks)
_EMULATED_TILES = [
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 4},
]
_TILES = {"tensorwise": _FP8_TILES, "block": _FP8_TILES, "mxfp8": _EMULATED_TILES, "nvfp4": _EMULATED_TILES}


@triton.jit
def _e8m0_to_f32(code):
    """2^(code - 127) exactly (code 0 is the fp32 subnormal 2^-127); NaN for 0xFF."""
    bits = tl.where(code == 0, 0x00400000, code << 23)
    return tl.where(code == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _tile_coordinates(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(tile row, tile column) of tile `pid` of an [M, N] output, GROUP_M tile rows at a time down each
    tile column (so the B tiles of those rows stay in L2)."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    programs_per_group = GROUP_M * tiles_n
    first_m = (pid // programs_per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    within = pid % programs_per_group
    return first_m + within % group_rows, within // group_rows


@triton.jit
def _apply_block_scales(values, scales, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr):
    """values [ROWS, BLOCK_K] times one scale per SCALE_K consecutive elements ([ROWS, BLOCK_K / SCALE_K])."""
    blocks = tl.reshape(values, [ROWS, BLOCK_K // SCALE_K, SCALE_K]) * scales[:, :, None]
    return tl.reshape(blocks, [ROWS, BLOCK_K])


@triton.jit
def _operand_tile(
    data_ptr, scale_ptr, rows, row_stride, scale_row_stride, k0, K,
    SCALING: tl.constexpr, SCALE_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The operand's [ROWS, BLOCK_K] tile at K offset k0 as tl.dot takes it; 0 past K.

    fp8 as stored for tensorwise and block (their scales apply outside the dot); MXFP8 and NVFP4
    dequantized by their block scales. DOT_IN_FP32: everything decoded to fp32 by bit operations.
    """
    if SCALING == "nvfp4":  # two e2m1 codes per byte, element 2i in the low nibble
        byte_cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        byte_ptrs = data_ptr + rows[:, None] * row_stride + byte_cols[None, :]
        packed = tl.load(byte_ptrs, mask=byte_cols[None, :] < K // 2, other=0).to(tl.int32)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), [ROWS, BLOCK_K])
        values = code_to_f32(codes, 2, 1, -1)
    else:  # fp8 codes, typed fp8 unless DOT_IN_FP32
        cols = k0 + tl.arange(0, BLOCK_K)
        values = tl.load(data_ptr + rows[:, None] * row_stride + cols[None, :], mask=cols[None, :] < K, other=0.0)
        if DOT_IN_FP32:
            values = code_to_f32(values.to(tl.int32), EXPONENT_BITS, MANTISSA_BITS, NAN_CODE)
        elif SCALING == "mxfp8":
            values = values.to(tl.float32)  # the hardware's fp8 upcast is exact
    if SCALING == "mxfp8" or SCALING == "nvfp4":
        scale_cols = k0 // SCALE_K + tl.arange(0, BLOCK_K // SCALE_K)
        scale_ptrs = scale_ptr + (rows // SCALE_ROWS)[:, None] * scale_row_stride + scale_cols[None, :]
        scale_codes = tl.load(scale_ptrs, mask=scale_cols[None, :] < K // SCALE_K, other=0).to(tl.int32)
        if SCALING == "mxfp8":
            values = _apply_block_scales(values, _e8m0_to_f32(scale_codes), ROWS, BLOCK_K, SCALE_K)
        else:
            values = _apply_block_scales(values, e4m3_code_to_f32(scale_codes), ROWS, BLOCK_K, SCALE_K)
        if not DOT_IN_FP32:
            values = values.to(tl.bfloat16)  # exact (see the module docstring)
    return values


@triton.jit
def _nvfp4_decode_factor(amax_ptr):
    """1 / global_encode of an NVFP4 copy, from its global amax."""
    global_encode = scale_from_amax(tl.load(amax_ptr), _NVFP4_GLOBAL_MAX, False, 0.0)
    return tl.math.div_rn(tl.full(global_encode.shape, 1.0, tl.float32), global_encode)


@triton.jit
def _scaled_dot(
    a_ptr, a_scale_ptr, a_rows, a_row_stride, a_scale_row_stride,
    b_ptr, b_scale_ptr, b_rows, b_row_stride, b_scale_row_stride, K,
    SCALING: tl.constexpr, SCALE_K: tl.constexpr,
    A_SCALE_ROWS: tl.constexpr, A_EXPONENT_BITS: tl.constexpr, A_MANTISSA_BITS: tl.constexpr, A_NAN_CODE: tl.constexpr,
    B_SCALE_ROWS: tl.constexpr, B_EXPONENT_BITS: tl.constexpr, B_MANTISSA_BITS: tl.constexpr, B_NAN_CODE: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """A_tile @ B_tile^T over K in fp32, block scales applied per K tile and per-tensor ones at the end
    (NVFP4's global scales are the caller's: where its amaxes live differs per kernel)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = _operand_tile(
            a_ptr, a_scale_ptr, a_rows, a_row_stride, a_scale_row_stride, k0, K, SCALING, SCALE_K, A_SCALE_ROWS,
            A_EXPONENT_BITS, A_MANTISSA_BITS, A_NAN_CODE, DOT_IN_FP32, BLOCK_M, BLOCK_K,
        )
        b = _operand_tile(
            b_ptr, b_scale_ptr, b_rows, b_row_stride, b_scale_row_stride, k0, K, SCALING, SCALE_K, B_SCALE_ROWS,
            B_EXPONENT_BITS, B_MANTISSA_BITS, B_NAN_CODE, DOT_IN_FP32, BLOCK_N, BLOCK_K,
        )
        if SCALING == "block":  # the K tile lies in scale block k0 // 128 of both operands
            a_scale = tl.load(a_scale_ptr + (a_rows // A_SCALE_ROWS) * a_scale_row_stride + k0 // SCALE_K)
            b_scale = tl.load(b_scale_ptr + (b_rows // B_SCALE_ROWS) * b_scale_row_stride + k0 // SCALE_K)
            partial = tl.dot(a, tl.trans(b), max_num_imprecise_acc=BLOCK_K)
            acc += partial * (a_scale[:, None] * b_scale[None, :])
        else:
            acc = tl.dot(a, tl.trans(b), acc, max_num_imprecise_acc=BLOCK_K)
    if SCALING == "tensorwise":
        acc = acc * (tl.load(a_scale_ptr) * tl.load(b_scale_ptr))
    return acc


@triton.jit
def _epilogue(
    acc, rows, cols, M, N, a_amax_ptr, b_amax_ptr, bias_ptr, out_ptr,
    GLOBAL_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
):  # fmt: skip
    """out[rows, cols] (contiguous [M, N]) = acc times NVFP4's global scales, plus the bias, rounded once."""
    if GLOBAL_SCALES:
        acc = acc * _nvfp4_decode_factor(a_amax_ptr) * _nvfp4_decode_factor(b_amax_ptr)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    out_ptrs = out_ptr + rows[:, None] * N + cols[None, :]
    if OUT_BF16:
        tl.store(out_ptrs, f32_to_bf16_bits(acc).to(tl.int16, bitcast=True), mask=inside)
    else:
        tl.store(out_ptrs, acc, mask=inside)


@triton.jit
def _scaled_mm_kernel(
    a_ptr, b_ptr,  # A [M, K], B [N, K], K contiguous: fp8, or uint8 codes (decoded here; nvfp4 two per byte)
    a_scale_ptr, b_scale_ptr,  # each copy's scale_inv, laid out as docs/quantization.md says
    a_amax_ptr, b_amax_ptr,  # nvfp4: each copy's global amax, fp32 (1,); unused otherwise
    bias_ptr, out_ptr,  # bias [N], any float dtype; out [M, N] contiguous, fp32 or bf16 bits (int16)
    M, N, K,
    a_row_stride, b_row_stride,  # elements (bytes) between operand rows
    a_scale_row_stride, b_scale_row_stride,  # elements between rows of the scale tensors
    SCALING: tl.constexpr,  # "tensorwise" | "block" | "mxfp8" | "nvfp4"
    SCALE_K: tl.constexpr,  # K elements per scale (block 128, mxfp8 32, nvfp4 16)
    A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,  # operand rows per scale (1, 16 or 128)
    A_EXPONENT_BITS: tl.constexpr, A_MANTISSA_BITS: tl.constexpr, A_MAX_BITS: tl.constexpr, A_NAN_CODE: tl.constexpr,
    B_EXPONENT_BITS: tl.constexpr, B_MANTISSA_BITS: tl.constexpr, B_MAX_BITS: tl.constexpr, B_NAN_CODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of out: the K loop, then per-tensor or global scales, bias, store."""
    tile_m, tile_n = _tile_coordinates(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Operand rows past M (N) wrap around: loads stay in bounds unmasked; only the store is masked.
    a_rows = rows % M
    b_rows = cols % N
    acc = _scaled_dot(
        a_ptr, a_scale_ptr, a_rows, a_row_stride, a_scale_row_stride,
        b_ptr, b_scale_ptr, b_rows, b_row_stride, b_scale_row_stride, K,
        SCALING, SCALE_K, A_SCALE_ROWS, A_EXPONENT_BITS, A_MANTISSA_BITS, A_NAN_CODE,
        B_SCALE_ROWS, B_EXPONENT_BITS, B_MANTISSA_BITS, B_NAN_CODE, DOT_IN_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    _epilogue(acc, rows, cols, M, N, a_amax_ptr, b_amax_ptr, bias_ptr, out_ptr, SCALING == "nvfp4", HAS_BIAS, OUT_BF16)


@triton.jit
def _dequantize_kernel(
    data_ptr, scale_ptr, out_ptr,  # codes [rows, K] (nvfp4: two per byte); their block scales; out bf16 bits [rows, K]
    ROWS, K, row_stride, scale_row_stride,
    SCALING: tl.constexpr, SCALE_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, NAN_CODE: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_ROWS, BLOCK_K] tile of an MXFP8/NVFP4 operand times its block scales, as bf16: the GEMM
    kernel's prologue (`_operand_tile`) stored instead of multiplied."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    k0 = tl.program_id(1) * BLOCK_K
    values = _operand_tile(
        data_ptr, scale_ptr, rows % ROWS, row_stride, scale_row_stride, k0, K, SCALING, SCALE_K, SCALE_ROWS,
        EXPONENT_BITS, MANTISSA_BITS, NAN_CODE, DOT_IN_FP32, BLOCK_ROWS, BLOCK_K,
    )  # fmt: skip
    cols = k0 + tl.arange(0, BLOCK_K)
    inside = (rows[:, None] < ROWS) & (cols[None, :] < K)
    bits = f32_to_bf16_bits(values.to(tl.float32)).to(tl.int16, bitcast=True)  # exact: the values fit bf16
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], bits, mask=inside)


@triton.jit
def _finish_kernel(
    acc_ptr, a_amax_ptr, b_amax_ptr, bias_ptr, out_ptr, M, N,
    GLOBAL_SCALES: tl.constexpr, HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The GEMM kernel's epilogue on an fp32 product [M, N] that cuBLAS wrote."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.load(acc_ptr + rows[:, None] * N + cols[None, :], mask=(rows[:, None] < M) & (cols[None, :] < N))
    _epilogue(acc, rows, cols, M, N, a_amax_ptr, b_amax_ptr, bias_ptr, out_ptr, GLOBAL_SCALES, HAS_BIAS, OUT_BF16)


# the epilogue kernels of the cuBLAS paths, launched without Triton's front end once compiled (fp8kernels._launch)
_DEQUANTIZE, _FINISH = Launcher(_dequantize_kernel), Launcher(_finish_kernel)


def _tune_big_problems_only(configs, named_args, **kwargs):
    """Autotuning compiles every candidate; below _TUNE_FROM outputs the launch dominates: take the first."""
    return configs if named_args["M"] * named_args["N"] >= _TUNE_FROM else configs[:1]


@functools.cache
def _tuned(family: str) -> Launcher:
    """The kernel autotuned over its family's tiles, built on first use (the list depends on the backend)."""
    prune = {"early_config_prune": _tune_big_problems_only}
    return Launcher(_scaled_mm_kernel, _TILES[family], ["M", "N", "K"], prune_configs_by=prune)


def _kernel_codes(operand: GemmOperand, dot_in_fp32: bool) -> Tensor:
    """The operand bytes as the kernel reads them: fp8 where the hardware takes fp8, else uint8 codes."""
    if dot_in_fp32 or operand.family == "nvfp4":
        return operand.data
    return operand.data.view(TORCH_DTYPES[operand.fmt])


def _scale_row_stride(scale_inv: Tensor) -> int:
    return scale_inv.stride(0) if scale_inv.dim() == 2 else 0


def _scaled_mm_triton(
    a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: Tensor | None, tile: dict | None = None
) -> Tensor:
    """The Triton kernel on checked operands; `tile`: one of _TILES instead of autotuning (tests, benchmarks)."""
    M, N, K = a.rows, b.rows, a.k
    out = torch.empty(M, N, dtype=out_dtype, device=a.data.device)
    dot_in_fp32 = interpreting()
    block = SCHEME_BLOCKS[a.scheme]
    # The kernel reads a scale row's blocks adjacent: 1x128 scales arrive rows-contiguous (for cuBLASLt,
    # fp8kernels.formats.row_block_scales) and are copied here, on the path of the cases cuBLASLt does not take.
    a_scale, b_scale = a.scale_inv.contiguous(), b.scale_inv.contiguous()

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    kernel, launch_options = (_tuned(a.family), {}) if tile is None else (_scaled_mm_kernel, tile)
    kernel[grid](
        _kernel_codes(a, dot_in_fp32), _kernel_codes(b, dot_in_fp32), a_scale, b_scale,
        a.global_amax if a.global_amax is not None else a_scale,
        b.global_amax if b.global_amax is not None else b_scale,
        bias.contiguous() if bias is not None else out,
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out,
        M, N, K, a.data.stride(0), b.data.stride(0), _scale_row_stride(a_scale), _scale_row_stride(b_scale),
        SCALING=a.family, SCALE_K=0 if block is None else block[1],
        A_SCALE_ROWS=max(a.scale_rows, 1), B_SCALE_ROWS=max(b.scale_rows, 1),
        **format_constants(a.fmt, "A_"), **format_constants(b.fmt, "B_"),
        HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16, DOT_IN_FP32=dot_in_fp32, GROUP_M=_GROUP_M,
        **launch_options,
    )  # fmt: skip
    return out


def _k_contiguous(data: Tensor) -> bool:
    """Row-major with unit K stride and a 16-byte aligned start: what cuBLASLt's fp8 GEMM reads."""
    return data.stride(-1) == 1 and data.stride(0) == data.shape[-1] and data.data_ptr() % 16 == 0


def _block_pair_takes(a: GemmOperand, b: GemmOperand) -> bool:
    """cuBLASLt's 128-block modes (_CUBLAS_BLOCK_PAIRS): e4m3 only (torch refuses e5m2 there), whole K blocks,
    scale leading dims 16-byte aligned."""
    pair = (a.scale_rows, b.scale_rows)
    if pair not in _CUBLAS_BLOCK_PAIRS or pair in _cublas_refused or (a.fmt, b.fmt) != ("e4m3", "e4m3"):
        return False
    if pair == (1, 1):  # both 1x128 scales are read M- (N-) major: leading dims M and N
        return a.k % 128 == 0 and a.rows % 4 == 0 and b.rows % 4 == 0
    return a.k % _BLOCKWISE_K_MULTIPLE == 0 and b.rows % 128 == 0 and a.rows % 4 == 0


def _torch_scaled_mm_takes(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: Tensor | None) -> bool:
    """Whether CUDA's cuBLASLt runs this case, per CUDA_PATHS (CPU's _scaled_mm accepts more: CUDA's rules here)."""
    if CUDA_PATHS[a.family] != "cublaslt":
        return False
    if a.family == "block":  # the block modes take no bias: _torch_scaled_mm adds it in our epilogue
        case_ok = _block_pair_takes(a, b)
    else:  # no bias with fp32 out
        case_ok = bias is None or (out_dtype == torch.bfloat16 and bias.dtype == torch.bfloat16)
    return (
        case_ok
        and not (a.fmt == "e5m2" and b.fmt == "e5m2")  # cuBLASLt has no e5m2 x e5m2
        and a.k % 16 == 0  # K and N multiples of 16
        and b.rows % 16 == 0
        and _k_contiguous(a.data)  # A row-major and B^T column-major: sm90's only fp8 layout
        and _k_contiguous(b.data)
    )


def _torch_scaled_mm(
    a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: Tensor | None, out: Tensor | None = None
) -> Tensor:
    """FP8 through cuBLASLt; its scales are our scale_invs (it multiplies by them); written into `out` if given."""
    a_fp8 = a.data.view(TORCH_DTYPES[a.fmt])
    b_fp8_t = b.data.view(TORCH_DTYPES[b.fmt]).t()  # [K, N] column-major
    assert b_fp8_t.stride(0) == 1 and a.k % 16 == 0 and b.rows % 16 == 0, "checked by _torch_scaled_mm_takes"
    scale_a, scale_b = a.scale_inv, b.scale_inv
    if a.family == "block":
        if bias is not None:  # the block modes take no bias: an fp32 product, then our epilogue adds it (one rounding)
            return _finish(_torch_scaled_mm(a, b, torch.float32, None), out_dtype, bias, out=out)
        # cuBLASLt reads 1x128 scales M-major (N-major; our quantizers write them so, the relayout copies only
        # others') and 128x128 ones as [K/128, N/128]
        scale_a = a.scale_inv.t().contiguous().t()
        scale_b = b.scale_inv.t().contiguous().t() if b.scale_rows == 1 else b.scale_inv.t()
        if _CUBLAS_BLOCK_PAIRS[(a.scale_rows, b.scale_rows)] == "F.scaled_mm":
            product = _block_1x128_pair(a_fp8, b_fp8_t, scale_a, scale_b, out_dtype)
            return product if out is None else out.copy_(product)
    kwargs = {} if out is None else {"out": out}
    return torch._scaled_mm(a_fp8, b_fp8_t, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype, **kwargs)


def _block_1x128_pair(a_fp8: Tensor, b_fp8_t: Tensor, scale_a: Tensor, scale_b: Tensor, out_dtype: torch.dtype):
    """1x128 x 1x128 through torch.nn.functional.scaled_mm (a RuntimeError where this torch has none)."""
    functional = torch.nn.functional
    if not hasattr(functional, "scaled_mm"):
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.scaled_mm")
    block = functional.ScalingType.BlockWise1x128
    return functional.scaled_mm(a_fp8, b_fp8_t, scale_a, block, scale_b, block, output_dtype=out_dtype)


def _dequantized_bf16(operand: GemmOperand) -> Tensor:
    """An MXFP8/NVFP4 operand [rows, K] times its block scales, in bf16 (exact); NVFP4's global scale not applied."""
    out = torch.empty(operand.rows, operand.k, dtype=torch.bfloat16, device=operand.data.device)
    dot_in_fp32 = interpreting()
    block_rows, block_k = (64, 128) if not dot_in_fp32 else (128, 256)  # the interpreter pays per program
    grid = (triton.cdiv(operand.rows, block_rows), triton.cdiv(operand.k, block_k))
    _DEQUANTIZE[grid](
        _kernel_codes(operand, dot_in_fp32), operand.scale_inv, out.view(torch.int16),
        operand.rows, operand.k, operand.data.stride(0), _scale_row_stride(operand.scale_inv),
        SCALING=operand.family, SCALE_K=SCHEME_BLOCKS[operand.scheme][1], SCALE_ROWS=max(operand.scale_rows, 1),
        **{name: value for name, value in format_constants(operand.fmt, "").items() if name != "MAX_BITS"},
        DOT_IN_FP32=dot_in_fp32, BLOCK_ROWS=block_rows, BLOCK_K=block_k,
    )  # fmt: skip
    return out


def _scaled_mm_dequantized(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: Tensor | None) -> Tensor:
    """MXFP8/NVFP4 on bf16 tensor cores: both operands dequantized to bf16, multiplied by cuBLAS into fp32,
    then this kernel's epilogue. The products of bf16 values are exact in fp32, so the result differs from
    the spec only in the order of the fp32 sums."""
    a16, b16 = _dequantized_bf16(a), _dequantized_bf16(b)
    if a16.is_cuda:
        product = torch.mm(a16, b16.t(), out_dtype=torch.float32)
    else:  # the interpreter's tests: the same exact products, summed in fp32
        product = a16.float() @ b16.float().t()
    global_amaxes = (a.global_amax, b.global_amax) if a.family == "nvfp4" else None
    return _finish(product, out_dtype, bias, global_amaxes)


def _finish(
    product: Tensor, out_dtype: torch.dtype, bias: Tensor | None,
    global_amaxes: tuple[Tensor, Tensor] | None = None, out: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """An fp32 product [M, N] times NVFP4's global scales, plus the bias, rounded once to out_dtype (into
    `out` if given): this kernel's epilogue, in one launch after a cuBLAS product."""
    if out_dtype == torch.float32 and global_amaxes is None and bias is None:
        return product if out is None else out.copy_(product)
    M, N = product.shape
    out = torch.empty(M, N, dtype=out_dtype, device=product.device) if out is None else out
    block_m, block_n = 64, 128

    def grid(meta):
        return triton.cdiv(M, block_m), triton.cdiv(N, block_n)

    a_amax, b_amax = global_amaxes or (product, product)
    _FINISH[grid](
        product, a_amax, b_amax, bias.contiguous() if bias is not None else product,
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out, M, N,
        GLOBAL_SCALES=global_amaxes is not None, HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return out


def cuda_path(a: GemmOperand, b: GemmOperand, out_dtype: torch.dtype, bias: Tensor | None) -> str:
    """Where scaled_mm runs these checked operands on CUDA: "cublaslt", "dequantize" or "triton" (CUDA_PATHS,
    then the case's shape: cuBLASLt only where it takes it)."""
    path = CUDA_PATHS[a.family]
    if path == "cublaslt":
        return "cublaslt" if _torch_scaled_mm_takes(a, b, out_dtype, bias) else "triton"
    return path


def scaled_mm(
    a: Quantized,
    b: Quantized,
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Tensor | None = None,
) -> Tensor:
    """out[M, N] = A @ B^T (+ bias) on dequantized values, fp32 accumulation, for the fprop/dgrad/wgrad layouts."""
    a_operand, b_operand = gemm_operand(a, a_columnwise, "a"), gemm_operand(b, b_columnwise, "b")
    check_gemm(a_operand, b_operand, out_dtype, bias)
    backend = backend_for(a_operand.data.device)
    if backend is Backend.REFERENCE or min(a_operand.rows, b_operand.rows, a_operand.k) == 0:
        return gemm_reference.scaled_mm(
            a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias
        )
    path = cuda_path(a_operand, b_operand, out_dtype, bias)
    if backend is Backend.INTERPRETER and path == "cublaslt":
        path = "triton"  # cuBLASLt is CUDA's alone; the interpreter (CPU tests) runs the other paths as CUDA does
    if path == "dequantize":
        return _scaled_mm_dequantized(a_operand, b_operand, out_dtype, bias)
    if path == "cublaslt":
        try:
            return _torch_scaled_mm(a_operand, b_operand, out_dtype, bias)
        except (RuntimeError, ValueError):
            if a_operand.family != "block":
                raise
            _cublas_refused.add((a_operand.scale_rows, b_operand.scale_rows))  # this torch build: ours from now on
    return _scaled_mm_triton(a_operand, b_operand, out_dtype, bias)


__all__ = ["CUDA_PATHS", "cuda_path", "scaled_mm"]
