"""Argument checks shared by the reference quantizers and the Triton launchers (same errors in both).

The checks that need no tensor are twinspec.checks', shared with jaxside._checks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from twinspec.checks import check_global_amax_unrotated, check_scale_or_amax_given

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def matrix_view(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """x (any rank >= 1) as [prod(leading dims), last dim] in its own dtype, and its shape."""
    if not isinstance(x, Tensor) or x.dtype not in INPUT_DTYPES:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"quantize takes a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dim, got a 0-d tensor; reshape it to (1,)")
    return x.reshape(-1, x.shape[-1]), tuple(x.shape)


def check_scale(scale: Tensor, device: torch.device) -> Tensor:
    """A delayed-scaling scale: fp32 with one element, on the input's device."""
    if not isinstance(scale, Tensor) or scale.dtype != torch.float32 or scale.numel() != 1:
        raise TypeError(
            f"scale must be an fp32 tensor of one element, got {scale!r}; pass scale=None for current scaling"
        )
    if scale.device != device:
        raise ValueError(f"scale is on {scale.device} but x is on {device}; move the scale to {device}")
    return scale.reshape(1)


def check_scale_or_amax(
    scale: Tensor | None, amax: Tensor | None, power_2_scale: bool, amax_epsilon: float, device: torch.device,
    groups: int | None = None,
) -> None:  # fmt: skip
    """Tensorwise: a given delayed-scaling scale, or a given amax to scale from (current scaling), or neither;
    with `groups` (a split quantize), one of them per row group, shaped (groups,)."""
    check_scale_or_amax_given(scale is not None, amax is not None, power_2_scale, amax_epsilon)
    if groups is not None:
        for name, values in (("scales", scale), ("amaxes", amax)):
            if values is None:
                continue
            if not isinstance(values, Tensor) or values.dtype != torch.float32 or values.shape != (groups,):
                raise TypeError(f"{name} must be an fp32 tensor of shape ({groups},), one per group, got {values!r}")
            if values.device != device:
                raise ValueError(f"{name} is on {values.device} but x is on {device}; move it to {device}")
    elif scale is not None:
        check_scale(scale, device)
    elif amax is not None:
        _check_one_fp32(amax, "amax", "the amax to scale from, e.g. reduced over the shards of x", device)


def _check_one_fp32(value: Tensor, name: str, meaning: str, device: torch.device) -> None:
    if not isinstance(value, Tensor) or value.dtype != torch.float32 or value.numel() != 1:
        raise TypeError(f"{name} must be an fp32 tensor of one element ({meaning}), got {value!r}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but x is on {device}; move it to {device}")


def check_stochastic_seed(seed: object) -> None:
    """None (round to nearest), an int, or an integer tensor of one element (a seed that stays on the device)."""
    if seed is None or (isinstance(seed, int) and not isinstance(seed, bool)):
        return
    if isinstance(seed, Tensor) and not seed.is_floating_point() and not seed.is_complex() and seed.numel() == 1:
        if seed.dtype == torch.bool:
            raise TypeError(f"stochastic_seed must be an integer tensor, got a bool one: {seed!r}")
        return
    raise TypeError(
        f"stochastic_seed must be an int or an integer tensor of one element (or None for round-to-nearest), "
        f"got {seed!r}"
    )


def check_global_amax(global_amax: Tensor | None, rotated_columnwise: bool, device: torch.device) -> None:
    """An NVFP4 global amax given for a shard: fp32, one element, on x's device, for unrotated copies."""
    if global_amax is None:
        return
    _check_one_fp32(global_amax, "global_amax", "the whole tensor's amax", device)
    check_global_amax_unrotated(rotated_columnwise)


def check_splits(m_splits: object, rows: int) -> list[int]:
    """Row counts of consecutive groups of x's rows: integers >= 0 that sum to x's rows."""
    if isinstance(m_splits, Tensor) or not isinstance(m_splits, list | tuple):
        raise TypeError(f"m_splits must be a list of row counts, one per group, got {type(m_splits).__name__}")
    splits = list(m_splits)
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in splits) or sum(splits) != rows:
        raise ValueError(
            f"m_splits={splits} must be integers >= 0 that sum to x's {rows} rows (the product of its leading dims)"
        )
    return splits
