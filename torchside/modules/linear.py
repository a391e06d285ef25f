"""`Linear`: y = x @ weight.T + bias, with FP8 GEMMs inside fp8_autocast, split over TP by its config.

Shape legend: T tokens (all leading dims), I in features, O out features. `weight` is [O, I]
globally; this rank holds [O/tp, I] ("column": bias [O/tp], output features split) or [O, I/tp]
("row": input features split, bias [O] added once after the reduction).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchside.modules.base import FP8Module, ParamSpec, default_init_method
from torchside.modules.config import ModuleConfig, check_parallel_mode, check_size
from torchside.modules.functions import linear


class Linear(FP8Module):
    """A linear layer with TransformerEngine's te.Linear arguments; TP settings come from `config`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = True,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method=None,
        return_bias: bool = False,
        config: ModuleConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        in_features = check_size("Linear", "in_features", in_features)
        out_features = check_size("Linear", "out_features", out_features)
        mode = check_parallel_mode("Linear", config, ("column", "row", None))
        weight_init = init_method or default_init_method
        params = {"weight": ParamSpec((out_features, in_features), weight_init, "linear_weight", mode, gemm=0)}
        if bias:
            params["bias"] = ParamSpec((out_features,), nn.init.zeros_, "linear_bias", mode)
        super().__init__(
            params, 1, params_dtype=params_dtype, device=device, config=config, tp_mesh=tp_mesh, weight_mesh=weight_mesh
        )
        if not bias:
            self.register_parameter("bias", None)
        self.in_features, self.out_features, self.return_bias = in_features, out_features, return_bias
        self.parallel_mode = mode

    def forward(self, x_TI: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        """y [..., O] (column-parallel: this rank's O/tp); with return_bias, (y without the bias, bias)."""
        plan = self.fp8_plan(x_TI.device)
        quantizers, on_backward_done = (plan.gemms[0], plan.on_backward_done) if plan else (None, None)
        bias = self.forward_param("bias")
        y_TO = linear(
            x_TI,
            self.forward_param("weight"),
            None if self.return_bias else bias,
            quantizers,
            on_backward_done,
            self.linear_parallelism("weight"),
        )
        return (y_TO, bias) if self.return_bias else y_TO

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"parallel_mode={self.parallel_mode}, tp_size={self.tp_size}"
        )


__all__ = ["Linear"]
