"""TransformerEngine's `TransformerLayer` keywords, mapped onto `TransformerConfig` by one table.

Users arrive with `te.pytorch.TransformerLayer(hidden_size, ffn_hidden_size, num_attention_heads,
normalization="RMSNorm", activation="swiglu", ...)`. `TE_KEYWORDS` says, for each keyword we take,
which `TransformerConfig` fields it sets ("module_config.x": the `ModuleConfig`'s x) and how its
value becomes theirs. A keyword with no field is accepted only at the values we honour (TE's
default, mostly); any other value is a ValueError saying what is supported, never ignored.
`seq_length` and `micro_batch_size` only size TE's JIT warm-up: nothing here needs them.

Keywords left out take `TransformerConfig`'s defaults, not TE's: both dropouts 0.0 (TE: 0.1),
`fuse_qkv_params` True (TE: False), the layer split over tp_size (TE: `set_parallel_mode=False`).
`num_gqa_groups`, `params_dtype`, `device`, `init_method` and `output_layer_init_method` are
constructor arguments under the same names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchside.modules.transformer_config import TransformerConfig, check_transformer_config

MODULE_CONFIG = "module_config."  # the prefix of a field of TransformerConfig.module_config


def _as_is(value: object) -> tuple:
    return (value,)


def _split_or_replicate(set_parallel_mode: object) -> tuple[str, str]:
    """TE's set_parallel_mode=True splits QKV/fc1 by columns and proj/fc2 by rows; False keeps both whole."""
    if not isinstance(set_parallel_mode, bool):
        raise TypeError("pass True (split the layer over tp_size) or False (replicate it)")
    mode = "split" if set_parallel_mode else "replicate"
    return mode, mode


def _jit_warmup_size(value: object) -> tuple:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError("pass an integer >= 1 or None (TransformerEngine sizes its JIT warm-up with it)")
    return ()


def _only(*supported: object, why: str) -> Callable[[object], tuple]:
    """A check that accepts the `supported` values only (they set no field); ValueError saying `why`."""

    def check(value: object) -> tuple:
        if value not in supported:
            raise ValueError(f"{why}; supported: {', '.join(map(repr, supported))}")
        return ()

    return check


@dataclass(frozen=True)
class TEKeyword:
    """The TransformerConfig fields one TE keyword sets, and its value -> their values (raises if not honoured)."""

    fields: tuple[str, ...] = ()
    translate: Callable[[Any], tuple] = _as_is

    def apply(self, config: TransformerConfig, value: object) -> TransformerConfig:
        values = dict(zip(self.fields, self.translate(value), strict=True))
        if not values:
            return config  # a keyword with no field: checked, and `config` stays the object given
        own = {name: v for name, v in values.items() if not name.startswith(MODULE_CONFIG)}
        shared = {name.removeprefix(MODULE_CONFIG): v for name, v in values.items() if name.startswith(MODULE_CONFIG)}
        if shared:
            own["module_config"] = dataclasses.replace(config.module_config, **shared)
        return dataclasses.replace(config, **own)


TE_KEYWORDS: dict[str, TEKeyword] = {
    "kv_channels": TEKeyword(("kv_channels",)),
    "normalization": TEKeyword(("normalization",)),
    "layernorm_epsilon": TEKeyword(("layernorm_epsilon",)),
    "zero_centered_gamma": TEKeyword(("zero_centered_gamma",)),
    "activation": TEKeyword(("activation",)),
    "bias": TEKeyword(("bias",)),
    "fuse_qkv_params": TEKeyword(("fuse_qkv_params",)),
    "attention_dropout": TEKeyword(("attention_dropout",)),
    "hidden_dropout": TEKeyword(("hidden_dropout",)),
    "self_attn_mask_type": TEKeyword(("attn_mask_type",)),
    "attn_input_format": TEKeyword(("qkv_format",)),
    "tp_group": TEKeyword((MODULE_CONFIG + "tp_group",)),
    "tp_size": TEKeyword((MODULE_CONFIG + "tp_size",)),
    "sequence_parallel": TEKeyword((MODULE_CONFIG + "sequence_parallel",)),
    "set_parallel_mode": TEKeyword(("attention_tp", "mlp_tp"), _split_or_replicate),
    "seq_length": TEKeyword(translate=_jit_warmup_size),
    "micro_batch_size": TEKeyword(translate=_jit_warmup_size),
    "layer_type": TEKeyword(translate=_only("encoder", why="decoder layers (cross-attention) are not supported")),
    "output_layernorm": TEKeyword(translate=_only(False, why="the norms sit on the input side only (pre-norm)")),
    "apply_residual_connection_post_layernorm": TEKeyword(
        translate=_only(False, why="the residual is taken before the norm")
    ),
    "parallel_attention_mlp": TEKeyword(translate=_only(False, why="the MLP runs after attention, not beside it")),
    "window_size": TEKeyword(translate=_only(None, (-1, -1), why="sliding-window attention is not supported")),
    "drop_path_rate": TEKeyword(translate=_only(0.0, why="stochastic depth is not supported")),
    "fuse_wgrad_accumulation": TEKeyword(translate=_only(False, why="weight gradients go to .grad (no main_grad)")),
    "get_rng_state_tracker": TEKeyword(translate=_only(None, why="dropout draws from torch's default generator")),
    "ub_tp_comm_overlap": TEKeyword(translate=_only(False, why="no userbuffers overlap of TP communication")),
}


def _spelled_in_config(field: str) -> str:
    if field.startswith(MODULE_CONFIG):
        return f"TransformerConfig(module_config=ModuleConfig({field.removeprefix(MODULE_CONFIG)}=...))"
    return f"TransformerConfig({field}=...)"


def config_from_te_keywords(
    owner: str, config: TransformerConfig | None, keywords: dict[str, object]
) -> TransformerConfig:
    """`config` (or the default TransformerConfig) with TE's `keywords` applied, checked before any work.

    TypeError for a keyword not in TE_KEYWORDS, or one that sets a field `config` already holds;
    the error of a value we cannot honour names the keyword and the value.
    """
    unknown = sorted(set(keywords) - set(TE_KEYWORDS))
    if unknown:
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {unknown[0]!r}; the TransformerEngine keywords it takes: "
            f"{', '.join(TE_KEYWORDS)} (other settings go in config=TransformerConfig(...))"
        )
    given = check_transformer_config(owner, config)
    for name, value in keywords.items():
        fields = TE_KEYWORDS[name].fields
        if config is not None and fields:
            raise TypeError(
                f"{owner}: pass {name}= (TransformerEngine's keyword) or config={_spelled_in_config(fields[0])}, "
                "not both"
            )
        try:
            given = TE_KEYWORDS[name].apply(given, value)
        except (TypeError, ValueError) as error:
            raise type(error)(f"{owner}({name}={value!r}): {error}") from None
    return given


__all__ = ["TE_KEYWORDS", "TEKeyword", "config_from_te_keywords"]
