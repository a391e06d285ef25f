"""`recipe=` of `bridge.compare`: a name or a recipe object, as (name, the one recipe object both sides run)."""

from __future__ import annotations

from typing import Any

from bridge.numerics import MANTISSA_BITS, RECIPES
from twinspec.recipe import RECIPE_CLASSES, NVFP4BlockScaling, recipe_from_name


def resolve(recipe: Any) -> tuple[str, Any]:
    """(name, recipe object); (\"off\", None) with FP8 off. Both frameworks' autocasts take the same object."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"recipe={recipe!r}: use one of {', '.join(RECIPES)} or a recipe object")
        return recipe, recipe_from_name(recipe)
    if isinstance(recipe, RECIPE_CLASSES):
        name = next((n for n in RECIPES[1:] if type(recipe_from_name(n)) is type(recipe)), type(recipe).__name__)
        return name, recipe
    raise TypeError(f"recipe={recipe!r}: pass a name ({', '.join(RECIPES)}) or a recipe object (torchside.recipe)")


def mantissa_bits(recipe: Any) -> tuple[int, int] | None:
    """(forward, grad) mantissa bits of the recipe's casts; None with FP8 off."""
    if recipe is None:
        return None
    if isinstance(recipe, NVFP4BlockScaling):
        return MANTISSA_BITS["e2m1"], MANTISSA_BITS["e2m1"]
    formats = (recipe.fp8_format.for_role(role) for role in ("input", "grad"))
    return tuple(MANTISSA_BITS[fmt] for fmt in formats)


__all__ = ["mantissa_bits", "resolve"]
