"""LayerNorm and RMSNorm modules, and the norm settings LayerNormLinear and LayerNormMLP share.

Shape legend: T tokens (all leading dims), H hidden size (the normalized last dim).

The math and the zero-centered gamma (stored weight = gamma - 1, initialized to 0) are those of
`fp8kernels.norm_reference`; the kernels run through `functions.normalize`. No GEMM: these modules
have no FP8 state, only the parameters `weight` (and `bias` for LayerNorm), replicated over TP;
under sequence parallelism each rank normalizes its own tokens and the parameter gradients are
all-reduced over the TP group.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchside.modules.base import FP8Module, ParamSpec
from torchside.modules.config import ModuleConfig, check_parallel_mode, check_size
from torchside.modules.functions import BackwardHook, normalize
from twinspec import transformer_config
from twinspec.transformer_config import NORMALIZATIONS


class NormSettings(transformer_config.NormSettings):
    """Which norm, its epsilon and whether gamma is stored zero-centered (twinspec's checks), and its parameters."""

    def param_specs(self, hidden_size: int, prefix: str) -> dict[str, ParamSpec]:
        """`{prefix}weight` (ones, or zeros when zero-centered) and, for LayerNorm, `{prefix}bias` (zeros)."""
        gamma_init = nn.init.zeros_ if self.zero_centered_gamma else nn.init.ones_
        specs = {f"{prefix}weight": ParamSpec((hidden_size,), gamma_init, "norm")}
        if self.has_bias:
            specs[f"{prefix}bias"] = ParamSpec((hidden_size,), nn.init.zeros_, "norm")
        return specs

    def apply(self, module: FP8Module, x_TH: Tensor, prefix: str, on_backward_done: BackwardHook = None) -> Tensor:
        """Normalize x with `module`'s `{prefix}weight` / `{prefix}bias`."""
        bias = module.forward_param(f"{prefix}bias") if self.has_bias else None
        return normalize(
            x_TH,
            module.forward_param(f"{prefix}weight"),
            bias,
            rms=not self.has_bias,
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
            on_backward_done=on_backward_done,
        )


class _Normalization(FP8Module):
    normalization: str  # a key of twinspec's NORMALIZATIONS, set by each subclass

    def __init__(
        self,
        hidden_size: int,
        *,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        config: ModuleConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        owner = type(self).__name__
        hidden_size = check_size(owner, "hidden_size", hidden_size)
        check_parallel_mode(owner, config, (None,))
        norm = NormSettings(self.normalization, eps, zero_centered_gamma)
        params = norm.param_specs(hidden_size, prefix="")
        super().__init__(
            params, 0, params_dtype=params_dtype, device=device, config=config, tp_mesh=tp_mesh, weight_mesh=weight_mesh
        )
        self.hidden_size = hidden_size
        self.norm = norm

    def forward(self, x_TH: Tensor) -> Tensor:
        return self.norm.apply(self, x_TH, prefix="")

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.norm.eps}, zero_centered_gamma={self.norm.zero_centered_gamma}"


class LayerNorm(_Normalization):
    """LayerNorm over the last dim: (x - mean) * rstd * gamma + bias (TransformerEngine's te.LayerNorm arguments)."""

    normalization = "LayerNorm"


class RMSNorm(_Normalization):
    """RMSNorm over the last dim: x * rstd * gamma (TransformerEngine's te.RMSNorm arguments)."""

    normalization = "RMSNorm"


__all__ = ["NORMALIZATIONS", "LayerNorm", "NormSettings", "RMSNorm"]
