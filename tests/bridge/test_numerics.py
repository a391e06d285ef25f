"""bridge.numerics: the tolerance table, the shard-by-shard error arithmetic and the report's first divergence.

Single process (no process group: the all-reduce is the identity). The errors are checked against
numpy float64 on the whole tensors; the multi-process verify runs are in test_runtime.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bridge import numerics
from bridge.numerics import TensorCheck, Tolerance, VerifyReport


def test_nan_and_inf_never_pass():
    loose = Tolerance(None, None)
    assert loose.passes(0.0, 0.0, nan=False)
    assert not loose.passes(0.0, 0.0, nan=True)
    assert not loose.passes(math.inf, 0.0, nan=False)
    assert not loose.passes(0.0, math.nan, nan=False)
    assert not numerics.BITWISE.passes(0.0, 2.0**-149, nan=False)  # bitwise: one smallest subnormal apart fails


def test_tolerances_are_the_stated_ones():
    expected = {  # (recipe, stage, steps taken) -> relative limit, from the module docstring's arithmetic
        ("off", "forward", 0): 1e-5,
        ("off", "forward", 3): 1e-5,
        ("off", "exp_avg", 1): 1e-5,
        ("delayed", "forward", 0): 2.0**-5,  # u_E4M3 / 2: both sides cast the same values
        ("mxfp8", "weight_grad", 0): 2.0**-4,  # u_E5M2 / 2
        ("block", "input_grad", 0): 2.0**-4,
        ("delayed", "forward", 1): 2.0**-3,  # 2 u_E4M3: then each side's amax history sets its scales
        ("mxfp8", "weight_grad", 2): 2.0**-4,  # every step starts from one state: u_E5M2 / 2 again
        ("block", "forward", 4): 2.0**-5,
        ("mxfp8", "exp_avg", 1): 2.0**-4,  # the common moment plus step 0's gradient
        ("delayed", "exp_avg", 2): 2.0**-2,  # plus step 1's gradient, cast with the history's scales
        ("current", "forward", 0): 2.0**-3,  # 2 u_E4M3 from the start
        ("current", "input_grad", 0): 2.0**-2,  # 2 u_E5M2
        ("nvfp4", "weight_grad", 0): 2.0**-1,  # 2 u_E2M1
        ("current", "exp_avg", 1): 2.0**-2,
        ("current", "exp_avg_sq", 1): 1.25**2 - 1,
    }
    for (recipe, stage, steps_taken), limit in expected.items():
        assert numerics.tolerance(recipe, stage, steps_taken=steps_taken).relative == limit, (recipe, stage, steps_taken)
    assert numerics.tolerance("current", "layout") == numerics.BITWISE
    # One Adam step from the same state moves two runs apart by at most 2 lr (1 - 0.9) / sqrt(1 - 0.999),
    # at any step (each starts from torch's state). FP8 off too: a gradient that is zero up to rounding
    # (an attention key bias) takes a +-lr Adam step.
    for recipe, steps_taken in (("current", 3), ("off", 1)):
        drift = numerics.tolerance(recipe, "param", lr=1e-3, steps_taken=steps_taken)
        assert drift.relative is None and drift.max_abs == pytest.approx(2 * 1e-3 * 0.1 / math.sqrt(0.001))


def test_every_recipe_name_has_a_tolerance_row():
    from twinspec.recipe import recipe_names  # the registry verify's and the demo's names come from

    assert numerics.RECIPES == recipe_names()
    assert set(numerics.TOLERANCES) == set(recipe_names())
    for recipe in recipe_names():
        for stage in numerics.STAGES:
            assert numerics.tolerance(recipe, stage, lr=1e-3, steps_taken=1).passes(0.0, 0.0, nan=False)


def test_verify_builds_one_recipe_per_name_for_both_frameworks():
    from bridge import crosscheck
    from twinspec.recipe import RECIPE_CLASSES

    assert crosscheck.case_recipe("off") is None
    for name in numerics.RECIPES[1:]:
        assert isinstance(crosscheck.case_recipe(name), RECIPE_CLASSES), name
    assert crosscheck.case_recipe("delayed").amax_history_len == crosscheck.HISTORY


def test_fp8_tensor_core_sums_take_the_own_scales_bound_on_cuda():
    """On CUDA, recipes whose GEMMs sum in Hopper's FP8 accumulator lose the same-scale bound (module docstring)."""
    own_scales = {  # (recipe, stage, steps taken) -> relative limit on CUDA
        ("delayed", "forward", 0): 2.0**-3,  # 2 u_E4M3, not u/2: tensor-core sums flip codes before each cast
        ("block", "input_grad", 0): 2.0**-2,  # 2 u_E5M2
        ("block", "exp_avg", 1): 2.0**-2,
        ("mxfp8", "weight_grad", 0): 2.0**-4,  # emulated with bf16 dots, fp32 sums: u/2 stays
        ("nvfp4", "forward", 0): 2.0**-1,
        ("off", "forward", 0): 1e-5,
    }
    for (recipe, stage, steps_taken), limit in own_scales.items():
        got = numerics.tolerance(recipe, stage, steps_taken=steps_taken, device_type="cuda").relative
        assert got == limit, (recipe, stage, steps_taken)
    report = VerifyReport("mlp", "dp_shard=2", "block", 1, "cuda")
    numerics.collect(report, 0, "forward", [("layers.0", torch.ones(4) * 1.1, torch.ones(4), 1)], lr=0.0, steps_taken=0)
    assert report.checks[0].passed and report.to_json()["device_type"] == "cuda"  # 0.1 relative: within 2u, not u/2


