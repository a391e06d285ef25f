"""LayerNorm and RMSNorm modules, and the norm settings LayerNormLinear and LayerNormMLP share.

Shape legend: T tokens (all leading dims), H hidden size (the normalized last dim).

The math and the zero-centered gamma (stored weight = gamma - 1, initialized to 0) are those of
fp8kernels.norm_reference, through `functions.normalize`. No GEMM: these modules have no FP8 state,
only `weight` (and `bias` for LayerNorm), named and laid out as torchside's.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.base import FP8Module, parameter
from jaxside.modules.config import ModuleConfig, check_config, check_params_dtype, check_size
from jaxside.modules.functions import normalize
from jaxside.modules.placement import gathered
from twinspec import transformer_config


class NormSettings(transformer_config.NormSettings):
    """Which norm, its epsilon and whether gamma is stored zero-centered (twinspec's checks), and its parameters."""

    def add_params(
        self, module: nnx.Module, hidden_size: int, prefix: str, dtype, axis: str, rngs: nnx.Rngs, mode: str | None
    ) -> None:
        """Set `{prefix}weight` (ones, or zeros when zero-centered) and, for LayerNorm, `{prefix}bias` (zeros)."""
        gamma_init = nnx.initializers.zeros if self.zero_centered_gamma else nnx.initializers.ones
        shape = (hidden_size,)
        setattr(module, f"{prefix}weight", parameter(rngs, gamma_init, shape, dtype, (axis,), "norm", mode))
        if self.has_bias:
            bias = parameter(rngs, nnx.initializers.zeros, shape, dtype, (axis,), "norm", mode)
            setattr(module, f"{prefix}bias", bias)

    def apply(self, module: nnx.Module, x_TH, prefix: str) -> Array:
        """Normalize x with `module`'s `{prefix}weight` / `{prefix}bias`."""
        bias = gathered(getattr(module, f"{prefix}bias")) if self.has_bias else None
        weight = gathered(getattr(module, f"{prefix}weight"))
        return normalize(
            x_TH, weight, bias, rms=not self.has_bias, eps=self.eps, zero_centered_gamma=self.zero_centered_gamma
        )


class _Normalization(FP8Module):
    normalization: str  # a key of twinspec's NORMALIZATIONS, set by each subclass

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        params_dtype=jnp.float32,
        config: ModuleConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        owner = type(self).__name__
        hidden_size = check_size(owner, "hidden_size", hidden_size)
        config = check_config(owner, config)
        super().__init__(0, config)
        self.hidden_size = hidden_size
        self.norm = NormSettings(self.normalization, eps, zero_centered_gamma)
        dtype = check_params_dtype(owner, params_dtype)
        self.norm.add_params(self, hidden_size, "", dtype, "embed", rngs, config.parallel_mode)

    def __call__(self, x_TH) -> Array:
        return self.norm.apply(self, x_TH, prefix="")


class LayerNorm(_Normalization):
    """LayerNorm over the last dim: (x - mean) * rstd * gamma + bias (TransformerEngine's te.LayerNorm arguments)."""

    normalization = "LayerNorm"


class RMSNorm(_Normalization):
    """RMSNorm over the last dim: x * rstd * gamma (TransformerEngine's te.RMSNorm arguments)."""

    normalization = "RMSNorm"
