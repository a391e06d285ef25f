"""The noise-aware end-to-end verdict under an FP8 recipe (bridge.numerics' docstring, docs/verification.md).

Both frameworks ran the model twice, under the recipe and with FP8 off (the reference). With
e_t = torch_fp8 - torch_ref and e_j = jax_fp8 - jax_ref, row by row (rows: all leading dims):

- same distance: a paired t-test on ||e_t,r||^2 - ||e_j,r||^2 accepts equal means (two-sided,
  FALSE_ALARM); as a distance: | ||e_t|| - ||e_j|| | <= t * sd * sqrt(n) / (||e_t|| + ||e_j||);
- not apart: the cross term s_r = -2 <e_t,r, e_j,r> is not significantly positive (one-sided), so
  ||e_t - e_j||^2 <= ||e_t||^2 + ||e_j||^2 + t * sd(s) * sqrt(n); with the references' own distance
  that bounds ||torch_fp8 - jax_fp8||.

Distances are relative to ||torch_fp8|| (the other checks divide by torch's value too).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from bridge.numerics import FALSE_ALARM


@dataclass(frozen=True)
class NoiseVerdict:
    """The two noise checks of one tensor: (measured, bound) each, relative to ||torch_fp8||."""

    apart: tuple[float, float]  # ||torch_fp8 - jax_fp8|| and its bound
    same_distance: tuple[float, float]  # | ||e_t|| - ||e_j|| | and its bound
    max_abs: float
    nan: bool


def _rows(x: torch.Tensor) -> torch.Tensor:
    x = x.detach().cpu().to(torch.float64)
    return x.reshape(-1, x.shape[-1]) if x.ndim >= 2 else x.reshape(-1, 1)


def _t_quantile(probability: float, rows: int) -> float:
    from scipy.stats import t

    return float(t.isf(probability, rows - 1))


def _margin(values: torch.Tensor, probability: float) -> float:
    """t * sd * sqrt(n) of per-row values: how far their sum may stray from its mean's bound by chance."""
    rows = values.numel()
    if rows < 2:
        return 0.0
    return _t_quantile(probability, rows) * float(values.std()) * math.sqrt(rows)


def noise_verdict(torch_fp8, jax_fp8, torch_ref, jax_ref) -> NoiseVerdict:
    """The noise-aware checks of one tensor (module docstring)."""
    t8, j8, tr, jr = map(_rows, (torch_fp8, jax_fp8, torch_ref, jax_ref))
    nan = bool(torch.isnan(t8).any() or torch.isnan(j8).any())
    e_t, e_j = t8 - tr, j8 - jr
    sq_t, sq_j = e_t.square().sum(1), e_j.square().sum(1)
    cross = -2 * (e_t * e_j).sum(1)
    norm = float(t8.norm()) or 1.0
    reference_gap = float((tr - jr).norm())
    apart_bound = math.sqrt(max(float(sq_t.sum() + sq_j.sum()) + _margin(cross, FALSE_ALARM), 0.0))
    apart = float((t8 - j8).norm())
    d_t, d_j = math.sqrt(float(sq_t.sum())), math.sqrt(float(sq_j.sum()))
    same_bound = _margin(sq_t - sq_j, FALSE_ALARM / 2) / (d_t + d_j) if d_t + d_j > 0 else 0.0
    max_abs = float((t8 - j8).abs().max()) if t8.numel() else 0.0
    slack = 1 + 1e-9  # float64 evaluation of these norms (an exact equality must not fail by an ulp)
    return NoiseVerdict(
        apart=(apart / norm, slack * (apart_bound + reference_gap) / norm),
        same_distance=(abs(d_t - d_j) / norm, slack * same_bound / norm),
        max_abs=max_abs,
        nan=nan,
    )


__all__ = ["NoiseVerdict", "noise_verdict"]
