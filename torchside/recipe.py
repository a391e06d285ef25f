"""FP8/FP4 training recipes under TransformerEngine's import path: twinspec.recipe's, the one definition jaxside takes too."""

from twinspec.recipe import (
    FP8_OFF,
    RECIPE_CLASSES,
    ROLES,
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

__all__ = [
    "FP8_OFF",
    "RECIPE_CLASSES",
    "ROLES",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "check_role",
    "recipe_from_name",
    "recipe_names",
]
