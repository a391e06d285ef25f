"""`Linear`: y = x @ weight.T + bias, with FP8 GEMMs inside fp8_autocast.

Shape legend: T tokens (all leading dims), I in features, O out features. `weight` is [O, I].
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchside.modules.base import FP8Module, ParamSpec, default_init_method
from torchside.modules.config import ModuleConfig, check_size
from torchside.modules.functions import linear


class Linear(FP8Module):
    """A linear layer with TransformerEngine's te.Linear arguments (tensor parallelism: ModuleConfig, later)."""

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
    ) -> None:
        in_features = check_size("Linear", "in_features", in_features)
        out_features = check_size("Linear", "out_features", out_features)
        params = {"weight": ParamSpec((out_features, in_features), init_method or default_init_method, gemm=0)}
        if bias:
            params["bias"] = ParamSpec((out_features,), nn.init.zeros_)
        super().__init__(params, 1, params_dtype=params_dtype, device=device, config=config)
        if not bias:
            self.register_parameter("bias", None)
        self.in_features, self.out_features, self.return_bias = in_features, out_features, return_bias

    def forward(self, x_TI: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        """y [..., O]; with return_bias, (y without the bias, bias) for the caller to fuse."""
        plan = self.fp8_plan(x_TI.device)
        quantizers, on_backward_done = (plan.gemms[0], plan.on_backward_done) if plan else (None, None)
        y_TO = linear(x_TI, self.weight, None if self.return_bias else self.bias, quantizers, on_backward_done)
        return (y_TO, self.bias) if self.return_bias else y_TO

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


__all__ = ["Linear"]
