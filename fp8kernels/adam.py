"""Multi-tensor Adam/AdamW in Triton: one launch updates every tensor of a parameter group.

The math, the master-weight formats and the scalars are specified in `fp8kernels.adam_reference`
(`adam_step` there is the spec this launcher matches, within fp32 rounding: on the GPU the kernel
contracts multiply-adds into FMAs and uses approximate sqrt and division, an ulp or two each).

One launch reaches many tensors through the tables of `fp8kernels.multi_tensor`: per tensor, the
addresses of its parameter, grad, exp_avg, exp_avg_sq and master (0 if none) and its size; and a
flat grid of (tensor, chunk) pairs, each program updating BLOCK contiguous elements of one tensor.

`MultiTensorAdam` builds the tables once for a fixed list of tensors (an optimizer caches one per
parameter group) and afterwards uploads only the grad addresses, and only when they changed.
Tensors are grouped into launches by kind (parameter dtype, master format, moment dtypes):
these become constexprs, so each launch compiles to straight-line code for its kind.

Bandwidth: full chunks use unmasked loads and stores; when every address is 16-byte aligned the
kernel says so (`tl.multiple_of`) and the compiler emits 128-bit accesses. Only a tensor's last,
partial chunk is masked. bf16 values move as raw 16-bit patterns and are converted with integer
bit operations (the Triton interpreter's own bf16 cast truncates instead of rounding to nearest).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from fp8kernels import adam_reference
from fp8kernels._backend import Backend, backend_for
from fp8kernels._casts import f32_to_bf16_bits
from fp8kernels.multi_tensor import TensorTable, aligned

# Measured on one H200 (benchmarks/bench/bench_adam.py, 537M fp32 params, kernel only): 1024 x 4 warps 3.575 ms
# (4.21 TB/s) against 3.921 ms for 4096 x 8; larger blocks were no faster.
DEFAULT_BLOCK = 1024  # elements per program: 8 per thread with 4 warps
DEFAULT_NUM_WARPS = 4

# Rows of the address table (fp8kernels.multi_tensor.TensorTable).
_PARAM = tl.constexpr(0)
_GRAD = tl.constexpr(1)
_EXP_AVG = tl.constexpr(2)
_EXP_AVG_SQ = tl.constexpr(3)
_MASTER = tl.constexpr(4)
_NUMEL = tl.constexpr(5)

_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
# The Triton interpreter keeps global state while it runs a launch; threads (e.g. the ranks of a
# threaded process group in tests) must take turns.
_INTERPRETER_LOCK = threading.Lock()


@triton.jit
def _bf16_bits_to_f32(bits):
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _typed_pointer(tensor_table_ptr, ROW: tl.constexpr, n_tensors, tensor, KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """The address in row ROW of the table, as a pointer to KIND's storage type."""
    address = tl.load(tensor_table_ptr + ROW * n_tensors + tensor)
    if KIND == "fp32":
        ptr = address.to(tl.pointer_type(tl.float32))
    elif KIND == "fp16":
        ptr = address.to(tl.pointer_type(tl.float16))
    else:  # bf16 values and int16 remainders travel as raw 16-bit patterns
        ptr = address.to(tl.pointer_type(tl.uint16))
    if ALIGNED:
        # 4 elements per thread access for every dtype (16 bytes of fp32, 8 of bf16) keeps all
        # tensors in one register layout; 8 bf16 per access would force shared-memory shuffles.
        ptr = tl.multiple_of(ptr, 16 if KIND == "fp32" else 8)
    return ptr


@triton.jit
def _load_f32(ptr, mask, KIND: tl.constexpr):
    x = tl.load(ptr, mask=mask)
    if KIND == "bf16":
        return _bf16_bits_to_f32(x)
    return x.to(tl.float32)


