"""`recipe=` of `bridge.compare`: a name or a recipe object, as the pair (torchside recipe, jaxside recipe)."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jaxside.recipe as jax_recipes
import torchside.recipe as torch_recipes
from bridge.numerics import MANTISSA_BITS, RECIPES


def _twin(recipe: Any, into) -> Any:
    """The same recipe as the other framework's class of that name (enum fields by value)."""
    fields = {}
    for f in dataclasses.fields(recipe):
        value = getattr(recipe, f.name)
        fields[f.name] = getattr(into, type(value).__name__)(value.value) if isinstance(value, enum.Enum) else value
    return getattr(into, type(recipe).__name__)(**fields)


def _name_of(recipe: Any) -> str:
    for name in RECIPES[1:]:
        if type(jax_recipes.recipe_from_name(name)).__name__ == type(recipe).__name__:
            return name
    return type(recipe).__name__


def resolve(recipe: Any) -> tuple[str, Any, Any]:
    """(name, torchside recipe, jaxside recipe); None twice for "off"."""
    if isinstance(recipe, str):
        if recipe not in RECIPES:
            raise ValueError(f"recipe={recipe!r}: use one of {', '.join(RECIPES)} or a recipe object")
        return recipe, torch_recipes.recipe_from_name(recipe), jax_recipes.recipe_from_name(recipe)
    if isinstance(recipe, torch_recipes.RECIPE_CLASSES):
        return _name_of(recipe), recipe, _twin(recipe, jax_recipes)
    if isinstance(recipe, jax_recipes.RECIPE_CLASSES):
        return _name_of(recipe), _twin(recipe, torch_recipes), recipe
    raise TypeError(f"recipe={recipe!r}: pass a name ({', '.join(RECIPES)}) or a torchside/jaxside recipe object")


def mantissa_bits(jax_recipe: Any) -> tuple[int, int] | None:
    """(forward, grad) mantissa bits of the recipe's casts; None with FP8 off."""
    if jax_recipe is None:
        return None
    if isinstance(jax_recipe, jax_recipes.NVFP4BlockScaling):
        return MANTISSA_BITS["e2m1"], MANTISSA_BITS["e2m1"]
    formats = (jax_recipe.fp8_format.for_role(role) for role in ("input", "grad"))
    return tuple(MANTISSA_BITS[fmt] for fmt in formats)


__all__ = ["mantissa_bits", "resolve"]
