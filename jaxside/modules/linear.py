"""`Linear` and `LayerNormLinear`: y = x @ kernel + bias (after a LayerNorm or RMSNorm), FP8 inside fp8_autocast.

Shape legend: T tokens (all leading dims), I in features, O out features. `kernel` is Flax's [I, O]
(torchside's `weight` [O, I] transposed); `bias` [O]; LayerNormLinear adds `layer_norm_weight` [I]
(and `layer_norm_bias` [I] for LayerNorm). The kernel's logical axes default to ("embed", "mlp"),
("mlp", "embed") for a row-parallel layer (see jaxside.modules.config.KERNEL_AXES).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.base import FP8Module, Initializer, default_kernel_init, parameter
from jaxside.modules.config import KERNEL_AXES, ModuleConfig, check_config, check_params_dtype, check_size
from jaxside.modules.normalization import NormSettings
from jaxside.modules.placement import gathered


class _Projection(FP8Module):
    """What Linear and LayerNormLinear share: the kernel and bias, and the GEMM over them."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        params_dtype,
        kernel_init: Initializer | None,
        kernel_axes: Sequence[str] | None,
        return_bias: bool,
        config: ModuleConfig | None,
        rngs: nnx.Rngs,
    ) -> None:
        owner = type(self).__name__
        self.in_features = check_size(owner, "in_features", in_features)
        self.out_features = check_size(owner, "out_features", out_features)
        config = check_config(owner, config)
        super().__init__(1, config)
        self.params_dtype = check_params_dtype(owner, params_dtype)
        self.kernel_axes = tuple(kernel_axes or KERNEL_AXES[config.parallel_mode])
        self.return_bias = return_bias
        mode = config.parallel_mode
        shape = (self.in_features, self.out_features)
        init = kernel_init or default_kernel_init
        self.kernel = parameter(rngs, init, shape, self.params_dtype, self.kernel_axes, "kernel", mode)
        out_axes, zeros = self.kernel_axes[1:], nnx.initializers.zeros
        self.bias = parameter(rngs, zeros, shape[1:], self.params_dtype, out_axes, "bias", mode) if bias else None

    def _project(self, plan, x_TI) -> Array | tuple[Array, Array | None]:
        bias = None if self.bias is None else gathered(self.bias)
        y_TO = self.linear(plan, 0, x_TI, gathered(self.kernel), None if self.return_bias else bias)
        return (y_TO, bias) if self.return_bias else y_TO


class Linear(_Projection):
    """A linear layer with TransformerEngine's te.Linear arguments (Flax's kernel layout and initializer names)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype=jnp.float32,
        kernel_init: Initializer | None = None,
        kernel_axes: Sequence[str] | None = None,
        return_bias: bool = False,
        config: ModuleConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        super().__init__(
            in_features,
            out_features,
            bias=bias,
            params_dtype=params_dtype,
            kernel_init=kernel_init,
            kernel_axes=kernel_axes,
            return_bias=return_bias,
            config=config,
            rngs=rngs,
        )

    def __call__(self, x_TI) -> Array | tuple[Array, Array | None]:
        """y [..., O]; with return_bias, (y without the bias, bias) for the caller to fuse."""
        return self._project(self.fp8_plan(), x_TI)


class LayerNormLinear(_Projection):
    """Norm + linear with TransformerEngine's te.LayerNormLinear arguments (Flax's kernel layout)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        params_dtype=jnp.float32,
        kernel_init: Initializer | None = None,
        kernel_axes: Sequence[str] | None = None,
        return_bias: bool = False,
        config: ModuleConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        self.norm = NormSettings(normalization, eps, zero_centered_gamma)
        super().__init__(
            in_features,
            out_features,
            bias=bias,
            params_dtype=params_dtype,
            kernel_init=kernel_init,
            kernel_axes=kernel_axes,
            return_bias=return_bias,
            config=config,
            rngs=rngs,
        )
        mode = self.config.parallel_mode
        self.norm.add_params(self, self.in_features, "layer_norm_", self.params_dtype, self.kernel_axes[0], rngs, mode)

    def __call__(self, x_TI) -> Array | tuple[Array, Array | None]:
        """y [..., O]; with return_bias, (y without the bias, bias) for the caller to fuse."""
        plan = self.fp8_plan()
        return self._project(plan, self.norm.apply(self, x_TI, prefix="layer_norm_"))
