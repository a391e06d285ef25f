"""The PyTorch frontend: FP8 recipes, quantized tensors and TransformerEngine-style modules.

Never imports jax.
"""

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
)


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
]
