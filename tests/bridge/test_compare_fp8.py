"""bridge.compare under the FP8 recipes: user-written blocks of torchside / jaxside Linears pass under every recipe
(teacher-forced bounds with flipped codes, the noise-aware end-to-end verdict), also 16 blocks deep, and a planted
layout bug is still named at its block."""

from __future__ import annotations

import pytest
import torch

import bridge
from bridge.numerics import RECIPES
from tests.bridge.compare_models import JaxStack, TorchStack, inputs

WIDTH = 64  # the block recipes' 32-element (MXFP8) and 16-element (NVFP4) blocks fit; 1x128 blocks pad
FP8_RECIPES = [pytest.param(r, marks=() if r == "current" else pytest.mark.grid) for r in RECIPES[1:]]


def _compare(recipe: str, depth: int, seed: int = 0, planted=None):
    torch.manual_seed(seed)
    torch_model = TorchStack(WIDTH, depth, fp8=True)
    jax_model = JaxStack(WIDTH, depth, fp8=True, planted=planted)
    return bridge.compare(torch_model, jax_model, inputs(WIDTH, seed=seed), recipe=recipe)


@pytest.mark.parametrize("recipe", FP8_RECIPES)
def test_a_faithful_fp8_pair_passes(recipe):
    report = _compare(recipe, depth=2)
    assert report.passed, report.first_divergence
    names = {check.name for check in report.checks if check.stage == "end_to_end_forward"}
    assert names == {"output", "output [FP8 off]", "output [distance to reference]"}


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.grid), pytest.param(2, marks=pytest.mark.grid)])
def test_sixteen_faithful_blocks_pass_under_current_scaling(seed):
    """No false alarm at depth: each block's bound is its own, and FP8 noise is judged against FP8 noise."""
    report = _compare("current", depth=16, seed=seed)
    assert report.passed, report.first_divergence


@pytest.mark.grid
def test_a_layout_bug_is_named_under_current_scaling():
    first = _compare("current", depth=3, planted=(1, "transposed_weight")).first_divergence
    assert (first.name, first.stage) == ("blocks.1", "forward"), first