def _float64_errors(got: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    got, expected = got.astype(np.float64), expected.astype(np.float64)
    return float(np.linalg.norm(got - expected) / np.linalg.norm(expected)), float(np.abs(got - expected).max())


def test_shard_sums_give_the_whole_tensor_error():
    """Shards of one tensor, one of them held twice (replicas 2, counted half each time), add up to the whole."""
    rng = np.random.default_rng(3)
    expected = rng.standard_normal((8, 6)).astype(np.float32)
    got = expected + rng.standard_normal((8, 6)).astype(np.float32) * 1e-3
    rows = [slice(0, 3), slice(3, 8), slice(3, 8)]  # the second shard appears twice: 2 replicas
    replicas = [1, 2, 2]
    stats = torch.stack(
        [numerics.local_stats(torch.from_numpy(got[r]), torch.from_numpy(expected[r]), n) for r, n in zip(rows, replicas)]
    )
    summed = torch.cat([stats[:, :3].sum(0), stats[:, 3].max()[None]])  # what the all-reduces do across ranks
    ((relative, max_abs, nan),) = numerics.reduce_stats(summed[None])
    expected_relative, expected_max = _float64_errors(got, expected)
    assert relative == pytest.approx(expected_relative, rel=1e-12)
    assert max_abs == pytest.approx(expected_max, rel=1e-12)
    assert not nan


def test_a_nan_on_either_side_is_flagged():
    clean = torch.ones(4)
    dirty = torch.tensor([1.0, math.nan, 1.0, 1.0])
    for got, expected in ((dirty, clean), (clean, dirty)):
        ((_, _, nan),) = numerics.reduce_stats(numerics.local_stats(got, expected, 1)[None])
        assert nan


def _check(step, stage, name, passed):
    return TensorCheck(step, stage, name, 0.0 if passed else 1.0, 0.0, False, Tolerance(0.5), passed)


def test_the_report_names_the_first_divergence_in_run_order():
    report = VerifyReport("mlp", "dp_shard=2,tp=2", "current", 2)
    report.checks += [
        _check(0, "forward", "layers.0", True),
        _check(0, "forward", "layers.1", False),
        _check(0, "weight_grad", "layers.0.mlp.fc1_weight", False),
        _check(1, "forward", "layers.0", False),
    ]
    first = report.first_divergence
    assert (first.step, first.stage, first.name, first.layer) == (0, "forward", "layers.1", "layers.1")
    data = report.to_json()
    assert data["passed"] is False
    assert data["first_divergence"]["layer"] == "layers.1"
    assert [c["name"] for c in data["checks"]][:2] == ["layers.0", "layers.1"]
    assert TensorCheck(0, "weight_grad", "layers.3.mlp.fc1_weight", 0, 0, False, Tolerance(1), True).layer == "layers.3"
    assert TensorCheck(0, "input_grad", "input", 0, 0, False, Tolerance(1), True).layer == "input"


def test_relative_error_is_the_norm_of_the_difference_over_the_norm_of_the_reference():
    expected = np.array([[3.0, 0.0], [0.0, 4.0]])  # norm 5
    got = expected + np.array([[0.6, 0.0], [0.0, 0.8]])  # a difference of norm 1
    assert numerics.relative_error(got, expected) == pytest.approx(0.2, rel=1e-15)
    halves = torch.tensor([[3.0, 0.0], [0.0, 4.0]], dtype=torch.bfloat16)  # torch, in a dtype numpy lacks
    assert numerics.relative_error(halves * 0.5, halves) == 0.5
    assert numerics.relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert numerics.relative_error(np.ones(3), np.zeros(3)) == math.inf
    with pytest.raises(ValueError, match=r"got shape \(3,\), expected \(1, 3\)"):
        numerics.relative_error(np.ones(3), np.ones((1, 3)))
