"""Pure-torch specification of the multi-tensor Adam in `fp8kernels.adam`: slow, readable, exact.

Per element, in fp32 (t = the step count, from 1):

    g  = grad * inv_scale                       inv_scale = 1 without a grad scaler
    g += weight_decay * p                       Adam with L2 only (adam_w_mode=False)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p * param_decay - step_size * m / (sqrt(v) * inv_bias_correction2_sqrt + eps)

    step_size                 = lr / (1 - beta1**t)
    inv_bias_correction2_sqrt = 1 / sqrt(1 - beta2**t)
    param_decay               = 1 - lr * weight_decay (AdamW), 1 (Adam with L2)

These three scalars are computed in float64 (`adam_scalars`): on the host from Python numbers, or
on the device from tensors (`lr` or `step` a tensor: the CUDA-graph path), then used as fp32.
A nonzero `found_inf` leaves every tensor untouched (the grad scaler's skipped step).

Where the fp32 `p` comes from and where it goes, per tensor (`masters[i]`):

- `None`: `p` is the parameter itself, upcast, written back rounded to nearest even.
- an fp32 tensor (master weights): `p` is the master; the parameter gets its RNE rounding.
- an int16 tensor (bf16 parameters only): the master is kept as "16 low bits". Its 32 bits M are
  split into the parameter's 16 bits P and an int16 remainder R:
      R = the low 16 bits of M (as int16);   P = (M >> 16) + (1 if R < 0 else 0)
      M = ((P - (1 if R < 0 else 0)) << 16) | (R & 0xFFFF)
  so the bf16 parameter is the master rounded to nearest, ties (R = -32768) away from zero, and
  the pair (P, R) holds the fp32 master exactly in half the memory of a separate fp32 copy.

Moments (`exp_avgs`, `exp_avg_sqs`) are fp32 or bf16 tensors (bf16: read exactly, written RNE).
"""

from __future__ import annotations

import math

import torch

Scalars = tuple[float, float, float] | torch.Tensor


def adam_scalars(
    lr: float | torch.Tensor,
    step: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    adam_w_mode: bool,
) -> Scalars:
    """(step_size, inv_bias_correction2_sqrt, param_decay): floats, or a float32 [3] device tensor."""
    if isinstance(lr, torch.Tensor) or isinstance(step, torch.Tensor):
        device = (step if isinstance(step, torch.Tensor) else lr).device
        step64, lr64 = _float64_on(step, device), _float64_on(lr, device)
        step_size = lr64 / (1 - torch.pow(beta1, step64))
        inv_bc2_sqrt = torch.rsqrt(1 - torch.pow(beta2, step64))
        param_decay = 1 - lr64 * weight_decay if adam_w_mode else torch.ones_like(lr64)
        return torch.stack([step_size, inv_bc2_sqrt, param_decay]).to(torch.float32)
    step_size = lr / (1 - beta1**step)
    inv_bc2_sqrt = 1 / math.sqrt(1 - beta2**step)
    return step_size, inv_bc2_sqrt, (1 - lr * weight_decay) if adam_w_mode else 1.0


def _float64_on(value: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=torch.float64)
    return torch.full((), value, dtype=torch.float64, device=device)  # a fill: no copy, fine in a CUDA graph


def split_master(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 master -> (bf16 parameter, int16 remainder), the "16 low bits" format above."""
    bits = master.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    low = bits & 0xFFFF
    high = ((bits >> 16) + (low >> 15)) & 0xFFFF
    return _as_int16(high).view(torch.bfloat16), _as_int16(low)


def join_master(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """(bf16 parameter, int16 remainder) -> the fp32 master they hold."""
    high = param.contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    low = remainder.to(torch.int64) & 0xFFFF
    bits = (((high - (low >> 15)) & 0xFFFF) << 16) | low
    return _as_int32(bits).view(torch.float32)


def _as_int16(values: torch.Tensor) -> torch.Tensor:
    return (values - ((values >> 15) << 16)).to(torch.int16)  # 0..65535 -> two's complement


def _as_int32(values: torch.Tensor) -> torch.Tensor:
    return (values - ((values >> 31) << 32)).to(torch.int32)


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
    """One Adam/AdamW step on every tensor, in place (the spec `fp8kernels.adam.adam_step` matches)."""
    if found_inf is not None and found_inf.item() != 0:
        return
    scalars = adam_scalars(lr, step, beta1, beta2, weight_decay, adam_w_mode)
    step_size, inv_bc2_sqrt, param_decay = scalars if isinstance(scalars, tuple) else scalars.unbind()
    l2 = 0.0 if adam_w_mode else weight_decay
    for param, grad, exp_avg, exp_avg_sq, master in zip(params, grads, exp_avgs, exp_avg_sqs, masters):
        g = grad.float() if inv_scale is None else grad.float() * inv_scale.float()
        p = _read_master(param, master)
        g = g + l2 * p
        m = beta1 * exp_avg.float() + (1 - beta1) * g
        v = beta2 * exp_avg_sq.float() + (1 - beta2) * g * g
        p = p * param_decay - step_size * (m / (v.sqrt() * inv_bc2_sqrt + eps))
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)
        _write_master(param, master, p)


def _read_master(param: torch.Tensor, master: torch.Tensor | None) -> torch.Tensor:
    if master is None:
        return param.float()
    if master.dtype == torch.int16:
        return join_master(param, master)
    return master.clone()


def _write_master(param: torch.Tensor, master: torch.Tensor | None, p: torch.Tensor) -> None:
    if master is not None and master.dtype == torch.int16:
        high, low = split_master(p)
        param.copy_(high)
        master.copy_(low)
        return
    if master is not None:
        master.copy_(p)
    param.copy_(p)
