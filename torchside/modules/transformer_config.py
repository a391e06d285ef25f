"""`TransformerConfig`: the architecture knobs of MultiheadAttention and TransformerLayer, frozen once.

The fields have TransformerEngine's names (`normalization`, `layernorm_epsilon`, `activation`,
`bias`, `fuse_qkv_params`, `attn_mask_type`, `qkv_format`...), so that the constructors keep only
sizes. Three defaults differ from TransformerEngine's: `fuse_qkv_params` is True (one QKV GEMM), and
both dropouts are 0.0 (Llama-style training; set them for GPT-style). `module_config` is the
`ModuleConfig` every FP8 submodule is built with (DelayedScaling history length, TP fields): its
tp_group / tp_size / sequence_parallel split the whole layer (`check_layer_parallelism`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from twinspec.placement import UNIT_MODES
from torchside.modules.config import ModuleConfig
from torchside.modules.layernorm_mlp import ACTIVATIONS
from torchside.modules.normalization import NormSettings

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd")
InitMethod = Callable[[Tensor], object]  # fills a weight in place, e.g. torch.nn.init.normal_


def check_probability(owner: str, name: str, value: object) -> float:
    """A dropout probability: a float in [0, 1), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}({name}={value!r}): pass a float in [0, 1), e.g. 0.0 to switch dropout off")
    return float(value)


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of `choices`, else ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): use one of {', '.join(map(repr, choices))}")
    return value


def check_softmax_scale(owner: str, value: object) -> float | None:
    """None (1 / sqrt(head dim)) or a finite float > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}(softmax_scale={value!r}): pass a finite float > 0, or None for 1/sqrt(head dim)")
    return float(value)


def check_layer_parallelism(owner: str, config: object) -> ModuleConfig:
    """The ModuleConfig of a layer that splits itself over TP; ValueError if it names a parallel_mode.

    Its TP fields (tp_group, tp_size, sequence_parallel, fp8_all_gather) apply to the whole layer, as
    TransformerEngine's with set_parallel_mode=True: the layer gives each child its own mode.
    """
    if not isinstance(config, ModuleConfig):
        raise TypeError(f"{owner}(config={config!r}): pass a torchside.modules.ModuleConfig or None")
    if config.parallel_mode is not None:
        raise ValueError(
            f"{owner} does not take ModuleConfig(parallel_mode={config.parallel_mode!r}): it splits itself over "
            "tp_size (QKV and fc1 column-parallel, output projections row-parallel); leave parallel_mode None"
        )
    return config


def with_parallel_mode(config: ModuleConfig, mode: str | None) -> ModuleConfig:
    """`config` for a child that runs `mode` ("column", "row" or None)."""
    return dataclasses.replace(config, parallel_mode=mode)


@dataclass(frozen=True)
class TransformerConfig:
    """MultiheadAttention / TransformerLayer settings (sizes stay constructor arguments)."""

    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    zero_centered_gamma: bool = False
    activation: str = "gelu"  # a key of torchside.modules.ACTIVATIONS
    glu_interleave: int = 1  # a gated fc1's gate and up rows alternate in runs of this many (LayerNormMLP)
    bias: bool = True  # every projection's bias (TransformerEngine's `bias`)
    qkv_bias: bool | None = None  # the QKV projection's bias alone; None follows `bias`
    fuse_qkv_params: bool = True  # one [Q; K; V] weight and GEMM; False: separate query/key/value weights
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0  # on each sublayer's output, before its residual add
    attn_mask_type: str = "causal"
    qkv_format: str = "sbhd"  # layout of hidden states and q/k/v: [S, B, ...] or [B, S, ...]
    softmax_scale: float | None = None  # None: 1 / sqrt(head dim)
    module_config: ModuleConfig = field(default_factory=ModuleConfig)
    # A placement plan's TP modes (twinspec.placement.UNIT_MODES): "split" over tp_size, or "replicate".
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
        check_probability(owner, "attention_dropout", self.attention_dropout)
        check_probability(owner, "hidden_dropout", self.hidden_dropout)
        check_choice(owner, "attn_mask_type", self.attn_mask_type, MASK_TYPES)
        check_choice(owner, "qkv_format", self.qkv_format, QKV_FORMATS)
        check_softmax_scale(owner, self.softmax_scale)
        if not isinstance(self.module_config, ModuleConfig):
            raise TypeError(f"{owner}(module_config={self.module_config!r}): pass a torchside.modules.ModuleConfig")

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def norm_settings(self) -> NormSettings:
        """The input norms' settings (NormSettings validates them)."""
        return NormSettings(self.normalization, self.layernorm_epsilon, self.zero_centered_gamma)


def check_transformer_config(owner: str, config: TransformerConfig | None) -> TransformerConfig:
    """config, or the default TransformerConfig when None; TypeError for anything else."""
    if config is None:
        return TransformerConfig()
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"{owner}(config={config!r}): pass a torchside.modules.TransformerConfig or None")
    return config


__all__ = [
    "MASK_TYPES",
    "InitMethod",
    "QKV_FORMATS",
    "TransformerConfig",
    "check_choice",
    "check_probability",
    "check_layer_parallelism",
    "check_softmax_scale",
    "check_transformer_config",
    "with_parallel_mode",
]
