"""`LayerNormLinear`: a LayerNorm or RMSNorm, then a linear layer whose GEMMs run in FP8 inside fp8_autocast.

Shape legend: T tokens (all leading dims), I in features (the normalized dim), O out features.
Parameters: `layer_norm_weight` [I] (and `layer_norm_bias` [I] for LayerNorm), `weight` [O, I], `bias` [O].
Column-parallel only (a row split would cut the normalized dim): this rank holds `weight` [O/tp, I]
and `bias` [O/tp]; under sequence parallelism the norm runs on this rank's tokens and the linear
gathers them.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchside.modules.base import FP8Module, ParamSpec, default_init_method
from torchside.modules.config import ModuleConfig, check_parallel_mode, check_size
from torchside.modules.functions import linear
from torchside.modules.normalization import NormSettings


class LayerNormLinear(FP8Module):
    """Norm + linear with TransformerEngine's te.LayerNormLinear arguments; TP settings come from `config`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method=None,
        return_bias: bool = False,
        config: ModuleConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        in_features = check_size("LayerNormLinear", "in_features", in_features)
        out_features = check_size("LayerNormLinear", "out_features", out_features)
        mode = check_parallel_mode("LayerNormLinear", config, ("column", None))
        norm = NormSettings(normalization, eps, zero_centered_gamma)
        params = norm.param_specs(in_features, prefix="layer_norm_")
        weight_init = init_method or default_init_method
        params["weight"] = ParamSpec((out_features, in_features), weight_init, "linear_weight", mode, gemm=0)
        if bias:
            params["bias"] = ParamSpec((out_features,), nn.init.zeros_, "linear_bias", mode)
        super().__init__(
            params, 1, params_dtype=params_dtype, device=device, config=config, tp_mesh=tp_mesh, weight_mesh=weight_mesh
        )
        if not bias:
            self.register_parameter("bias", None)
        self.in_features, self.out_features, self.return_bias = in_features, out_features, return_bias
        self.norm = norm
        self.parallel_mode = mode

    def forward(self, x_TI: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        """y [..., O] (column-parallel: this rank's O/tp); with return_bias, (y without the bias, bias)."""
        plan = self.fp8_plan(x_TI.device)
        quantizers, on_backward_done = (plan.gemms[0], plan.on_backward_done) if plan else (None, None)
        normalized_TI = self.norm.apply(self, x_TI, prefix="layer_norm_", on_backward_done=on_backward_done)
        bias = self.forward_param("bias")
        weight, parallelism = self.forward_param("weight"), self.linear_parallelism("weight")
        y_TO = linear(normalized_TI, weight, None if self.return_bias else bias, quantizers, None, parallelism)
        return (y_TO, bias) if self.return_bias else y_TO

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"normalization={self.norm.normalization}, parallel_mode={self.parallel_mode}, tp_size={self.tp_size}"
        )


__all__ = ["LayerNormLinear"]
