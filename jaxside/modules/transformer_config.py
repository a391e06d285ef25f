"""`TransformerConfig`: the architecture knobs of MultiheadAttention and TransformerLayer (torchside's twin).

The fields, their names and defaults are torchside.modules.transformer_config's (TransformerEngine's
names; `fuse_qkv_params` True and both dropouts 0.0 by default); `module_config` is a
jaxside.modules.ModuleConfig. One difference: dropout is not implemented here (no random stream is
shared with torch, so a dropped run could not be compared anyway), so both dropouts must be 0.0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from jaxside.modules.config import ModuleConfig
from jaxside.modules.layernorm_mlp import ACTIVATIONS
from jaxside.modules.normalization import NormSettings
from twinspec.placement import UNIT_MODES

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd")


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of `choices`, else ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): use one of {', '.join(map(repr, choices))}")
    return value


def check_no_dropout(owner: str, name: str, value: object) -> float:
    """0.0, else ValueError: the JAX twin has no dropout."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != 0:
        raise ValueError(
            f"{owner}({name}={value!r}): jaxside has no dropout (its random masks could not match torch's); "
            "pass 0.0 and add dropout outside the module if training needs it"
        )
    return 0.0


def check_softmax_scale(owner: str, value: object) -> float | None:
    """None (1 / sqrt(head dim)) or a finite float > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}(softmax_scale={value!r}): pass a finite float > 0, or None for 1/sqrt(head dim)")
    return float(value)


@dataclass(frozen=True)
class TransformerConfig:
    """MultiheadAttention / TransformerLayer settings (sizes stay constructor arguments)."""

    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    zero_centered_gamma: bool = False
    activation: str = "gelu"  # a key of jaxside.modules.ACTIVATIONS
    glu_interleave: int = 1  # a gated fc1's gate and up rows alternate in runs of this many (LayerNormMLP)
    bias: bool = True  # every projection's bias
    qkv_bias: bool | None = None  # the QKV projection's bias alone; None follows `bias`
    fuse_qkv_params: bool = True  # one [Q; K; V] kernel and GEMM; False: separate query/key/value kernels
    attention_dropout: float = 0.0  # must be 0.0 (module docstring)
    hidden_dropout: float = 0.0  # must be 0.0 (module docstring)
    attn_mask_type: str = "causal"
    qkv_format: str = "sbhd"  # layout of hidden states and q/k/v: [S, B, ...] or [B, S, ...]
    softmax_scale: float | None = None  # None: 1 / sqrt(head dim)
    module_config: ModuleConfig = field(default_factory=ModuleConfig)
    # A placement plan's TP modes (twinspec.placement.UNIT_MODES): "split" over the mesh's tp, or "replicate".
    attention_tp: str = "split"
    mlp_tp: str = "split"

    def __post_init__(self) -> None:
        owner = "TransformerConfig"
        check_choice(owner, "attention_tp", self.attention_tp, tuple(UNIT_MODES["attention"]))
        check_choice(owner, "mlp_tp", self.mlp_tp, tuple(UNIT_MODES["mlp"]))
        if self.kv_channels is not None and (
            isinstance(self.kv_channels, bool) or not isinstance(self.kv_channels, int) or self.kv_channels < 1
        ):
            raise ValueError(f"{owner}(kv_channels={self.kv_channels!r}): pass an integer >= 1, or None")
        self.norm_settings()  # validates normalization, layernorm_epsilon, zero_centered_gamma
        check_choice(owner, "activation", self.activation, tuple(ACTIVATIONS))
        for name in ("bias", "fuse_qkv_params"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}({name}={getattr(self, name)!r}): pass True or False")
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise TypeError(f"{owner}(qkv_bias={self.qkv_bias!r}): pass True, False or None (follow `bias`)")
        check_no_dropout(owner, "attention_dropout", self.attention_dropout)
        check_no_dropout(owner, "hidden_dropout", self.hidden_dropout)
        check_choice(owner, "attn_mask_type", self.attn_mask_type, MASK_TYPES)
        check_choice(owner, "qkv_format", self.qkv_format, QKV_FORMATS)
        check_softmax_scale(owner, self.softmax_scale)
        if not isinstance(self.module_config, ModuleConfig):
            raise TypeError(f"{owner}(module_config={self.module_config!r}): pass a jaxside.modules.ModuleConfig")
        if self.module_config.parallel_mode is not None:
            raise ValueError(
                f"{owner}(module_config=ModuleConfig(parallel_mode={self.module_config.parallel_mode!r})): the "
                "layers fix their own modes (QKV and fc1 column, proj and fc2 row); leave it None"
            )

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def norm_settings(self) -> NormSettings:
        """The input norms' settings (NormSettings validates them)."""
        return NormSettings(self.normalization, self.layernorm_epsilon, self.zero_centered_gamma)
