"""The architecture knobs of MultiheadAttention and TransformerLayer, and their checks, once for both frameworks.

The fields have TransformerEngine's names (`normalization`, `layernorm_epsilon`, `activation`,
`bias`, `fuse_qkv_params`, `attn_mask_type`, `qkv_format`...), so that the constructors keep only
sizes. Three defaults differ from TransformerEngine's: `fuse_qkv_params` is True (one QKV GEMM), and
both dropouts are 0.0 (Llama-style training; set them for GPT-style).

Each framework's `TransformerConfig` (torchside.modules, jaxside.modules) subclasses
`TransformerSettings`: it gives `module_config` its own ModuleConfig and names its activation table
and NormSettings; jaxside also refuses dropout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from twinspec.placement import UNIT_MODES

MASK_TYPES = ("no_mask", "causal", "padding", "padding_causal", "arbitrary")
QKV_FORMATS = ("sbhd", "bshd")
NORMALIZATIONS = {"LayerNorm": True, "RMSNorm": False}  # name -> has a bias (and subtracts the mean)


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    """One of `choices`, else ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): use one of {', '.join(map(repr, choices))}")
    return value


def check_probability(owner: str, name: str, value: object) -> float:
    """A dropout probability: a float in [0, 1), else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value < 1.0:
        raise ValueError(f"{owner}({name}={value!r}): pass a float in [0, 1), e.g. 0.0 to switch dropout off")
    return float(value)


def check_softmax_scale(owner: str, value: object) -> float | None:
    """None (1 / sqrt(head dim)) or a finite float > 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}(softmax_scale={value!r}): pass a finite float > 0, or None for 1/sqrt(head dim)")
    return float(value)


@dataclass(frozen=True)
class NormSettings:
    """Which norm, its epsilon and whether gamma is stored zero-centered (each framework adds its parameters)."""

    normalization: str = "LayerNorm"
    eps: float = 1e-5
    zero_centered_gamma: bool = False

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization={self.normalization!r}: use 'LayerNorm' or 'RMSNorm'")
        eps = self.eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps={eps!r}: pass a finite float >= 0, e.g. 1e-5")
        if not isinstance(self.zero_centered_gamma, bool):
            raise TypeError(f"zero_centered_gamma={self.zero_centered_gamma!r}: pass True or False")

    @property
    def has_bias(self) -> bool:
        return NORMALIZATIONS[self.normalization]


@dataclass(frozen=True)
class TransformerSettings:
    """MultiheadAttention / TransformerLayer settings (sizes stay constructor arguments)."""

    activations: ClassVar[tuple[str, ...]] = ()  # the framework's activation table's names (set by the subclass)
    norm_class: ClassVar[type[NormSettings]] = NormSettings  # the framework's, which adds the norm's parameters
    module_config_class: ClassVar[type] = object  # the framework's ModuleConfig

    kv_channels: int | None = None  # head dim; None: hidden_size // num_attention_heads
    normalization: str = "LayerNorm"  # or "RMSNorm"
    layernorm_epsilon: float = 1e-5
    zero_centered_gamma: bool = False
    activation: str = "gelu"  # a key of the framework's modules.ACTIVATIONS
    glu_interleave: int = 1  # a gated fc1's gate and up rows alternate in runs of this many (LayerNormMLP)
    bias: bool = True  # every projection's bias (TransformerEngine's `bias`)
    qkv_bias: bool | None = None  # the QKV projection's bias alone; None follows `bias`
    fuse_qkv_params: bool = True  # one [Q; K; V] weight and GEMM; False: separate query/key/value weights
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0  # on each sublayer's output, before its residual add
    attn_mask_type: str = "causal"
    qkv_format: str = "sbhd"  # layout of hidden states and q/k/v: [S, B, ...] or [B, S, ...]
    softmax_scale: float | None = None  # None: 1 / sqrt(head dim)
    module_config: object = None  # the framework's ModuleConfig every FP8 submodule is built with (subclass)
    # A placement plan's TP modes (twinspec.placement.UNIT_MODES): "split" over tp_size, or "replicate".
    attention_tp: str = "split"
    mlp_tp: str = "split"

    def __post_init__(self) -> None:
        owner = "TransformerConfig"
        for name, unit in (("attention_tp", "attention"), ("mlp_tp", "mlp")):  # a placement plan's TP modes
            check_choice(owner, name, getattr(self, name), tuple(UNIT_MODES[unit]))
        if self.kv_channels is not None and (
            isinstance(self.kv_channels, bool) or not isinstance(self.kv_channels, int) or self.kv_channels < 1
        ):
            raise ValueError(f"{owner}(kv_channels={self.kv_channels!r}): pass an integer >= 1, or None")
        self.norm_settings()  # validates normalization, layernorm_epsilon, zero_centered_gamma
        check_choice(owner, "activation", self.activation, self.activations)
        for name in ("bias", "fuse_qkv_params"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{owner}({name}={getattr(self, name)!r}): pass True or False")
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise TypeError(f"{owner}(qkv_bias={self.qkv_bias!r}): pass True, False or None (follow `bias`)")
        self.check_dropout(owner, "attention_dropout", self.attention_dropout)
        self.check_dropout(owner, "hidden_dropout", self.hidden_dropout)
        check_choice(owner, "attn_mask_type", self.attn_mask_type, MASK_TYPES)
        check_choice(owner, "qkv_format", self.qkv_format, QKV_FORMATS)
        check_softmax_scale(owner, self.softmax_scale)
        if not isinstance(self.module_config, self.module_config_class):
            package = self.module_config_class.__module__.rpartition(".")[0]  # where users import it from
            raise TypeError(
                f"{owner}(module_config={self.module_config!r}): pass a {package}.{self.module_config_class.__name__}"
            )

    def check_dropout(self, owner: str, name: str, value: object) -> float:
        """A dropout probability this framework runs (a float in [0, 1) here)."""
        return check_probability(owner, name, value)

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def norm_settings(self) -> NormSettings:
        """The input norms' settings, as the framework's NormSettings."""
        return self.norm_class(self.normalization, self.layernorm_epsilon, self.zero_centered_gamma)


__all__ = [
    "MASK_TYPES",
    "NORMALIZATIONS",
    "QKV_FORMATS",
    "NormSettings",
    "TransformerSettings",
    "check_choice",
    "check_probability",
    "check_softmax_scale",
]
