"""The PyTorch frontend: FP8 recipes, quantized tensors and TransformerEngine-style modules.

As in TransformerEngine, the modules (`torchside.Linear`, `LayerNormMLP`, `TransformerLayer`, ...),
`fp8_autocast` and `quantized_model_init` (or TransformerEngine's older name `fp8_model_init`) are
importable from here; they load on first use, so `import torchside` stays as cheap as the recipes.
`recipe_from_name("current")` and `recipe_names()` give the recipes by the command lines' names.
Never imports jax.
"""

import importlib
from typing import Any

from torch import Tensor

from torchside.quantization import QuantizedTensor, Quantizer
from torchside.recipe import (
    RECIPE_CLASSES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_role,
    recipe_from_name,
    recipe_names,
)

# Loaded on first access (module __getattr__): name -> the module defining it.
_LAZY = {
    **dict.fromkeys(("fp8_autocast", "fp8_model_init", "quantized_model_init"), "torchside.autocast"),
    **dict.fromkeys(
        (
            "DotProductAttention",
            "GroupedLinear",
            "LayerNorm",
            "LayerNormLinear",
            "LayerNormMLP",
            "Linear",
            "ModuleConfig",
            "MultiheadAttention",
            "RMSNorm",
            "TransformerConfig",
            "TransformerLayer",
        ),
        "torchside.modules",
    ),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'torchside' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


def quantize(tensor: Tensor, recipe: Recipe, role: str = "input") -> QuantizedTensor:
    """Quantize one tensor as `role` under `recipe`, rowwise and columnwise (a one-off Quantizer).

    A one-off DelayedScaling quantizer has no history yet: it casts with scale 1.
    """
    if not isinstance(recipe, RECIPE_CLASSES):
        names = ", ".join(cls.__name__ for cls in RECIPE_CLASSES)
        raise TypeError(f"recipe={recipe!r} is not a recipe: pass one of {names}, e.g. Float8CurrentScaling()")
    check_role(role)
    return Quantizer(recipe, role, device=tensor.device).quantize(tensor)


__all__ = [
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QuantizedTensor",
    "Quantizer",
    "quantize",
    "recipe_from_name",
    "recipe_names",
    *sorted(_LAZY),
]
