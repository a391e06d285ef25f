"""Grouped scaled FP8 GEMM: out[g] = A[g] @ B[g]^T for G independent groups, in ONE Triton launch.

The groups may differ in M, N and K (MoE experts: fprop and dgrad differ in M, wgrad in K); each
group's operands carry their own scales. All groups share one scaling family and the formats of
A and of B (one recipe quantized them), which the kernel takes as constexprs.

The spec is `scaled_mm_loop`: `kernels.gemm.scaled_mm` once per group (its docstring gives the
fprop/dgrad/wgrad layouts and the arithmetic). The launch computes the same per-tile math with
kernels.gemm's pieces (`_operand_tile` decodes a K tile of any family, the same epilogue), so
under the Triton interpreter each output equals scaled_mm's bit for bit; on CUDA scaled_mm may
take cuBLASLt instead, and the two agree within fp32 accumulation rounding.

How one launch covers all groups: a table (int64 [15, G]) holds each group's buffer
addresses, sizes and strides; program i walks the groups' tile counts to find its group and its
tile in that group (GROUP_M tile rows at a time, so B tiles stay in L2). A group with M or N of 0
has no tiles; one with K = 0 writes its bias (or zeros). Per-tensor and 128-block operands whose K
is not a multiple of 16 (an MoE wgrad reduces over each expert's token count) are copied with zero
codes appended, so that every load is 16 bytes wide and the K loop pipelines: zeros add nothing.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels._backend import Backend, autotune_configs, backend_for, interpreting
from kernels._casts import f32_to_bf16_bits, format_constants
from kernels.formats import SCHEME_BLOCKS
from kernels.gemm import (
    _GROUP_M,
    _TILES,
    _kernel_codes,
    _nvfp4_decode_factor,
    _scale_row_stride,
    _scaled_dot,
    _tune_big_problems_only,
    scaled_mm,
)
from kernels.gemm_reference import GemmOperand, check_gemm, gemm_operand
from kernels.reference import Quantized

# Rows of the per-group table: addresses, then sizes and strides (elements).
_A, _B, _A_SCALE, _B_SCALE, _A_AMAX, _B_AMAX, _BIAS, _OUT = (tl.constexpr(i) for i in range(8))
_M, _N, _K, _A_STRIDE, _B_STRIDE, _A_SCALE_STRIDE, _B_SCALE_STRIDE = (tl.constexpr(i) for i in range(8, 15))
_ALIGNED_ROWS = tuple(row.value for row in (_A, _B, _K, _A_STRIDE, _B_STRIDE))  # what ALIGNED promises divides by 16
_K_MULTIPLE = 16  # per-tensor and 128-block operands get their K padded with zero codes to this

# How the kernel types each address (torch dtype of the buffer -> pointer kind)
_KINDS = {
    torch.float8_e4m3fn: "e4m3",
    torch.float8_e5m2: "e5m2",
    torch.uint8: "u8",
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
}


@triton.jit
def _entry(table_ptr, ROW: tl.constexpr, num_groups, group):
    """Row ROW of the table for `group` (int64)."""
    return tl.load(table_ptr + ROW * num_groups + group)


@triton.jit
def _typed(address, KIND: tl.constexpr):
    """An int64 address as a pointer to KIND's element type."""
    if KIND == "e4m3":
        ptr = address.to(tl.pointer_type(tl.float8e4nv))
    elif KIND == "e5m2":
        ptr = address.to(tl.pointer_type(tl.float8e5))
    elif KIND == "fp32":
        ptr = address.to(tl.pointer_type(tl.float32))
    elif KIND == "bf16":
        ptr = address.to(tl.pointer_type(tl.bfloat16))
    elif KIND == "fp16":
        ptr = address.to(tl.pointer_type(tl.float16))
    elif KIND == "i16":  # bf16 outputs are written as rounded bit patterns
        ptr = address.to(tl.pointer_type(tl.int16))
    else:
        ptr = address.to(tl.pointer_type(tl.uint8))
    return ptr


