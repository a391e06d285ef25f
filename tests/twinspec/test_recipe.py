"""Recipes carry TransformerEngine's defaults, derive per-role choices, and refuse bad arguments; the name registry."""

import dataclasses

import pytest

from twinspec.recipe import (
    RECIPE_CLASSES,
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    check_role,
    recipe_from_name,
    recipe_names,
)

# (recipe, field, TransformerEngine's default)
DEFAULTS = [
    (DelayedScaling(), "margin", 0),
    (DelayedScaling(), "amax_history_len", 1024),
    (DelayedScaling(), "amax_compute_algo", "max"),
    (DelayedScaling(), "reduce_amax", True),
    (DelayedScaling(), "fp8_format", Format.HYBRID),
    (Float8CurrentScaling(), "fp8_format", Format.HYBRID),
    (Float8CurrentScaling(), "power_2_scale", False),
    (Float8CurrentScaling(), "amax_epsilon", 0.0),
    (Float8BlockScaling(), "fp8_format", Format.E4M3),
    (Float8BlockScaling(), "power_2_scale", True),
    (MXFP8BlockScaling(), "fp8_format", Format.E4M3),
    (MXFP8BlockScaling(), "scale_rounding", "up"),
    (NVFP4BlockScaling(), "disable_rht", False),
    (NVFP4BlockScaling(), "disable_stochastic_rounding", False),
    (NVFP4BlockScaling(), "disable_2d_quantization", False),
]


@pytest.mark.parametrize("recipe, field, expected", DEFAULTS)
def test_defaults_match_transformer_engine(recipe, field, expected):
    assert getattr(recipe, field) == expected


@pytest.mark.parametrize(
    "fmt, expected",
    [
        (Format.HYBRID, {"input": "e4m3", "weight": "e4m3", "grad": "e5m2"}),
        (Format.E4M3, {"input": "e4m3", "weight": "e4m3", "grad": "e4m3"}),
        (Format.E5M2, {"input": "e5m2", "weight": "e5m2", "grad": "e5m2"}),
    ],
)
def test_format_per_role(fmt, expected):
    assert {role: fmt.for_role(role) for role in expected} == expected


def test_block_scaling_uses_1x128_for_activations_and_grads_and_128x128_for_weights():
    recipe = Float8BlockScaling()
    assert [recipe.block_for(r) for r in ("input", "weight", "grad")] == [(1, 128), (128, 128), (1, 128)]
    flipped = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1, grad_block_scaling_dim=1)
    assert flipped.block_for("input") == (128, 128) and flipped.block_for("weight") == (1, 128)


def test_nvfp4_roles():
    recipe = NVFP4BlockScaling()
    assert [recipe.block_for(r) for r in ("input", "weight", "grad")] == [(1, 16), (16, 16), (1, 16)]
    assert [recipe.hadamard_for(r) for r in ("input", "weight", "grad")] == [True, False, True]
    assert [recipe.stochastic_for(r) for r in ("input", "weight", "grad")] == [False, False, True]
    plain = NVFP4BlockScaling(disable_rht=True, disable_stochastic_rounding=True, disable_2d_quantization=True)
    assert plain.block_for("weight") == (1, 16)
    assert not any(plain.hadamard_for(r) or plain.stochastic_for(r) for r in ("input", "weight", "grad"))


# (constructor, kwargs, error type, a word the message must name)
BAD_ARGUMENTS = [
    (DelayedScaling, {"margin": -1}, ValueError, "margin"),
    (DelayedScaling, {"margin": 1.5}, ValueError, "margin"),
    (DelayedScaling, {"amax_history_len": 0}, ValueError, "amax_history_len"),
    (DelayedScaling, {"amax_compute_algo": "mean"}, ValueError, "most_recent"),
    (DelayedScaling, {"reduce_amax": 1}, TypeError, "reduce_amax"),
    (DelayedScaling, {"fp8_format": "e4m3"}, TypeError, "Format."),
    (Float8CurrentScaling, {"amax_epsilon": -1e-3}, ValueError, "amax_epsilon"),
    (Float8CurrentScaling, {"amax_epsilon": float("nan")}, ValueError, "amax_epsilon"),
    (Float8CurrentScaling, {"power_2_scale": "yes"}, TypeError, "power_2_scale"),
    (Float8BlockScaling, {"x_block_scaling_dim": 3}, ValueError, "x_block_scaling_dim"),
    (Float8BlockScaling, {"x_block_scaling_dim": 2}, ValueError, "128x128"),  # x and w both 2-D
    (
        Float8BlockScaling,
        {"w_block_scaling_dim": 1, "grad_block_scaling_dim": 2, "x_block_scaling_dim": 2},
        ValueError,
        "grad",
    ),
    (MXFP8BlockScaling, {"scale_rounding": "nearest"}, ValueError, "floor"),
    (NVFP4BlockScaling, {"stochastic_rounding_seed": -1}, ValueError, "stochastic_rounding_seed"),
    (NVFP4BlockScaling, {"disable_rht": None}, TypeError, "disable_rht"),
]


@pytest.mark.parametrize("cls, kwargs, error, word", BAD_ARGUMENTS)
def test_bad_arguments_are_refused_with_the_fix(cls, kwargs, error, word):
    with pytest.raises(error, match=word.replace(".", r"\.")):
        cls(**kwargs)


def test_recipes_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        DelayedScaling().margin = 3


def test_unknown_role_is_refused():
    with pytest.raises(ValueError, match="'activation'.*'input', 'weight', 'grad'"):
        check_role("activation")
    with pytest.raises(ValueError, match="role"):
        Format.HYBRID.for_role("bias")


def test_recipe_names_build_every_recipe_class_and_off_is_none():
    assert recipe_names() == ("off", "current", "delayed", "block", "mxfp8", "nvfp4")
    assert recipe_names(fp8_off=False) == recipe_names()[1:]
    assert recipe_from_name("off") is None
    assert [type(recipe_from_name(name)) for name in recipe_names()[1:]] == [
        Float8CurrentScaling, DelayedScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling,
    ]  # fmt: skip
    assert set(map(type, map(recipe_from_name, recipe_names()[1:]))) == set(RECIPE_CLASSES)
    assert recipe_from_name("delayed", amax_history_len=4, margin=1) == DelayedScaling(margin=1, amax_history_len=4)


@pytest.mark.parametrize(
    "name, options, message",
    [
        ("fp16", {}, "recipe 'fp16': use one of off, current, delayed, block, mxfp8, nvfp4"),
        ("off", {"margin": 1}, "recipe 'off' (FP8 off) takes no options: drop margin"),
        ("current", {"margin": 1}, "margin"),
    ],
)
def test_recipe_from_name_refuses_unknown_names_and_options(name, options, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        recipe_from_name(name, **options)
