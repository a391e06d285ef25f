"""bridge.compare(..., mesh="dp=2"): both models in 2 co-located CPU processes (gloo), the batch split over the
ranks, each framework summing the weight gradients over them; a faithful pair passes (with an Adam step), a
planted difference is named; meshes and factories it cannot run are errors before any process starts."""

from __future__ import annotations

import pytest

import bridge
from tests.bridge.compare_models import inputs, torch_stack_model

MODELS = "tests.bridge.compare_models"
BATCH = inputs(32, batch=4, seq=8)


@pytest.mark.grid  # ~2 min on 2 cores; CI's faithful dp=2 case is the attention example's (test_compare_cli)
@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_faithful_fp8_pair_passes_on_two_data_parallel_processes_with_a_step():
    torch_model, jax_model = f"{MODELS}:torch_fp8_stack_model", f"{MODELS}:jax_fp8_stack_model"
    report = bridge.compare(torch_model, jax_model, BATCH, recipe="current", mesh="dp=2", steps=1)
    assert report.passed, report.first_divergence
    assert report.mesh == "dp=2 (2 processes)"
    stages = {check.stage for check in report.checks}
    assert {"forward", "weight_grad", "end_to_end_weight_grad", "param", "exp_avg"} <= stages
    assert any(check.name == "output [distance to reference]" for check in report.checks)  # the rows gathered


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_planted_difference_is_named_on_two_data_parallel_processes():
    report = bridge.compare(torch_stack_model, f"{MODELS}:jax_stack_model_tanh_gelu", BATCH, mesh="dp=2")
    first = report.first_divergence
    assert (first.name, first.stage, first.step) == ("blocks.1.act", "forward", 0), first


@pytest.mark.parametrize(
    ("torch_model", "mesh", "batch", "error", "message"),
    [
        (f"{MODELS}:torch_stack_model", "dp=2,tp=2", BATCH, ValueError, r"data-parallel only.*--mesh dp=2,tp=2"),
        (lambda: None, "dp=2", BATCH, TypeError, r"torch_model: with mesh=, pass a factory the worker processes"),
        (f"{MODELS}:nothing", "dp=2", BATCH, ValueError, r"has no function 'nothing'"),
        (f"{MODELS}:torch_stack_model", "dp=3", BATCH, ValueError, r"\[\[4, 8, 32\]\] do not split along dim 0 over 3"),
    ],
)
def test_what_a_mesh_cannot_run_is_an_error_before_any_process_starts(torch_model, mesh, batch, error, message):
    with pytest.raises(error, match=message):
        bridge.compare(torch_model, f"{MODELS}:jax_stack_model", batch, mesh=mesh)
