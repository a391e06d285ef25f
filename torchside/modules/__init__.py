"""TransformerEngine-style modules whose GEMMs run in FP8 inside `torchside.autocast.fp8_autocast`.

`Linear`, `LayerNormLinear` (LayerNorm or RMSNorm), `LayerNormMLP`, `LayerNorm`, `RMSNorm`. Shared
settings (DelayedScaling history length; tensor parallelism, later) go in a frozen `ModuleConfig`.
"""

from torchside.modules.base import (
    FP8Module,
    ParamSpec,
    clear_high_precision_init_val,
    default_init_method,
    high_precision_init_val,
)
from torchside.modules.config import ModuleConfig
from torchside.modules.layernorm_linear import LayerNormLinear
from torchside.modules.layernorm_mlp import ACTIVATIONS, LayerNormMLP
from torchside.modules.linear import Linear
from torchside.modules.normalization import LayerNorm, RMSNorm

__all__ = [
    "ACTIVATIONS",
    "FP8Module",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "ModuleConfig",
    "ParamSpec",
    "RMSNorm",
    "clear_high_precision_init_val",
    "default_init_method",
    "high_precision_init_val",
]
