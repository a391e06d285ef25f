"""bridge.compare(..., steps=N): Adam steps on both sides from one state, parameters and moments compared after
each, the submodule checks again at each step; a planted optimizer difference on one side is named at its stage
and the step where it first acts."""

from __future__ import annotations

import optax
import pytest
import torch

import bridge
from bridge.model_compare import adam_steps
from jaxside.optim import fused_adam
from tests.bridge.compare_models import JaxStack, TorchStack, inputs

WIDTH, DEPTH = 32, 2


def _compare(**options):
    torch.manual_seed(0)
    torch_model = TorchStack(WIDTH, DEPTH)
    return bridge.compare(torch_model, JaxStack(WIDTH, DEPTH), inputs(WIDTH, seq=8), **options)


def test_a_faithful_pair_passes_two_steps_and_is_checked_at_each():
    torch.manual_seed(0)
    torch_model = TorchStack(WIDTH, DEPTH)
    before = {name: p.detach().clone() for name, p in torch_model.named_parameters()}
    report = bridge.compare(torch_model, JaxStack(WIDTH, DEPTH), inputs(WIDTH, seq=8), steps=2)
    assert report.passed, report.first_divergence
    assert report.steps == 2
    stages_by_step = {step: {c.stage for c in report.checks if c.step == step} for step in range(3)}
    assert {"param", "exp_avg", "exp_avg_sq", "forward", "weight_grad"} <= stages_by_step[1]
    assert "forward" in stages_by_step[2] and "param" not in stages_by_step[2]  # the checks at the last parameters
    moments = [c for c in report.checks if c.stage == "exp_avg" and c.step == 1]
    assert len(moments) == 6 * DEPTH and all(c.relative < 1e-4 for c in moments)
    assert all(torch.equal(p, before[name]) for name, p in torch_model.named_parameters())  # put back


def test_a_different_beta1_in_jax_is_named_at_exp_avg_of_the_first_step(monkeypatch):
    monkeypatch.setattr(adam_steps, "jax_adam", lambda: fused_adam(adam_steps.LR, (0.85, 0.999)))
    first = _compare(steps=2).first_divergence
    assert (first.stage, first.step, first.name) == ("exp_avg", 0, "blocks.0.norm.weight"), first


def test_l2_weight_decay_in_jax_only_is_named_at_exp_avg(monkeypatch):
    planted = lambda: fused_adam(adam_steps.LR, (0.9, 0.999), weight_decay=0.1, adam_w_mode=False)  # noqa: E731
    monkeypatch.setattr(adam_steps, "jax_adam", planted)
    first = _compare(steps=1).first_divergence
    assert (first.stage, first.step) == ("exp_avg", 0), first


def test_a_learning_rate_that_jumps_after_the_first_step_is_named_at_param_of_step_1(monkeypatch):
    schedule = optax.piecewise_constant_schedule(adam_steps.LR, {1: 100.0})  # a warmup boundary one step off
    monkeypatch.setattr(adam_steps, "jax_adam", lambda: fused_adam(schedule))
    report = _compare(steps=2)
    first = report.first_divergence
    assert (first.stage, first.step) == ("param", 1), first
    assert all(c.passed for c in report.checks if c.step == 0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"steps": -1}, r"steps=-1: pass a whole number >= 0"),
        ({"steps": 1.5}, r"steps=1.5"),
        ({"steps": True}, r"steps=True"),
        ({"steps": 1, "backward": False}, r"needs the gradients: pass backward=True"),
        ({"steps": 1, "recipe": "delayed"}, r"recipe 'delayed'.*not carried to the JAX side"),
    ],
)
def test_bad_steps_are_value_errors(options, message):
    with pytest.raises(ValueError, match=message):
        bridge.compare(TorchStack(WIDTH, 1), JaxStack(WIDTH, 1), inputs(WIDTH, seq=4), **options)
