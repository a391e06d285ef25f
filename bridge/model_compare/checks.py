"""TensorChecks of `bridge.compare`: one distance between torch's and JAX's tensors against its bound."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bridge.numerics import TensorCheck, Tolerance, local_stats, reduce_stats


def distance_check(
    stage: str, name: str, got: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], bound: float
) -> TensorCheck:
    """JAX's tensors `got` against torch's `expected` (all of them as one vector): relative distance <= bound."""
    if len(got) != len(expected):
        raise ValueError(f"{name}: torch gives {len(expected)} floating-point outputs, JAX {len(got)}; make them match")
    rows = []
    for a, b in zip(got, expected):
        if tuple(a.shape) != tuple(b.shape):
            raise ValueError(f"{name} ({stage}): torch's is {list(b.shape)}, JAX's {list(a.shape)}; make them match")
        rows.append(local_stats(a.cpu(), b.cpu(), 1))  # JAX's results come back on the CPU
    stacked = torch.stack(rows)
    summed = torch.cat([stacked[:, :3].sum(0), stacked[:, 3].max().reshape(1)])
    relative, max_abs, nan = reduce_stats(summed[None])[0]
    limit = Tolerance(bound)
    return TensorCheck(0, stage, name, relative, max_abs, nan, limit, limit.passes(relative, max_abs, nan))


def bounded_check(stage: str, name: str, measured: float, bound: float, max_abs: float, nan: bool) -> TensorCheck:
    """A check whose distance was measured elsewhere (the noise-aware verdicts)."""
    limit = Tolerance(bound)
    return TensorCheck(0, stage, name, measured, max_abs, nan, limit, limit.passes(measured, max_abs, nan))


__all__ = ["bounded_check", "distance_check"]
