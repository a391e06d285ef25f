"""Argument checks shared by the reference quantizers and the Triton launchers (same errors in both)."""

from __future__ import annotations

import torch
from torch import Tensor

from fp8kernels.formats import FORMATS, FloatFormat

INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def matrix_view(x: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """x (any rank >= 1) as [prod(leading dims), last dim] in its own dtype, and its shape."""
    if not isinstance(x, Tensor) or x.dtype not in INPUT_DTYPES:
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise TypeError(f"quantize takes a float32, bfloat16 or float16 tensor, got {got}")
    if x.dim() == 0:
        raise ValueError("quantize needs at least one dim, got a 0-d tensor; reshape it to (1,)")
    return x.reshape(-1, x.shape[-1]), tuple(x.shape)


def check_roles(rowwise: bool, columnwise: bool) -> None:
    """At least one of the two copies must be asked for."""
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False produce nothing; ask for at least one")


def check_divisible(operand_cols: int, multiple: int, scheme: str, role: str) -> None:
    """MXFP8 and NVFP4 blocks must tile each operand row exactly (a row of x, or a column of x)."""
    if operand_cols % multiple:
        dim = "last dim (K)" if role == "rowwise" else "row count (M, the product of the leading dims)"
        other = "columnwise" if role == "rowwise" else "rowwise"
        raise ValueError(
            f"{scheme} {role} needs the {dim} to be a multiple of {multiple}, got {operand_cols}; "
            f"pad the tensor or ask for {other} only"
        )


def element_format(fmt: str, allowed: tuple[str, ...]) -> FloatFormat:
    """The format a quantizer writes, checked against those it supports."""
    if fmt not in allowed:
        raise ValueError(f"fmt={fmt!r} is not supported here; use one of {allowed}")
    return FORMATS[fmt]


def check_block(block: tuple[int, int], allowed: tuple[tuple[int, int], ...], name: str) -> tuple[int, int]:
    """A block shape argument, checked against the ones a scheme defines."""
    block = tuple(block)
    if block not in allowed:
        raise ValueError(f"{name} block={block} is not supported; use one of {allowed}")
    return block


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
    if scale is not None and amax is not None:
        raise ValueError("pass scale (delayed scaling) or amax (current scaling from a given amax), not both")
    if scale is not None and (power_2_scale or amax_epsilon):
        raise ValueError("power_2_scale and amax_epsilon shape a current scale; with a given scale leave them unset")
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
    if rotated_columnwise:
        raise ValueError(
            "global_amax stands for x's amax, not for that of the Hadamard-rotated columnwise copy: "
            "pass hadamard=False, or columnwise=False, or leave global_amax None"
        )


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
