"""`TransformerConfig`: the architecture knobs of MultiheadAttention and TransformerLayer (torchside's twin).

The fields, their names, defaults and checks are twinspec.transformer_config's, shared with
torchside; `module_config` is a jaxside.modules.ModuleConfig. One difference: dropout is not
implemented here (no random stream is shared with torch, so a dropped run could not be compared
anyway), so both dropouts must be 0.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxside.modules.config import ModuleConfig
from jaxside.modules.layernorm_mlp import ACTIVATIONS
from jaxside.modules.normalization import NormSettings
from twinspec.transformer_config import MASK_TYPES, QKV_FORMATS, TransformerSettings, check_choice, check_softmax_scale


def check_no_dropout(owner: str, name: str, value: object) -> float:
    """0.0, else ValueError: the JAX twin has no dropout."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value != 0:
        raise ValueError(
            f"{owner}({name}={value!r}): jaxside has no dropout (its random masks could not match torch's); "
            "pass 0.0 and add dropout outside the module if training needs it"
        )
    return 0.0


@dataclass(frozen=True)
class TransformerConfig(TransformerSettings):
    """MultiheadAttention / TransformerLayer settings (sizes stay constructor arguments; twinspec's fields)."""

    activations = tuple(ACTIVATIONS)
    norm_class = NormSettings
    module_config_class = ModuleConfig
    module_config: ModuleConfig = field(default_factory=ModuleConfig)

    def __post_init__(self) -> None:
        owner = "TransformerConfig"
        super().__post_init__()
        if self.module_config.parallel_mode is not None:
            raise ValueError(
                f"{owner}(module_config=ModuleConfig(parallel_mode={self.module_config.parallel_mode!r})): the "
                "layers fix their own modes (QKV and fc1 column, proj and fc2 row); leave it None"
            )

    def check_dropout(self, owner: str, name: str, value: object) -> float:
        """0.0 only: the JAX twin has no dropout."""
        return check_no_dropout(owner, name, value)


__all__ = ["MASK_TYPES", "QKV_FORMATS", "TransformerConfig", "check_choice", "check_no_dropout", "check_softmax_scale"]
