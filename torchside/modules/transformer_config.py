"""`TransformerConfig`: the architecture knobs of MultiheadAttention and TransformerLayer, frozen once.

The fields, their defaults and checks are twinspec.transformer_config's (TransformerEngine's names),
shared with jaxside; here `module_config` is the `ModuleConfig` every FP8 submodule is built with
(DelayedScaling history length, TP fields): its tp_group / tp_size / sequence_parallel split the
whole layer (`check_layer_parallelism`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from torchside.modules.config import ModuleConfig
from torchside.modules.layernorm_mlp import ACTIVATIONS
from torchside.modules.normalization import NormSettings
from twinspec.transformer_config import (
    MASK_TYPES,
    QKV_FORMATS,
    TransformerSettings,
    check_choice,
    check_probability,
    check_softmax_scale,
)

InitMethod = Callable[[Tensor], object]  # fills a weight in place, e.g. torch.nn.init.normal_


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
class TransformerConfig(TransformerSettings):
    """MultiheadAttention / TransformerLayer settings (sizes stay constructor arguments; twinspec's fields)."""

    activations = tuple(ACTIVATIONS)
    norm_class = NormSettings
    module_config_class = ModuleConfig
    module_config: ModuleConfig = field(default_factory=ModuleConfig)


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
