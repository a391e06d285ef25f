"""Grouped scaled FP8 GEMM: out[g] = A[g] @ B[g]^T for G groups: cuBLASLt per group, or ONE Triton launch.

The groups may differ in M, N and K (MoE experts: fprop and dgrad differ in M, wgrad in K); each
group's operands carry their own scales. All groups share one scaling family and the formats of
A and of B (one recipe quantized them), which the kernel takes as constexprs.

The spec is `scaled_mm_loop`: `fp8kernels.gemm.scaled_mm` once per group (its docstring gives the
fprop/dgrad/wgrad layouts and the arithmetic). A measured choice (`GROUPS_USE_TORCH_SCALED_MM`): on CUDA,
where fp8kernels.gemm would send every group to cuBLASLt (`_torch_scaled_mm_takes`), one `torch._scaled_mm`
per group writes out[g] in place; everything else (1x128 x 1x128 wgrad, MXFP8, NVFP4, odd shapes, the
interpreter) runs as ONE Triton launch, with fp8kernels.gemm's per-tile math (`_operand_tile`, the same
epilogue): under the interpreter it equals scaled_mm bit for bit; on CUDA the paths agree within fp32
accumulation rounding.

How one launch covers all groups: a table (int64 [16, G]) holds each group's sizes, row strides
and buffer offsets; program i walks the groups' tile counts to find its group and its tile in that
group (GROUP_M tile rows at a time, so B tiles stay in L2). A group with M or N of 0 has no tiles;
one with K = 0 writes its bias (or zeros). Per-tensor and 128-block operands whose K is not a
multiple of 16 (an MoE wgrad reduces over each expert's token count) are copied once, with zero codes
appended (zeros add nothing), before either path: cuBLASLt needs it as much as the launch.

Why it is as fast as the dense kernel: every buffer is a real tensor argument (the group's buffer at
the lowest address) plus a table offset, so Triton specializes pointer types and alignment as it does
for fp8kernels.gemm; offsets and row strides are stored in units of up to 16 bytes and K in units of 16,
multiplied back by constexprs, so 16-byte alignment is proven by the arithmetic. (The previous design
cast table addresses to pointers and declared alignment with `tl.multiple_of` on helper results;
Triton 3.6, the H200's version, drops such hints when it inlines the helper: byte loads, no
pipelining, 20x slower.) Compiled offline for sm_90 (Triton 3.6 and 3.9), the grouped and the dense
kernel have the same main loop: 16-byte cp.async loads in a 3-stage pipeline feeding wgmma (fp8), and
16-byte bf16 output stores.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch
import triton
import triton.language as tl
from torch import Tensor

from fp8kernels._backend import Backend, backend_for, interpreting
from fp8kernels._casts import f32_to_bf16_bits, format_constants
from fp8kernels._launch import Launcher
from twinspec.formats import SCHEME_BLOCKS
from fp8kernels.gemm import (
    _GROUP_M,
    _TILES,
    _kernel_codes,
    _nvfp4_decode_factor,
    _scale_row_stride,
    _scaled_dot,
    _tile_coordinates,
    _torch_scaled_mm,
    _torch_scaled_mm_takes,
    _tune_big_problems_only,
    scaled_mm,
)
from fp8kernels.gemm_reference import GemmOperand, check_gemm, gemm_operand
from fp8kernels.reference import Quantized

# Measured choice (benchmarks/bench/bench_grouped_gemm.py, one H200, 2026-11-30; GroupedLinear's problem: 8 groups
# [2861, 1024, 3517, 611, 2290, 1999, 3077, 1005] of 16384 tokens, 4096 -> 14336, tensorwise e4m3, bf16 out):
# fprop, dense torch._scaled_mm 1.50 ms, a loop of 8 torch._scaled_mm 1.60 ms, the one Triton launch 4.43 ms (the
# dense Triton kernel 4.28); wgrad (K split), dense torch._scaled_mm 1.48 ms, the launch 5.38 ms. So per-group
# cuBLASLt where it takes every group, written in place: a copy of the 470 MB fprop output would add 0.22 ms.
GROUPS_USE_TORCH_SCALED_MM = True

# Rows of the per-group table (int64 [_TABLE_ROWS, G]): each buffer's offset (elements) from its base
# argument, then sizes and row strides. _A, _B, _OUT and the strides of A, B and out are in units of
# A_UNIT, B_UNIT, OUT_UNIT elements; K in units of _K_MULTIPLE.
_A, _B, _A_SCALE, _B_SCALE, _A_AMAX, _B_AMAX, _BIAS, _OUT = (tl.constexpr(i) for i in range(8))
_M, _N, _K_UNITS, _A_STRIDE, _B_STRIDE, _OUT_STRIDE = (tl.constexpr(i) for i in range(8, 14))
_A_SCALE_STRIDE, _B_SCALE_STRIDE = tl.constexpr(14), tl.constexpr(15)
_K_MULTIPLE = tl.constexpr(16)  # every K is one (per-tensor and 128-block operands get zero codes appended)
_ACCESS_BYTES = 16  # the widest load and store: a unit is at most this many bytes


@triton.jit
def _entry(table_ptr, ROW: tl.constexpr, num_groups, group):
    """Row ROW of the table for `group` (int64)."""
    return tl.load(table_ptr + ROW * num_groups + group)


@triton.jit
def _size(table_ptr, ROW: tl.constexpr, num_groups, group):
    """A size row of the table as int32: tile and row arithmetic stays 32-bit (addresses are 64-bit)."""
    return _entry(table_ptr, ROW, num_groups, group).to(tl.int32)


@triton.jit
def _find_tile(table_ptr, num_groups, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(group, tile index within the group) of this program: groups own consecutive runs of programs."""
    pid = tl.program_id(0)
    group = pid * 0
    first_tile = pid * 0
    tiles_before = pid * 0
    for g in range(num_groups):
        m = _size(table_ptr, _M, num_groups, g)
        tiles = tl.cdiv(m, BLOCK_M) * tl.cdiv(_size(table_ptr, _N, num_groups, g), BLOCK_N)
        here = (pid >= tiles_before) & (pid < tiles_before + tiles)
        group = tl.where(here, g, group)
        first_tile = tl.where(here, tiles_before, first_tile)
        tiles_before += tiles
    return group, pid - first_tile