@triton.jit
def _find_tile(table_ptr, num_groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(group, tile index within the group) of this program: groups own consecutive runs of programs."""
    pid = tl.program_id(0).to(tl.int64)
    group = tl.program_id(0) * 0
    first_tile = pid * 0
    tiles_before = pid * 0
    for g in range(num_groups):
        tiles = tl.cdiv(_entry(table_ptr, _M, num_groups, g), BLOCK_M) * tl.cdiv(
            _entry(table_ptr, _N, num_groups, g), BLOCK_N
        )
        here = (pid >= tiles_before) & (pid < tiles_before + tiles)
        group = tl.where(here, g, group)
        first_tile = tl.where(here, tiles_before, first_tile)
        tiles_before += tiles
    return group, pid - first_tile


@triton.jit
def _grouped_scaled_mm_kernel(
    table_ptr, num_groups,  # int64 [15, num_groups]: the rows _A .. _B_SCALE_STRIDE
    M, N, K,  # autotuning keys only (total rows, largest N, largest K): each group reads its own
    SCALING: tl.constexpr, SCALE_K: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    A_EXPONENT_BITS: tl.constexpr, A_MANTISSA_BITS: tl.constexpr, A_MAX_BITS: tl.constexpr, A_NAN_CODE: tl.constexpr,
    B_EXPONENT_BITS: tl.constexpr, B_MANTISSA_BITS: tl.constexpr, B_MAX_BITS: tl.constexpr, B_NAN_CODE: tl.constexpr,
    A_KIND: tl.constexpr, B_KIND: tl.constexpr, SCALE_KIND: tl.constexpr, BIAS_KIND: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    ALIGNED: tl.constexpr,  # operand addresses, row strides (bytes) and K are multiples of 16: wide, pipelined loads
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of one group's output: kernels.gemm's K loop and epilogue on that group."""
    group, tile = _find_tile(table_ptr, num_groups, BLOCK_M, BLOCK_N)
    m = _entry(table_ptr, _M, num_groups, group)
    n = _entry(table_ptr, _N, num_groups, group)
    k = _entry(table_ptr, _K, num_groups, group)
    # The tile's place in the group: GROUP_M tile rows at a time down each tile column.
    tiles_n = tl.cdiv(n, BLOCK_N)
    band = tile // (GROUP_M * tiles_n)
    band_rows = tl.minimum(tl.cdiv(m, BLOCK_M) - band * GROUP_M, GROUP_M)
    within = tile % (GROUP_M * tiles_n)
    rows = (band * GROUP_M + within % band_rows) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (within // band_rows) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_rows = rows % m  # past the edge: wrapped, in bounds; only the store is masked
    b_rows = cols % n
    a_ptr = _typed(_entry(table_ptr, _A, num_groups, group), A_KIND)
    b_ptr = _typed(_entry(table_ptr, _B, num_groups, group), B_KIND)
    a_scale_ptr = _typed(_entry(table_ptr, _A_SCALE, num_groups, group), SCALE_KIND)
    b_scale_ptr = _typed(_entry(table_ptr, _B_SCALE, num_groups, group), SCALE_KIND)
    a_stride = _entry(table_ptr, _A_STRIDE, num_groups, group)
    b_stride = _entry(table_ptr, _B_STRIDE, num_groups, group)
    if ALIGNED:  # what kernels.gemm gets from Triton's specialization of its pointer and int arguments
        a_ptr, b_ptr = tl.multiple_of(a_ptr, 16), tl.multiple_of(b_ptr, 16)
        a_stride, b_stride = tl.multiple_of(a_stride, 16), tl.multiple_of(b_stride, 16)
        k = tl.multiple_of(k, 16)  # the K mask then covers whole 16-element runs
    a_scale_stride = _entry(table_ptr, _A_SCALE_STRIDE, num_groups, group)
    b_scale_stride = _entry(table_ptr, _B_SCALE_STRIDE, num_groups, group)
    acc = _scaled_dot(
        a_ptr, a_scale_ptr, a_rows, a_stride, a_scale_stride,
        b_ptr, b_scale_ptr, b_rows, b_stride, b_scale_stride, k,
        SCALING, SCALE_K, A_SCALE_ROWS, A_EXPONENT_BITS, A_MANTISSA_BITS, A_NAN_CODE,
        B_SCALE_ROWS, B_EXPONENT_BITS, B_MANTISSA_BITS, B_NAN_CODE, DOT_IN_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if SCALING == "nvfp4":
        a_amax_ptr = _typed(_entry(table_ptr, _A_AMAX, num_groups, group), "fp32")
        b_amax_ptr = _typed(_entry(table_ptr, _B_AMAX, num_groups, group), "fp32")
        acc = acc * _nvfp4_decode_factor(a_amax_ptr) * _nvfp4_decode_factor(b_amax_ptr)
    if HAS_BIAS:
        bias_ptr = _typed(_entry(table_ptr, _BIAS, num_groups, group), BIAS_KIND)
        acc += tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
    inside = (rows[:, None] < m) & (cols[None, :] < n)
    offsets = rows[:, None] * n + cols[None, :]
    if OUT_BF16:
        out_ptr = _typed(_entry(table_ptr, _OUT, num_groups, group), "i16")
        tl.store(out_ptr + offsets, f32_to_bf16_bits(acc).to(tl.int16, bitcast=True), mask=inside)
    else:
        tl.store(_typed(_entry(table_ptr, _OUT, num_groups, group), "fp32") + offsets, acc, mask=inside)


@functools.cache
def _tuned(family: str):
    """The kernel autotuned over kernels.gemm's tiles for the family, built on first use."""
    return triton.autotune(
        configs=autotune_configs(_TILES[family]),
        key=["M", "N", "K"],
        prune_configs_by={"early_config_prune": _tune_big_problems_only},
    )(_grouped_scaled_mm_kernel)


def _as_list(name: str, values: Sequence | None, groups: int) -> list | None:
    if values is None:
        return None
    if isinstance(values, Tensor) or not isinstance(values, Sequence) or len(values) != groups:
        raise ValueError(f"{name} must be a list of {groups} tensors (one per group), or None; got {values!r:.80}")
    return list(values)


def _checked_groups(
    a: Sequence[Quantized], b: Sequence[Quantized], a_columnwise: bool, b_columnwise: bool,
    out_dtype: torch.dtype, bias: Sequence[Tensor] | None, out: Sequence[Tensor] | None,
) -> tuple[list[GemmOperand], list[GemmOperand], list | None, list | None]:  # fmt: skip
    """Each group checked as scaled_mm checks it, plus what one launch needs: one family and format set."""
    if isinstance(a, Quantized) or isinstance(b, Quantized) or len(a) != len(b) or not len(a):
        raise ValueError("a and b must be lists of the same number (>= 1) of Quantized operands, one per group")
    a_ops = [gemm_operand(q, a_columnwise, f"a[{g}]") for g, q in enumerate(a)]
    b_ops = [gemm_operand(q, b_columnwise, f"b[{g}]") for g, q in enumerate(b)]
    bias, out = _as_list("bias", bias, len(a)), _as_list("out", out, len(a))
    first = (a_ops[0].scheme, a_ops[0].fmt, b_ops[0].scheme, b_ops[0].fmt, a_ops[0].data.device)
    for g, (a_op, b_op) in enumerate(zip(a_ops, b_ops, strict=True)):
        check_gemm(a_op, b_op, out_dtype, None if bias is None else bias[g])
        kinds = (a_op.scheme, a_op.fmt, b_op.scheme, b_op.fmt, a_op.data.device)
        if kinds != first:
            raise ValueError(
                f"group {g} is (a {kinds[0]} {kinds[1]}, b {kinds[2]} {kinds[3]}) on {kinds[4]} but group 0 is "
                f"(a {first[0]} {first[1]}, b {first[2]} {first[3]}) on {first[4]}: quantize every group with one "
                "recipe on one device"
            )
        if out is not None:
            o = out[g]
            if not isinstance(o, Tensor) or o.shape != (a_op.rows, b_op.rows) or o.dtype != out_dtype:
                raise ValueError(
                    f"out[{g}] must be a {out_dtype} tensor of shape [{a_op.rows}, {b_op.rows}], got "
                    f"{o.dtype if isinstance(o, Tensor) else type(o).__name__} {list(getattr(o, 'shape', []))}"
                )
            if not o.is_contiguous() or o.device != a_op.data.device:
                raise ValueError(
                    f"out[{g}] must be contiguous and on {a_op.data.device}: pass a row slice of one tensor"
                )
    if bias is not None and len({t.dtype for t in bias}) > 1:
        raise ValueError(f"the groups' biases have dtypes {sorted({str(t.dtype) for t in bias})}: use one dtype")
    return a_ops, b_ops, bias, out


def scaled_mm_loop(
    a: Sequence[Quantized],
    b: Sequence[Quantized],
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Sequence[Tensor] | None = None,
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """The spec of grouped_scaled_mm: kernels.gemm.scaled_mm on each group (written into `out` when given)."""
    _, _, bias, out = _checked_groups(a, b, a_columnwise, b_columnwise, out_dtype, bias, out)
    results = []
    for g, (a_g, b_g) in enumerate(zip(a, b, strict=True)):
        result = scaled_mm(
            a_g, b_g, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype,
            bias=None if bias is None else bias[g],
        )  # fmt: skip
        results.append(result if out is None else out[g].copy_(result))
    return results


def _pad_k(op: GemmOperand, k: int) -> GemmOperand:
    """op with zero codes appended along K up to k: they decode to 0 in the per-tensor and 128-block families."""
    data = torch.zeros(op.rows, k, dtype=op.data.dtype, device=op.data.device)
    data[:, : op.k] = op.data
    return dataclasses.replace(op, data=data, k=k)


def _aligned_k(a_op: GemmOperand, b_op: GemmOperand) -> tuple[GemmOperand, GemmOperand]:
    """Both operands with K a multiple of 16 (an MoE wgrad's K is a token count): without it, the loads
    go byte by byte and the K loop is not pipelined. MXFP8 and NVFP4 blocks already tile K by 32 and 16."""
    if a_op.family not in ("tensorwise", "block") or a_op.k % _K_MULTIPLE == 0:
        return a_op, b_op
    k = triton.cdiv(a_op.k, _K_MULTIPLE) * _K_MULTIPLE
    return _pad_k(a_op, k), _pad_k(b_op, k)


def _grouped_triton(
    a_ops: list[GemmOperand], b_ops: list[GemmOperand], out_dtype: torch.dtype, bias: list | None, out: list
) -> None:
    """One launch writing every out[g] (contiguous, allocated)."""
    a_ops, b_ops = map(list, zip(*(_aligned_k(a_op, b_op) for a_op, b_op in zip(a_ops, b_ops, strict=True))))
    dot_in_fp32 = interpreting()
    first_a, first_b = a_ops[0], b_ops[0]
    a_codes = [_kernel_codes(op, dot_in_fp32) for op in a_ops]
    b_codes = [_kernel_codes(op, dot_in_fp32) for op in b_ops]
    out_bits = [o.view(torch.int16) if out_dtype == torch.bfloat16 else o for o in out]
    biases = bias if bias is not None else out  # never read without HAS_BIAS
    columns = [
        [a_codes[g].data_ptr(), b_codes[g].data_ptr(), a_op.scale_inv.data_ptr(), b_op.scale_inv.data_ptr(),
         (a_op.global_amax if a_op.global_amax is not None else a_op.scale_inv).data_ptr(),
         (b_op.global_amax if b_op.global_amax is not None else b_op.scale_inv).data_ptr(),
         biases[g].data_ptr(), out_bits[g].data_ptr(), a_op.rows, b_op.rows, a_op.k,
         a_op.data.stride(0), b_op.data.stride(0), _scale_row_stride(a_op.scale_inv), _scale_row_stride(b_op.scale_inv)]
        for g, (a_op, b_op) in enumerate(zip(a_ops, b_ops, strict=True))
    ]  # fmt: skip
    device = first_a.data.device
    table = torch.tensor(columns, dtype=torch.int64).T.contiguous().to(device)
    sizes = [(op.rows, b_op.rows) for op, b_op in zip(a_ops, b_ops, strict=True)]

    def grid(meta):
        return (sum(triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]) for m, n in sizes),)

    block = SCHEME_BLOCKS[first_a.scheme]
    _tuned(first_a.family)[grid](
        table, len(a_ops), sum(m for m, _ in sizes), max(n for _, n in sizes), max(op.k for op in a_ops),
        SCALING=first_a.family, SCALE_K=0 if block is None else block[1],
        A_SCALE_ROWS=max(first_a.scale_rows, 1), B_SCALE_ROWS=max(first_b.scale_rows, 1),
        **format_constants(first_a.fmt, "A_"), **format_constants(first_b.fmt, "B_"),
        A_KIND=_KINDS[a_codes[0].dtype], B_KIND=_KINDS[b_codes[0].dtype], SCALE_KIND=_KINDS[first_a.scale_inv.dtype],
        BIAS_KIND=_KINDS[biases[0].dtype], HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16,
        DOT_IN_FP32=dot_in_fp32, ALIGNED=all(column[row] % 16 == 0 for column in columns for row in _ALIGNED_ROWS),
        GROUP_M=_GROUP_M,
    )  # fmt: skip


def grouped_scaled_mm(
    a: Sequence[Quantized],
    b: Sequence[Quantized],
    *,
    a_columnwise: bool = False,
    b_columnwise: bool = False,
    out_dtype: torch.dtype = torch.bfloat16,
    bias: Sequence[Tensor] | None = None,
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    """out[g] = A[g] @ B[g]^T (+ bias[g]) for every group in one launch; `out`: row slices of one tensor, say."""
    a_ops, b_ops, bias, out = _checked_groups(a, b, a_columnwise, b_columnwise, out_dtype, bias, out)
    if backend_for(a_ops[0].data.device) is Backend.REFERENCE:
        return scaled_mm_loop(
            a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, out_dtype=out_dtype, bias=bias, out=out
        )
    if out is None:
        device = a_ops[0].data.device
        out = [torch.empty(a_op.rows, b_op.rows, dtype=out_dtype, device=device) for a_op, b_op in zip(a_ops, b_ops)]
    if any(a_op.rows * b_op.rows for a_op, b_op in zip(a_ops, b_ops, strict=True)):
        _grouped_triton(a_ops, b_ops, out_dtype, bias, out)
    return out


__all__ = ["grouped_scaled_mm", "scaled_mm_loop"]
