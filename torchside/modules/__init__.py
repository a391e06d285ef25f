"""TransformerEngine-style modules whose GEMMs run in FP8 inside `torchside.autocast.fp8_autocast`.

`Linear`, `LayerNormLinear` (LayerNorm or RMSNorm), `LayerNormMLP`, `LayerNorm`, `RMSNorm`,
`DotProductAttention`, `MultiheadAttention`, `TransformerLayer` (settings in a frozen
`TransformerConfig`) and `GroupedLinear` (MoE: every group's GEMM in one call of
`fp8kernels.grouped_gemm`); tensor parallel through `ModuleConfig` and `set_device_mesh`.
"""

from torchside.modules.attention import DotProductAttention
from torchside.modules.base import (
    FP8Module,
    ParamSpec,
    clear_high_precision_init_val,
    default_init_method,
    high_precision_init_val,
)
from torchside.modules.config import ModuleConfig
from torchside.modules.grouped_linear import GroupedLinear
from torchside.modules.layernorm_linear import LayerNormLinear
from torchside.modules.layernorm_mlp import ACTIVATIONS, LayerNormMLP
from torchside.modules.linear import Linear
from torchside.modules.multihead_attention import MultiheadAttention
from torchside.modules.normalization import LayerNorm, RMSNorm
from torchside.modules.rotary import RotaryPositionEmbedding, apply_rotary_pos_emb
from torchside.modules.transformer_config import TransformerConfig
from torchside.modules.transformer_layer import TransformerLayer

__all__ = [
    "ACTIVATIONS",
    "DotProductAttention",
    "FP8Module",
    "GroupedLinear",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "ModuleConfig",
    "MultiheadAttention",
    "ParamSpec",
    "RMSNorm",
    "RotaryPositionEmbedding",
    "TransformerConfig",
    "TransformerLayer",
    "apply_rotary_pos_emb",
    "clear_high_precision_init_val",
    "default_init_method",
    "high_precision_init_val",
]