@triton.jit
def _grouped_scaled_mm_kernel(
    a_ptr, b_ptr,  # bases: each group's A and B lie at table offsets from these (see fp8kernels.gemm's kernel)
    a_scale_ptr, b_scale_ptr, a_amax_ptr, b_amax_ptr,  # bases of the scale_invs and nvfp4 global amaxes
    bias_ptr, out_ptr,  # bases of the biases and of the outputs (fp32, or bf16 bits as int16)
    table_ptr, num_groups,  # int64 [_TABLE_ROWS, num_groups]: offsets, sizes, strides (see the rows above)
    M, N, K,  # autotuning keys only (total rows, largest N, largest K): each group reads its own
    SCALING: tl.constexpr, SCALE_K: tl.constexpr, A_SCALE_ROWS: tl.constexpr, B_SCALE_ROWS: tl.constexpr,
    A_EXPONENT_BITS: tl.constexpr, A_MANTISSA_BITS: tl.constexpr, A_MAX_BITS: tl.constexpr, A_NAN_CODE: tl.constexpr,
    B_EXPONENT_BITS: tl.constexpr, B_MANTISSA_BITS: tl.constexpr, B_MAX_BITS: tl.constexpr, B_NAN_CODE: tl.constexpr,
    HAS_BIAS: tl.constexpr, OUT_BF16: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    A_UNIT: tl.constexpr, B_UNIT: tl.constexpr, OUT_UNIT: tl.constexpr,  # elements per table unit (<= 16 bytes)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """One [BLOCK_M, BLOCK_N] tile of one group's output: fp8kernels.gemm's K loop and epilogue on that group."""
    group, tile = _find_tile(table_ptr, num_groups, BLOCK_M, BLOCK_N)
    m = _size(table_ptr, _M, num_groups, group)
    n = _size(table_ptr, _N, num_groups, group)
    tile_m, tile_n = _tile_coordinates(tile, m, n, BLOCK_M, BLOCK_N, GROUP_M)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Units times constexprs: Triton proves the 16-byte alignment of each K run and output row.
    k = _size(table_ptr, _K_UNITS, num_groups, group) * _K_MULTIPLE
    acc = _scaled_dot(
        a_ptr + _entry(table_ptr, _A, num_groups, group) * A_UNIT,
        a_scale_ptr + _entry(table_ptr, _A_SCALE, num_groups, group),
        rows % m,  # past the edge: wrapped, in bounds; only the store is masked
        _entry(table_ptr, _A_STRIDE, num_groups, group) * A_UNIT,
        _entry(table_ptr, _A_SCALE_STRIDE, num_groups, group),
        b_ptr + _entry(table_ptr, _B, num_groups, group) * B_UNIT,
        b_scale_ptr + _entry(table_ptr, _B_SCALE, num_groups, group),
        cols % n,
        _entry(table_ptr, _B_STRIDE, num_groups, group) * B_UNIT,
        _entry(table_ptr, _B_SCALE_STRIDE, num_groups, group),
        k, SCALING, SCALE_K, A_SCALE_ROWS, A_EXPONENT_BITS, A_MANTISSA_BITS, A_NAN_CODE,
        B_SCALE_ROWS, B_EXPONENT_BITS, B_MANTISSA_BITS, B_NAN_CODE, DOT_IN_FP32, BLOCK_M, BLOCK_N, BLOCK_K,
    )  # fmt: skip
    if SCALING == "nvfp4":
        a_amax = a_amax_ptr + _entry(table_ptr, _A_AMAX, num_groups, group)
        b_amax = b_amax_ptr + _entry(table_ptr, _B_AMAX, num_groups, group)
        acc = acc * _nvfp4_decode_factor(a_amax) * _nvfp4_decode_factor(b_amax)
    # n again (out[g] is contiguous, so it is the row stride), as a multiple of OUT_UNIT that Triton can see:
    # masks constant over OUT_UNIT columns let the stores be 16 bytes wide.
    n_seen = _entry(table_ptr, _OUT_STRIDE, num_groups, group) * OUT_UNIT
    if HAS_BIAS:
        bias = bias_ptr + _entry(table_ptr, _BIAS, num_groups, group)
        acc += tl.load(bias + cols, mask=cols < n_seen, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + _entry(table_ptr, _OUT, num_groups, group) * OUT_UNIT
    out_ptrs = out + rows[:, None] * n_seen + cols[None, :]
    inside = (rows[:, None] < m) & (cols[None, :] < n_seen)
    if OUT_BF16:
        tl.store(out_ptrs, f32_to_bf16_bits(acc).to(tl.int16, bitcast=True), mask=inside)
    else:
        tl.store(out_ptrs, acc, mask=inside)


@functools.cache
def _tuned(family: str) -> Launcher:
    """The kernel autotuned over fp8kernels.gemm's tiles for the family, built on first use."""
    prune = {"early_config_prune": _tune_big_problems_only}
    return Launcher(_grouped_scaled_mm_kernel, _TILES[family], ["M", "N", "K"], prune_configs_by=prune)


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
    """The spec of grouped_scaled_mm: fp8kernels.gemm.scaled_mm on each group (written into `out` when given)."""
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
    """op with zero codes appended along K up to k (they decode to 0 in the per-tensor and 128-block families),
    in one pass: each byte read and written once."""
    tail = op.data.new_zeros(op.rows, k - op.k)
    return dataclasses.replace(op, data=torch.cat([op.data, tail], dim=1), k=k)


def _aligned_k(a_op: GemmOperand, b_op: GemmOperand) -> tuple[GemmOperand, GemmOperand]:
    """Both operands with K a multiple of 16 (an MoE wgrad's K is a token count): cuBLASLt's fp8 GEMM needs it,
    and the launch's table holds K in units of 16, which is what proves its loads 16 bytes wide. MXFP8 and
    NVFP4 blocks already tile K by 32, 16."""
    if a_op.family not in ("tensorwise", "block") or a_op.k % _K_MULTIPLE.value == 0:
        return a_op, b_op
    k = triton.cdiv(a_op.k, _K_MULTIPLE.value) * _K_MULTIPLE.value
    return _pad_k(a_op, k), _pad_k(b_op, k)


def _has_product(a_op: GemmOperand, b_op: GemmOperand) -> bool:
    """Whether the group multiplies anything: an empty output needs nothing, K = 0 only its bias (or zeros)."""
    return min(a_op.rows, b_op.rows, a_op.k) > 0


def _cublas_takes_every_group(
    a_ops: list[GemmOperand], b_ops: list[GemmOperand], out_dtype: torch.dtype, bias: list | None
) -> bool:
    """Whether the groups go to cuBLASLt one by one (GROUPS_USE_TORCH_SCALED_MM): where fp8kernels.gemm would send
    every group with a product there (operands K-aligned by _aligned_k). A pure function of the operands."""
    return GROUPS_USE_TORCH_SCALED_MM and all(
        _torch_scaled_mm_takes(a_op, b_op, out_dtype, None if bias is None else bias[g])
        for g, (a_op, b_op) in enumerate(zip(a_ops, b_ops, strict=True))
        if _has_product(a_op, b_op)
    )


def _cublas_per_group(
    a_ops: list[GemmOperand], b_ops: list[GemmOperand], out_dtype: torch.dtype, bias: list | None, out: list
) -> None:
    """fp8kernels.gemm._torch_scaled_mm on each group with a product, cuBLASLt writing out[g] in place (a copy
    of the fprop output would cost ~15% of the GEMM); K = 0 writes the bias, or zeros."""
    for g, (a_op, b_op) in enumerate(zip(a_ops, b_ops, strict=True)):
        bias_g = None if bias is None else bias[g]
        if not _has_product(a_op, b_op):  # empty, or an empty sum (an expert without tokens, in wgrad)
            out[g].zero_()
            if bias_g is not None:
                out[g] += bias_g  # in fp32, rounded once
            continue
        _torch_scaled_mm(a_op, b_op, out_dtype, bias_g, out=out[g])


def _based(tensors: list[Tensor]) -> tuple[Tensor, list[int]]:
    """The kernel's base argument for these per-group buffers (the one at the lowest address) and each
    buffer's offset from it in elements; an empty buffer is never read and gets offset 0."""
    used = [t for t in tensors if t.numel()] or tensors[:1]
    base = min(used, key=Tensor.data_ptr)
    offsets = [(t.data_ptr() - base.data_ptr()) // base.element_size() if t.numel() else 0 for t in tensors]
    return base, offsets


def _unit(values: list[int], element_size: int) -> int:
    """The largest power of two, at most 16 bytes of elements, dividing every offset and stride of a buffer
    kind: the kernel multiplies table entries by it, so wide accesses follow from the arithmetic."""
    return math.gcd(_ACCESS_BYTES // element_size, *values)


def _grouped_triton(
    a_ops: list[GemmOperand],
    b_ops: list[GemmOperand],
    out_dtype: torch.dtype,
    bias: list | None,
    out: list,
    tile: dict | None = None,
) -> None:
    """One launch writing every out[g] (contiguous, allocated) from operands K-aligned by _aligned_k;
    `tile`: one of _TILES instead of autotuning."""
    assert all(op.k % _K_MULTIPLE.value == 0 for op in a_ops), "_aligned_k; MXFP8/NVFP4 quantizers tile K by 32/16"
    dot_in_fp32 = interpreting()
    first_a, first_b = a_ops[0], b_ops[0]
    device = first_a.data.device
    a_base, a_offsets = _based([_kernel_codes(op, dot_in_fp32) for op in a_ops])
    b_base, b_offsets = _based([_kernel_codes(op, dot_in_fp32) for op in b_ops])
    # row-major scales, as fp8kernels.gemm's Triton path reads them (1x128 ones arrive rows-contiguous)
    a_scales, b_scales = [op.scale_inv.contiguous() for op in a_ops], [op.scale_inv.contiguous() for op in b_ops]
    a_scale_base, a_scale_offsets = _based(a_scales)
    b_scale_base, b_scale_offsets = _based(b_scales)
    a_amax_base, a_amax_offsets = _based([op.scale_inv if op.global_amax is None else op.global_amax for op in a_ops])
    b_amax_base, b_amax_offsets = _based([op.scale_inv if op.global_amax is None else op.global_amax for op in b_ops])
    out_base, out_offsets = _based([o.view(torch.int16) if out_dtype == torch.bfloat16 else o for o in out])
    biases = [t.contiguous() for t in bias] if bias is not None else None  # referenced until the launch
    bias_base, bias_offsets = _based(biases) if biases is not None else (out_base, [0] * len(out))  # read if HAS_BIAS
    a_strides, b_strides = [op.data.shape[1] for op in a_ops], [op.data.shape[1] for op in b_ops]  # contiguous
    n_sizes = [op.rows for op in b_ops]  # also the out row strides (contiguous)
    a_unit = _unit(a_offsets + a_strides, a_base.element_size())
    b_unit = _unit(b_offsets + b_strides, b_base.element_size())
    out_unit = _unit(out_offsets + n_sizes, out_base.element_size())
    columns = [
        [a_offsets[g] // a_unit, b_offsets[g] // b_unit, a_scale_offsets[g], b_scale_offsets[g], a_amax_offsets[g],
         b_amax_offsets[g], bias_offsets[g], out_offsets[g] // out_unit,
         a_op.rows, b_op.rows, a_op.k // _K_MULTIPLE.value, a_strides[g] // a_unit, b_strides[g] // b_unit,
         n_sizes[g] // out_unit, _scale_row_stride(a_scales[g]), _scale_row_stride(b_scales[g])]
        for g, (a_op, b_op) in enumerate(zip(a_ops, b_ops, strict=True))
    ]  # fmt: skip
    # Pinned and non-blocking on CUDA: a pageable copy would make the host wait for the GPU on every launch.
    table_rows = list(zip(*columns, strict=True))
    table = torch.tensor(table_rows, dtype=torch.int64, pin_memory=device.type == "cuda").to(device, non_blocking=True)
    sizes = [(a_op.rows, b_op.rows) for a_op, b_op in zip(a_ops, b_ops, strict=True)]

    def grid(meta):
        return (sum(triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]) for m, n in sizes),)

    block = SCHEME_BLOCKS[first_a.scheme]
    kernel, launch_options = (_tuned(first_a.family), {}) if tile is None else (_grouped_scaled_mm_kernel, tile)
    kernel[grid](
        a_base, b_base, a_scale_base, b_scale_base, a_amax_base, b_amax_base, bias_base, out_base,
        table, len(a_ops), sum(m for m, _ in sizes), max(n for _, n in sizes), max(op.k for op in a_ops),
        SCALING=first_a.family, SCALE_K=0 if block is None else block[1],
        A_SCALE_ROWS=max(first_a.scale_rows, 1), B_SCALE_ROWS=max(first_b.scale_rows, 1),
        **format_constants(first_a.fmt, "A_"), **format_constants(first_b.fmt, "B_"),
        HAS_BIAS=bias is not None, OUT_BF16=out_dtype == torch.bfloat16, DOT_IN_FP32=dot_in_fp32,
        A_UNIT=a_unit, B_UNIT=b_unit, OUT_UNIT=out_unit, GROUP_M=_GROUP_M, **launch_options,
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
    """out[g] = A[g] @ B[g]^T (+ bias[g]) for every group: on CUDA one cuBLASLt call per group where it takes
    them all, else one Triton launch (see the module docstring); `out`: row slices of one tensor, say."""
    a_ops, b_ops, bias, out = _checked_groups(a, b, a_columnwise, b_columnwise, out_dtype, bias, out)
    spec = functools.partial(scaled_mm_loop, a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise)
    device = a_ops[0].data.device
    backend = backend_for(device)
    if backend is Backend.REFERENCE:
        return spec(out_dtype=out_dtype, bias=bias, out=out)
    if out is None:
        out = [torch.empty(a_op.rows, b_op.rows, dtype=out_dtype, device=device) for a_op, b_op in zip(a_ops, b_ops)]
    # at most one padded copy per operand, read by whichever path runs
    a_ops, b_ops = map(list, zip(*(_aligned_k(a_op, b_op) for a_op, b_op in zip(a_ops, b_ops, strict=True))))
    if backend is Backend.TRITON and _cublas_takes_every_group(a_ops, b_ops, out_dtype, bias):
        try:
            _cublas_per_group(a_ops, b_ops, out_dtype, bias, out)
        except (RuntimeError, ValueError):
            if a_ops[0].family != "block":
                raise
            # a torch build without blockwise _scaled_mm: fp8kernels.gemm.scaled_mm records it and runs Triton
            return spec(out_dtype=out_dtype, bias=bias, out=out)
    elif any(a_op.rows * b_op.rows for a_op, b_op in zip(a_ops, b_ops, strict=True)):
        _grouped_triton(a_ops, b_ops, out_dtype, bias, out)
    return out


__all__ = ["GROUPS_USE_TORCH_SCALED_MM", "grouped_scaled_mm", "scaled_mm_loop"]
