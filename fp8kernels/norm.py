"""LayerNorm and RMSNorm in Triton, forward fused with the FP8 cast of the output, and backward.

The math, the zero-centered gamma and the fused-cast rules are in `fp8kernels.norm_reference`; the
functions here have its names and signatures. Outputs match it within fp32 rounding; the fused
cast's bytes equal fp8kernels.reference's quantization of the kernel's own fp32 output exactly.

Forward: one program normalizes BLOCK_ROWS whole rows held in registers (x is read once), so a
tensorwise cast with a given (delayed-scaling) scale, and 1x128 block scales, fit in the same
pass; the amax is an atomic max over programs of |values| as int32 bits (NaN wins). Current
scaling cannot fuse (its scale needs the amax of the whole output): return_amax=True returns the
output and its amax in one pass, and the caller casts with a scale from that amax.
Backward: a fixed number of programs each walk a contiguous range of rows, writing dx and
accumulating their dweight/dbias rows in fp32; the host sums those partial rows.
bf16 values are stored through round-to-nearest-even bit operations (the interpreter's cast truncates).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from fp8kernels import norm_reference
from fp8kernels._backend import Backend, backend_for, interpreting, multiprocessor_count
from fp8kernels._casts import abs_bits, f32_to_bf16_bits, f32_to_code, format_constants, scale_from_amax
from fp8kernels._launch import Launcher
from fp8kernels.formats import row_block_scales
from twinspec.formats import FORMATS
from fp8kernels.norm_reference import FusedCast, NormBackward, NormForward, check_backward_inputs, check_norm_inputs
from fp8kernels.reference import Quantized

MAX_HIDDEN = 65536  # whole rows live in registers
_CAST_BLOCK = 128  # elements per scale of the 1x128 fused cast
# Elements per program tile: GPU keeps one large row per program; the interpreter pays per
# program, so it takes many rows at once.
_TILE_ELEMENTS = {"gpu": 8192, "interpreter": 65536}
_BACKWARD_PROGRAMS_PER_SM = 4  # enough rows in flight to cover memory latency
_WARPS = [{"num_warps": 8}, {"num_warps": 16}, {"num_warps": 4}]
_TUNE_FROM = 1 << 22  # elements from which autotuning pays for its compiles


@triton.jit
def _bf16_bits_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _store_rows(ptr, values, offsets, mask, BF16: tl.constexpr):
    """Store fp32 values into an fp32 buffer, or into a bf16 one (as int16 bits); returns what was stored."""
    if BF16:
        bits = f32_to_bf16_bits(values)
        tl.store(ptr + offsets, bits.to(tl.int16, bitcast=True), mask=mask)
        stored = _bf16_bits_to_f32(bits)
    else:
        tl.store(ptr + offsets, values, mask=mask)
        stored = values
    return stored


@triton.jit
def _gamma(weight_ptr, cols, H, ZERO_CENTERED: tl.constexpr):
    """The multiplier g: weight, or weight + 1 when the stored weight is gamma - 1."""
    weight = tl.load(weight_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        weight = tl.where(cols < H, weight + 1.0, 0.0)
    return weight


@triton.jit
def _norm_forward_kernel(
    x_ptr, weight_ptr, bias_ptr,  # x [R, H] (rows x_row_stride apart); weight, bias [H]
    out_ptr, mean_ptr, rstd_ptr,  # out [R, H] contiguous (bf16 as int16 bits); mean, rstd fp32 [R]
    codes_ptr, cast_scale_ptr, cast_scale_inv_ptr,  # fused cast: uint8 [R, H]; fp32 (1,); (1,) or [R, H/128] R-major
    amax_bits_ptr,  # int32 (1,): atomic max of |values| bits
    R, H, x_row_stride, eps,
    RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, HAS_BIAS: tl.constexpr,
    WRITE_OUT: tl.constexpr, OUT_BF16: tl.constexpr, MEASURE_AMAX: tl.constexpr,
    CAST: tl.constexpr,  # "none" | "tensorwise" | "block1x128"
    EXPONENT_BITS: tl.constexpr, MANTISSA_BITS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_CODE: tl.constexpr,
    FMAX: tl.constexpr, POWER_2: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """Normalize BLOCK_ROWS rows; store out, mean, rstd, the amax and the fused cast as asked."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_H)
    row_inside = rows < R
    inside = row_inside[:, None] & (cols[None, :] < H)
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if RMS:
        centered = x
    else:
        mean = tl.sum(x, axis=1) / H
        tl.store(mean_ptr + rows, mean, mask=row_inside)
        centered = tl.where(inside, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=1) / H + eps)
    tl.store(rstd_ptr + rows, rstd, mask=row_inside)
    y = centered * rstd[:, None] * _gamma(weight_ptr, cols, H, ZERO_CENTERED)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    y = tl.where(inside, y, 0.0)  # rows past R would carry the bias into the amax
    offsets = rows[:, None] * H + cols[None, :]
    stored = y
    if WRITE_OUT:
        stored = _store_rows(out_ptr, y, offsets, inside, OUT_BF16)
    if MEASURE_AMAX:  # of what gets cast: y for the fused tensorwise cast, else the output as stored
        source = y if CAST == "tensorwise" else stored
        tl.atomic_max(amax_bits_ptr, tl.max(tl.max(abs_bits(source), axis=1), axis=0))
    if CAST == "tensorwise":
        scale = tl.load(cast_scale_ptr)
        codes = f32_to_code(y * scale, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
        tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=inside)
        if tl.program_id(0) == 0:
            tl.store(cast_scale_inv_ptr, tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale))
    if CAST == "block1x128":
        blocks = tl.reshape(y, [BLOCK_ROWS, BLOCK_H // 128, 128])
        block_amax = tl.max(abs_bits(blocks), axis=2).to(tl.float32, bitcast=True)
        scale = scale_from_amax(block_amax, FMAX, POWER_2, 0.0)
        scaled = tl.reshape(blocks * scale[:, :, None], [BLOCK_ROWS, BLOCK_H])
        codes = f32_to_code(scaled, EXPONENT_BITS, MANTISSA_BITS, MAX_BITS, NAN_CODE)
        tl.store(codes_ptr + offsets, codes.to(tl.uint8), mask=inside)
        block_cols = tl.arange(0, BLOCK_H // 128)
        col_blocks = tl.cdiv(H, 128)
        scale_inv = tl.math.div_rn(tl.full(scale.shape, 1.0, tl.float32), scale)
        scale_mask = row_inside[:, None] & (block_cols[None, :] < col_blocks)
        tl.store(cast_scale_inv_ptr + block_cols[None, :] * R + rows[:, None], scale_inv, mask=scale_mask)


@triton.jit
def _norm_backward_kernel(
    dy_ptr, x_ptr, weight_ptr, mean_ptr, rstd_ptr,  # dy, x [R, H] (own row strides); weight [H]; mean, rstd [R]
    dx_ptr, dweight_partial_ptr, dbias_partial_ptr,  # dx [R, H] contiguous; fp32 [programs, H] partial sums
    R, H, dy_row_stride, x_row_stride, rows_per_program,
    RMS: tl.constexpr, ZERO_CENTERED: tl.constexpr, DX_BF16: tl.constexpr,
    BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """dx for this program's rows, and their dweight (and dbias) summed into one partial row."""
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    gamma = _gamma(weight_ptr, cols, H, ZERO_CENTERED)
    dweight = tl.zeros([BLOCK_H], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_H], dtype=tl.float32)
    first = program.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, R)
    for start in range(first, last, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_inside = rows < last
        inside = row_inside[:, None] & (cols[None, :] < H)
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_inside, other=0.0)
        if RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(mean_ptr + rows, mask=row_inside, other=0.0)
            xhat = tl.where(inside, (x - mean[:, None]) * rstd[:, None], 0.0)
        gdy = gamma[None, :] * dy
        inner = gdy - xhat * (tl.sum(xhat * gdy, axis=1) / H)[:, None]
        if not RMS:
            inner -= (tl.sum(gdy, axis=1) / H)[:, None]
            dbias += tl.sum(dy, axis=0)
        _store_rows(dx_ptr, inner * rstd[:, None], rows[:, None] * H + cols[None, :], inside, DX_BF16)
        dweight += tl.sum(dy * xhat, axis=0)
    tl.store(dweight_partial_ptr + program * H + cols, dweight, mask=cols < H)
    if not RMS:
        tl.store(dbias_partial_ptr + program * H + cols, dbias, mask=cols < H)


def _tune_big_problems_only(configs, named_args, **kwargs):
    """Autotuning compiles every candidate; below _TUNE_FROM elements the launch dominates: take the first."""
    return configs if named_args["R"] * named_args["H"] >= _TUNE_FROM else configs[:1]


@functools.cache
def _tuned(kernel_name: str) -> Launcher:
    """The kernel autotuned over warp counts (one config under the interpreter), keyed by the variant."""
    kernel, key = {
        "forward": (_norm_forward_kernel, ["H", "BLOCK_ROWS", "RMS", "CAST", "WRITE_OUT", "OUT_BF16"]),
        "backward": (_norm_backward_kernel, ["H", "BLOCK_ROWS", "RMS", "DX_BF16"]),
    }[kernel_name]
    return Launcher(kernel, _WARPS, key, prune_configs_by={"early_config_prune": _tune_big_problems_only})


def _tile(hidden: int, min_block_h: int = 1) -> tuple[int, int]:
    """(BLOCK_ROWS, BLOCK_H): whole rows, padded to a power of two, as many as fit the tile budget."""
    if hidden > MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} is over {MAX_HIDDEN}, the most one program holds; split the last dim")
    block_h = max(triton.next_power_of_2(hidden), min_block_h)
    budget = _TILE_ELEMENTS["interpreter" if interpreting() else "gpu"]
    return max(1, budget // block_h), block_h


def _rows(x: Tensor) -> Tensor:
    """x as [R, H] with a unit stride along H."""
    x2d = x.reshape(-1, x.shape[-1])
    return x2d if x2d.stride(-1) == 1 else x2d.contiguous()


def _norm_forward(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, zero_centered_gamma: bool,
    out_dtype: torch.dtype | None, return_amax: bool, cast: FusedCast | None, rms: bool,
) -> NormForward:  # fmt: skip
    out_dtype = check_norm_inputs(x, weight, bias, out_dtype, cast)
    x2d = _rows(x)
    R, H = x2d.shape
    device = x.device
    write_out = cast is None or cast.keep_output
    cast_scheme = "none" if cast is None else cast.scheme
    measure_amax = return_amax or cast_scheme == "tensorwise"
    block_rows, block_h = _tile(H, _CAST_BLOCK if cast_scheme == "block1x128" else 1)
    out = torch.empty(x.shape if write_out else (1,), dtype=out_dtype, device=device)
    mean = torch.empty(R if not rms else 1, dtype=torch.float32, device=device)
    rstd = torch.empty(R, dtype=torch.float32, device=device)
    amax_bits = (torch.zeros if measure_amax else torch.empty)(1, dtype=torch.int32, device=device)
    codes = torch.empty((R, H) if cast is not None else (1,), dtype=torch.uint8, device=device)
    if cast_scheme == "block1x128":  # stored R-contiguous, as cuBLASLt reads 1x128 scales
        scale_inv = row_block_scales(R, triton.cdiv(H, _CAST_BLOCK), device)
    else:
        scale_inv = torch.empty(1, dtype=torch.float32, device=device)
    fmt = "e4m3" if cast is None else cast.fmt
    _tuned("forward")[(triton.cdiv(R, block_rows),)](
        x2d, weight, bias if bias is not None else weight,
        out.view(torch.int16) if out_dtype == torch.bfloat16 else out, mean, rstd,
        codes, cast.scale if cast_scheme == "tensorwise" else rstd, scale_inv, amax_bits,
        R, H, x2d.stride(0), eps,
        RMS=rms, ZERO_CENTERED=zero_centered_gamma, HAS_BIAS=bias is not None,
        WRITE_OUT=write_out, OUT_BF16=out_dtype == torch.bfloat16, MEASURE_AMAX=measure_amax, CAST=cast_scheme,
        **format_constants(fmt), FMAX=FORMATS[fmt].max, POWER_2=cast is not None and cast.power_2_scale,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h,
    )  # fmt: skip
    amax = amax_bits.view(torch.float32) if measure_amax else None
    quantized = None
    if cast is not None:
        quantized = Quantized(
            cast.scheme, cast.fmt, tuple(x.shape),
            data=codes, scale_inv=scale_inv, columnwise_data=None, columnwise_scale_inv=None,
            amax=amax if cast_scheme == "tensorwise" else None,
        )  # fmt: skip
    return NormForward(out if write_out else None, None if rms else mean, rstd, amax, quantized)


def _reference_when_nothing_to_launch(launcher):
    """Send empty tensors and devices without a Triton backend to the norm_reference function of that name."""
    reference_function = getattr(norm_reference, launcher.__name__)

    @functools.wraps(launcher)
    def run(first, *args, **kwargs):
        tensor = first if launcher.__name__.endswith("forward") else args[0]  # x: first, or after dy
        if not isinstance(tensor, Tensor) or tensor.numel() == 0 or backend_for(tensor.device) is Backend.REFERENCE:
            return reference_function(first, *args, **kwargs)
        return launcher(first, *args, **kwargs)

    return run


@_reference_when_nothing_to_launch
def layer_norm_forward(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    out_dtype: torch.dtype | None = None,
    return_amax: bool = False,
    cast: FusedCast | None = None,
) -> NormForward:
    """LayerNorm over the last dim, optionally with its amax (current scaling) or a fused FP8 cast."""
    return _norm_forward(x, weight, bias, eps, zero_centered_gamma, out_dtype, return_amax, cast, rms=False)


@_reference_when_nothing_to_launch
def rms_norm_forward(
    x: Tensor,
    weight: Tensor,
    *,
    eps: float = 1e-5,
    zero_centered_gamma: bool = False,
    out_dtype: torch.dtype | None = None,
    return_amax: bool = False,
    cast: FusedCast | None = None,
) -> NormForward:
    """RMSNorm over the last dim, optionally with its amax (current scaling) or a fused FP8 cast."""
    return _norm_forward(x, weight, None, eps, zero_centered_gamma, out_dtype, return_amax, cast, rms=True)


def _norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor | None, rstd: Tensor, zero_centered_gamma: bool
) -> NormBackward:
    check_backward_inputs(dy, x, weight, mean, rstd)
    x2d, dy2d = _rows(x), _rows(dy)
    R, H = x2d.shape
    block_rows, block_h = _tile(H)
    programs = min(triton.cdiv(R, block_rows), _BACKWARD_PROGRAMS_PER_SM * multiprocessor_count(x.device))
    rows_per_program = triton.cdiv(triton.cdiv(R, programs), block_rows) * block_rows
    programs = triton.cdiv(R, rows_per_program)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dweight_partial = torch.empty(programs, H, dtype=torch.float32, device=x.device)
    dbias_partial = torch.empty(programs if mean is not None else 1, H, dtype=torch.float32, device=x.device)
    _tuned("backward")[(programs,)](
        dy2d, x2d, weight, mean if mean is not None else rstd, rstd,
        dx.view(torch.int16) if x.dtype == torch.bfloat16 else dx, dweight_partial, dbias_partial,
        R, H, dy2d.stride(0), x2d.stride(0), rows_per_program,
        RMS=mean is None, ZERO_CENTERED=zero_centered_gamma, DX_BF16=x.dtype == torch.bfloat16,
        BLOCK_ROWS=block_rows, BLOCK_H=block_h,
    )  # fmt: skip
    dweight = dweight_partial.sum(dim=0).to(weight.dtype)
    dbias = None if mean is None else dbias_partial.sum(dim=0).to(weight.dtype)
    return NormBackward(dx, dweight, dbias)


@_reference_when_nothing_to_launch
def layer_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, mean: Tensor, rstd: Tensor, *, zero_centered_gamma: bool = False
) -> NormBackward:
    """dx, dweight and dbias of LayerNorm from the forward's mean and rstd."""
    return _norm_backward(dy, x, weight, mean, rstd, zero_centered_gamma)


@_reference_when_nothing_to_launch
def rms_norm_backward(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, *, zero_centered_gamma: bool = False
) -> NormBackward:
    """dx and dweight of RMSNorm from the forward's rstd."""
    return _norm_backward(dy, x, weight, None, rstd, zero_centered_gamma)


__all__ = ["FusedCast", "MAX_HIDDEN", "NormBackward", "NormForward", "layer_norm_backward", "layer_norm_forward",
           "rms_norm_backward", "rms_norm_forward"]  # fmt: skip
