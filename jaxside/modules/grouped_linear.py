"""`GroupedLinear`: num_gemms linear layers over consecutive row groups of one input (MoE experts).

The twin of torchside.modules.grouped_linear. Shape legend: T tokens (all leading dims, flattened),
I in features, O out features, E groups (num_gemms). Parameters `kernel0` .. `kernel{E-1}` [I, O]
and `bias0` .. `bias{E-1}` [O]: torch's `weight{g}` [O, I] is the Flax `kernel{g}` [I, O] (the
bridge's rule for every GEMM weight: "weight" in the name becomes "kernel", the two dims swap).
`__call__(x, m_splits)`: rows m_splits[0] of x go through group 0, the next m_splits[1] through
group 1, and so on (a split may be 0; the splits are Python ints, fixed at trace time).

Inside fp8_autocast each group is GEMM g of this module: its own FP8 slots (DelayedScaling scales
and histories, as torchside's), and the three GEMMs of jaxside.modules.functions.fp8_linear on its
rows. A group with no rows runs no GEMM and gets zero kernel and bias gradients. MXFP8 and NVFP4
blocks run along the rows of the wgrad copies, so with gradients every split must be a multiple of
32 (MXFP8) or 16 (NVFP4) (the quantizer refuses others). The kernels' logical axes and placement
follow `config.parallel_mode` (jaxside.modules.config.KERNEL_AXES), group by group.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.base import FP8Module, Initializer, default_kernel_init, parameter
from jaxside.modules.config import KERNEL_AXES, ModuleConfig, check_config, check_params_dtype, check_size
from jaxside.modules.placement import gathered


def _check_m_splits(m_splits: object, groups: int, tokens: int) -> list[int]:
    if not isinstance(m_splits, Sequence) or isinstance(m_splits, str) or len(m_splits) != groups:
        raise ValueError(f"m_splits={m_splits!r}: pass a list of {groups} row counts (one per group) summing to T")
    splits = list(m_splits)
    if any(isinstance(m, bool) or not isinstance(m, int) or m < 0 for m in splits) or sum(splits) != tokens:
        raise ValueError(
            f"m_splits={splits} must be {groups} Python integers >= 0 that sum to the input's {tokens} rows "
            "(the product of its leading dims)"
        )
    return splits


class GroupedLinear(FP8Module):
    """E linear layers on consecutive row groups of one input, with TransformerEngine's te.GroupedLinear arguments."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype=jnp.float32,
        kernel_init: Initializer | None = None,
        config: ModuleConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        owner = "GroupedLinear"
        groups = check_size(owner, "num_gemms", num_gemms)
        self.in_features = check_size(owner, "in_features", in_features)
        self.out_features = check_size(owner, "out_features", out_features)
        config = check_config(owner, config)
        super().__init__(groups, config)
        dtype = check_params_dtype(owner, params_dtype)
        self.use_bias = bias
        mode, axes, init = config.parallel_mode, KERNEL_AXES[config.parallel_mode], kernel_init or default_kernel_init
        for g in range(groups):
            kernel = parameter(rngs, init, (self.in_features, self.out_features), dtype, axes, "kernel", mode)
            setattr(self, f"kernel{g}", kernel)
        if bias:
            for g in range(groups):
                zeros = nnx.initializers.zeros
                setattr(self, f"bias{g}", parameter(rngs, zeros, (self.out_features,), dtype, axes[1:], "bias", mode))

    def __call__(self, x_TI, m_splits: Sequence[int]) -> Array:
        """y [..., O]: rows m_splits[g] of x (in order) through kernel{g} and bias{g}."""
        if not hasattr(x_TI, "shape") or x_TI.ndim < 1 or x_TI.shape[-1] != self.in_features:
            got = list(x_TI.shape) if hasattr(x_TI, "shape") else type(x_TI).__name__
            raise ValueError(f"GroupedLinear takes x [..., {self.in_features}], got {got}")
        rows = x_TI.reshape(-1, self.in_features)
        splits = _check_m_splits(m_splits, self.num_gemms, rows.shape[0])
        plan = self.fp8_plan()
        parts, start = [], 0
        for g, m in enumerate(splits):
            if m:
                bias = gathered(getattr(self, f"bias{g}")) if self.use_bias else None
                parts.append(self.linear(plan, g, rows[start : start + m], gathered(getattr(self, f"kernel{g}")), bias))
            start += m
        y_TO = jnp.concatenate(parts) if parts else jnp.zeros((0, self.out_features), x_TI.dtype)
        return y_TO.reshape(*x_TI.shape[:-1], self.out_features)