@triton.jit
def _store_f32(ptr, x, mask, KIND: tl.constexpr):
    if KIND == "bf16":
        tl.store(ptr, f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _update_chunk(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, mask,
    step_size, inv_bias_correction2_sqrt, param_decay, inv_scale,
    beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
    PARAM: tl.constexpr, MASTER: tl.constexpr, EXP_AVG: tl.constexpr, EXP_AVG_SQ: tl.constexpr, L2: tl.constexpr,
):  # fmt: skip
    """One chunk: pointers already point at its elements; `mask` is None for a full chunk."""
    grad = _load_f32(grad_ptr, mask, PARAM) * inv_scale
    if MASTER == "fp32":
        p = tl.load(master_ptr, mask=mask)
    elif MASTER == "remainder":
        high = tl.load(param_ptr, mask=mask).to(tl.uint32)
        low = tl.load(master_ptr, mask=mask).to(tl.uint32)
        p = (((high - (low >> 15)) << 16) | low).to(tl.float32, bitcast=True)
    else:
        p = _load_f32(param_ptr, mask, PARAM)
    if L2:  # Adam: decay through the gradient. (AdamW decays through param_decay instead.)
        grad = grad + weight_decay * p
    exp_avg = beta1 * _load_f32(exp_avg_ptr, mask, EXP_AVG) + one_minus_beta1 * grad
    exp_avg_sq = beta2 * _load_f32(exp_avg_sq_ptr, mask, EXP_AVG_SQ) + one_minus_beta2 * grad * grad
    p = p * param_decay - step_size * (exp_avg / (tl.sqrt(exp_avg_sq) * inv_bias_correction2_sqrt + eps))
    _store_f32(exp_avg_ptr, exp_avg, mask, EXP_AVG)
    _store_f32(exp_avg_sq_ptr, exp_avg_sq, mask, EXP_AVG_SQ)
    if MASTER == "remainder":
        bits = p.to(tl.uint32, bitcast=True)
        low = bits & 0xFFFF
        tl.store(param_ptr, ((bits >> 16) + (low >> 15)).to(tl.uint16), mask=mask)
        tl.store(master_ptr, low.to(tl.uint16), mask=mask)
    else:
        if MASTER == "fp32":
            tl.store(master_ptr, p, mask=mask)
        _store_f32(param_ptr, p, mask, PARAM)


@triton.jit
def _adam_kernel(
    tensor_table_ptr,  # int64 [6, n_tensors]: addresses of param, grad, exp_avg, exp_avg_sq, master; numel
    chunk_table_ptr,  # int32 [2, n_chunks]: tensor index, chunk index within that tensor
    n_tensors,
    n_chunks,
    step_size,  # lr / (1 - beta1^t)             (read from scalars_ptr[0] when SCALARS_IN_MEMORY)
    inv_bias_correction2_sqrt,  # 1 / sqrt(1 - beta2^t)   (scalars_ptr[1])
    param_decay,  # 1 - lr * weight_decay for AdamW, else 1   (scalars_ptr[2])
    scalars_ptr,  # fp32 [3] on the device: the three above, for CUDA graphs
    beta1,
    one_minus_beta1,
    beta2,
    one_minus_beta2,
    eps,
    weight_decay,  # added to the gradient as weight_decay * p when L2
    inv_scale_ptr,  # fp32 [1]: gradients are multiplied by it (grad scaler)
    found_inf_ptr,  # fp32 [1]: nonzero skips the whole update
    PARAM: tl.constexpr,  # "fp32" | "bf16" | "fp16": parameters and grads
    MASTER: tl.constexpr,  # "none" | "fp32" | "remainder"
    EXP_AVG: tl.constexpr,  # "fp32" | "bf16"
    EXP_AVG_SQ: tl.constexpr,  # "fp32" | "bf16"
    L2: tl.constexpr,  # Adam with L2 weight decay (False: AdamW)
    SCALARS_IN_MEMORY: tl.constexpr,
    HAS_INV_SCALE: tl.constexpr,
    HAS_FOUND_INF: tl.constexpr,
    ALIGNED: tl.constexpr,  # every param/state/master address is 16-byte aligned
    GRAD_ALIGNED: tl.constexpr,  # every grad address is 16-byte aligned
    BLOCK: tl.constexpr,
):
    chunk_id = tl.program_id(0)
    tensor = tl.load(chunk_table_ptr + chunk_id)
    start = tl.load(chunk_table_ptr + n_chunks + chunk_id).to(tl.int64) * BLOCK  # a multiple of BLOCK
    remaining = tl.load(tensor_table_ptr + _NUMEL * n_tensors + tensor) - start
    if HAS_FOUND_INF:  # a skipped step masks every element: no memory traffic
        remaining = tl.where(tl.load(found_inf_ptr) != 0, 0, remaining)
    if SCALARS_IN_MEMORY:
        step_size = tl.load(scalars_ptr)
        inv_bias_correction2_sqrt = tl.load(scalars_ptr + 1)
        param_decay = tl.load(scalars_ptr + 2)
    inv_scale = 1.0
    if HAS_INV_SCALE:
        inv_scale = tl.load(inv_scale_ptr)
    param_ptr = _typed_pointer(tensor_table_ptr, _PARAM, n_tensors, tensor, PARAM, ALIGNED) + start
    grad_ptr = _typed_pointer(tensor_table_ptr, _GRAD, n_tensors, tensor, PARAM, GRAD_ALIGNED) + start
    exp_avg_ptr = _typed_pointer(tensor_table_ptr, _EXP_AVG, n_tensors, tensor, EXP_AVG, ALIGNED) + start
    exp_avg_sq_ptr = _typed_pointer(tensor_table_ptr, _EXP_AVG_SQ, n_tensors, tensor, EXP_AVG_SQ, ALIGNED) + start
    master_kind: tl.constexpr = "fp32" if MASTER == "fp32" else PARAM  # a remainder is 16-bit, like its param
    master_ptr = _typed_pointer(tensor_table_ptr, _MASTER, n_tensors, tensor, master_kind, ALIGNED) + start
    offsets = tl.arange(0, BLOCK)
    param_ptr += offsets
    grad_ptr += offsets
    exp_avg_ptr += offsets
    exp_avg_sq_ptr += offsets
    master_ptr += offsets
    # Two calls that differ only in the mask: a full chunk must be unmasked to be vectorized.
    if remaining >= BLOCK:
        _update_chunk(
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, None,
            step_size, inv_bias_correction2_sqrt, param_decay, inv_scale,
            beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
            PARAM, MASTER, EXP_AVG, EXP_AVG_SQ, L2,
        )  # fmt: skip
    else:
        _update_chunk(
            param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, offsets < remaining,
            step_size, inv_bias_correction2_sqrt, param_decay, inv_scale,
            beta1, one_minus_beta1, beta2, one_minus_beta2, eps, weight_decay,
            PARAM, MASTER, EXP_AVG, EXP_AVG_SQ, L2,
        )  # fmt: skip


@dataclass(frozen=True)
class _Kind:
    """What a launch compiles for: storage types of its tensors and their alignment."""

    param: str  # "fp32" | "bf16" | "fp16"
    master: str  # "none" | "fp32" | "remainder"
    exp_avg: str  # "fp32" | "bf16"
    exp_avg_sq: str  # "fp32" | "bf16"
    aligned: bool  # every param/state/master address is 16-byte aligned


class _Launch:
    """One kind's tensors: their tables, and the launch."""

    def __init__(self, kind: _Kind, indices: list[int], tensors: list[list], block: int):
        params, exp_avgs, exp_avg_sqs, masters = ([group[i] for i in indices] for group in tensors)
        # Operand rows in the kernel's order (_PARAM, _GRAD, ...); grads are pointed at every step.
        self.table = TensorTable([params, [None] * len(params), exp_avgs, exp_avg_sqs, masters], block)
        self.kind, self.indices = kind, indices

    def run(self, grads: list[torch.Tensor], args: dict, num_warps: int) -> None:
        """Point the table at this step's grads and launch."""
        grads = [grads[i] for i in self.indices]
        self.table.point_row(_GRAD.value, grads)
        if self.table.n_chunks == 0:
            return
        kind = self.kind
        _adam_kernel[(self.table.n_chunks,)](
            self.table.addresses, self.table.chunks, self.table.n_tensors, self.table.n_chunks, **args,
            PARAM=kind.param, MASTER=kind.master, EXP_AVG=kind.exp_avg, EXP_AVG_SQ=kind.exp_avg_sq,
            # Grads share the others' access width only when aligned too: one register layout for all.
            ALIGNED=kind.aligned, GRAD_ALIGNED=kind.aligned and aligned(grads),
            num_warps=num_warps, enable_fp_fusion=True,
        )  # fmt: skip


class MultiTensorAdam:
    """Adam over a fixed list of tensors: launch tables built once, reused by every `step`.

    `masters[i]` is None, an fp32 master or an int16 remainder (see `fp8kernels.adam_reference`).
    Rebuild when the tensors change (`matches` tells); grads may change every step.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        masters: list[torch.Tensor | None],
        *,
        block: int = DEFAULT_BLOCK,
        num_warps: int = DEFAULT_NUM_WARPS,
    ):
        tensors = [list(params), list(exp_avgs), list(exp_avg_sqs), list(masters)]
        _check_tensors(*tensors)
        if block < 16 or block & (block - 1):
            raise ValueError(f"block must be a power of two >= 16, got {block}")
        self._tensors, self._signature = tensors, _signature(*tensors)
        self.block, self.num_warps = block, num_warps
        self.backend = backend_for(params[0].device) if params else Backend.REFERENCE
        by_kind: dict[_Kind, list[int]] = {}
        for i, (param, exp_avg, exp_avg_sq, master) in enumerate(zip(*tensors)):
            by_kind.setdefault(_kind_of(param, exp_avg, exp_avg_sq, master), []).append(i)
        use_triton = self.backend is not Backend.REFERENCE
        self._launches = [_Launch(kind, ids, tensors, block) for kind, ids in by_kind.items()] if use_triton else []

    def matches(
        self,
        params: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        masters: list[torch.Tensor | None],
    ) -> bool:
        """True when these are the tensors (same storage, same sizes) the tables were built for.

        Sound because this object holds the tensors it was built for: their addresses stay theirs.
        """
        return _signature(params, exp_avgs, exp_avg_sqs, masters) == self._signature

    def step(
        self,
        grads: list[torch.Tensor],
        *,
        lr: float | torch.Tensor,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        adam_w_mode: bool,
        step: float | torch.Tensor,
        inv_scale: torch.Tensor | None = None,
        found_inf: torch.Tensor | None = None,
    ) -> None:
        """One Adam/AdamW step on every tensor (see `fp8kernels.adam_reference.adam_step`)."""
        params, exp_avgs, exp_avg_sqs, masters = self._tensors
        _check_grads(params, grads)
        if self.backend is Backend.REFERENCE:
            adam_reference.adam_step(
                params, grads, exp_avgs, exp_avg_sqs, masters, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, adam_w_mode=adam_w_mode, step=step, inv_scale=inv_scale,
                found_inf=found_inf,
            )  # fmt: skip
            return
        if not self._launches:
            return
        device_pointer = self._launches[0].table.addresses  # for pointer arguments the kernel does not read
        scalars = adam_reference.adam_scalars(lr, step, beta1, beta2, weight_decay, adam_w_mode)
        in_memory = isinstance(scalars, torch.Tensor)
        step_size, inv_bias_correction2_sqrt, param_decay = (0.0, 0.0, 0.0) if in_memory else scalars
        args = dict(
            step_size=step_size, inv_bias_correction2_sqrt=inv_bias_correction2_sqrt, param_decay=param_decay,
            scalars_ptr=scalars.to(params[0].device) if in_memory else device_pointer,
            beta1=beta1, one_minus_beta1=1.0 - beta1, beta2=beta2, one_minus_beta2=1.0 - beta2, eps=eps,
            weight_decay=weight_decay, L2=not adam_w_mode,
            inv_scale_ptr=_scalar_tensor(inv_scale, "inv_scale", device_pointer),
            found_inf_ptr=_scalar_tensor(found_inf, "found_inf", device_pointer),
            SCALARS_IN_MEMORY=in_memory, HAS_INV_SCALE=inv_scale is not None,
            HAS_FOUND_INF=found_inf is not None, BLOCK=self.block,
        )  # fmt: skip
        with _INTERPRETER_LOCK if self.backend is Backend.INTERPRETER else contextlib.nullcontext():
            for launch in self._launches:
                launch.run(grads, args, self.num_warps)


def adam_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    masters: list[torch.Tensor | None],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    adam_w_mode: bool,
    step: float | torch.Tensor,
    inv_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """One Adam/AdamW step on every tensor in one launch per kind; tables built for this call only."""
    MultiTensorAdam(params, exp_avgs, exp_avg_sqs, masters).step(
        grads, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
        adam_w_mode=adam_w_mode, step=step, inv_scale=inv_scale, found_inf=found_inf,
    )  # fmt: skip


def _kind_of(param, exp_avg, exp_avg_sq, master) -> _Kind:
    master_kind = "none" if master is None else "remainder" if master.dtype == torch.int16 else "fp32"
    names = _DTYPE_NAMES
    is_aligned = aligned([param, exp_avg, exp_avg_sq, master])
    return _Kind(names[param.dtype], master_kind, names[exp_avg.dtype], names[exp_avg_sq.dtype], is_aligned)


def _signature(params, exp_avgs, exp_avg_sqs, masters) -> tuple:
    tensors = [t for group in (params, exp_avgs, exp_avg_sqs, masters) for t in group]
    return tuple(0 if t is None else t.data_ptr() for t in tensors) + tuple(t.numel() for t in params)


def _check_tensors(params, exp_avgs, exp_avg_sqs, masters) -> None:
    lengths = {len(params), len(exp_avgs), len(exp_avg_sqs), len(masters)}
    if len(lengths) != 1:
        raise ValueError(f"params, exp_avgs, exp_avg_sqs and masters need equal lengths, got {sorted(lengths)}")
    for i, (param, exp_avg, exp_avg_sq, master) in enumerate(zip(params, exp_avgs, exp_avg_sqs, masters)):
        if param.dtype not in _DTYPE_NAMES:
            raise TypeError(f"params[{i}] is {param.dtype}; Adam updates float32, bfloat16 or float16 tensors")
        for name, state in (("exp_avgs", exp_avg), ("exp_avg_sqs", exp_avg_sq)):
            if state.dtype not in _MOMENT_DTYPES:
                raise TypeError(f"{name}[{i}] is {state.dtype}; the kernel keeps moments in float32 or bfloat16")
        if master is not None and master.dtype not in (torch.float32, torch.int16):
            raise TypeError(f"masters[{i}] is {master.dtype}; use float32 masters or int16 remainders (or None)")
        if master is not None and master.dtype == torch.int16 and param.dtype != torch.bfloat16:
            raise TypeError(f"masters[{i}] is an int16 remainder, which only bfloat16 params have, not {param.dtype}")
        for state in (exp_avg, exp_avg_sq, master):
            if state is not None and state.numel() != param.numel():
                raise ValueError(f"tensor {i}: a state has {state.numel()} elements, its param {param.numel()}")
        for state in (param, exp_avg, exp_avg_sq, master):
            if state is not None and (state.device != params[0].device or not state.is_contiguous()):
                raise ValueError(f"tensor {i}: every tensor must be contiguous and on {params[0].device}")


def _check_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    if len(grads) != len(params):
        raise ValueError(f"got {len(grads)} grads for {len(params)} params")
    for i, (param, grad) in enumerate(zip(params, grads)):
        if grad.dtype != param.dtype or grad.numel() != param.numel() or not grad.is_contiguous():
            raise ValueError(
                f"grads[{i}] ({grad.dtype}, {grad.numel()} elements) must be contiguous and match its param "
                f"({param.dtype}, {param.numel()} elements)"
            )


def _scalar_tensor(value: torch.Tensor | None, name: str, unused: torch.Tensor) -> torch.Tensor:
    if value is None:
        return unused
    if value.numel() != 1 or value.dtype != torch.float32 or value.device != unused.device:
        raise ValueError(f"{name} must be one float32 value on {unused.device}, got {value.dtype} {tuple(value.shape)}")
    return value
