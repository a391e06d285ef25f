"""fp8_autocast: nesting, DelayedScaling state against a float64 model, one all-reduce per region and per backward."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.distributed import run_threads
from torchside.autocast import DelayedScalingSync, fp8_autocast, fp8_frame
from torchside.modules import LayerNormLinear, LayerNormMLP, Linear, ModuleConfig
from torchside.recipe import DelayedScaling, Float8CurrentScaling, Format

HISTORY = 4
CONFIG = ModuleConfig(amax_history_len=HISTORY)


def _stack(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        LayerNormLinear(64, 64, config=CONFIG), LayerNormMLP(64, 128, config=CONFIG), Linear(64, 32, config=CONFIG)
    )


class DelayedScaling64:
    """The float64 model of one quantizer group's state: history [len, slots], scale [slots]."""

    def __init__(self, recipe: DelayedScaling, slots: int, fmax: float) -> None:
        self.recipe, self.fmax = recipe, fmax
        self.history = torch.zeros(recipe.amax_history_len, slots, dtype=torch.float64)
        self.scale = torch.ones(slots, dtype=torch.float64)

    def step(self, amaxes: list[float]) -> None:
        self.history[0] = torch.tensor(amaxes, dtype=torch.float64)
        amax = self.history.max(0).values if self.recipe.amax_compute_algo == "max" else self.history[0]
        new_scale = self.fmax / amax / 2.0**self.recipe.margin
        self.scale = torch.where(amax > 0, new_scale, self.scale)
        self.history = torch.roll(self.history, -1, 0)
        self.history[0] = 0


@pytest.mark.parametrize(
    "recipe",
    [
        DelayedScaling(amax_history_len=HISTORY),
        DelayedScaling(amax_history_len=HISTORY, margin=2, amax_compute_algo="most_recent", fp8_format=Format.E4M3),
    ],
    ids=["hybrid-max", "e4m3-most_recent-margin2"],
)
def test_delayed_scaling_state_follows_the_float64_model(recipe):
    torch.manual_seed(0)
    module = Linear(64, 32, config=CONFIG)
    forward = DelayedScaling64(recipe, slots=2, fmax=448.0 if recipe.fp8_format is not Format.E5M2 else 57344.0)
    backward = DelayedScaling64(recipe, slots=1, fmax=57344.0 if recipe.fp8_format is Format.HYBRID else 448.0)
    x_scales, dy_scales = [1.0, 4.0, 0.5, 2.0, 8.0, 0.25], [3.0, 0.1, 1.0, 20.0, 0.5, 2.0]  # 6 steps > 4 rows
    for x_scale, dy_scale in zip(x_scales, dy_scales, strict=True):
        with torch.no_grad():
            module.weight.mul_(1.25)  # an optimizer step: the weight amax moves too
        x, dy = torch.randn(32, 64) * x_scale, torch.randn(32, 32) * dy_scale
        with fp8_autocast(recipe=recipe):
            y = module(x)
        y.backward(dy)
        forward.step([x.abs().max().item(), module.weight.abs().max().item()])
        backward.step([dy.abs().max().item()])
        # the amaxes are fp32 values: exact; the scale is fp32(fmax / amax) / 2^margin, within an ulp of float64's
        assert torch.equal(module.fp8_forward_amax_history.double(), forward.history)
        assert torch.equal(module.fp8_backward_amax_history.double(), backward.history)
        torch.testing.assert_close(module.fp8_forward_scale.double(), forward.scale, rtol=2**-23, atol=0)
        torch.testing.assert_close(module.fp8_backward_scale.double(), backward.scale, rtol=2**-23, atol=0)


def test_forward_amaxes_are_reduced_at_the_outermost_exit_only():
    module = Linear(64, 32, config=CONFIG)
    x = torch.randn(8, 64)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=HISTORY)):
        with fp8_autocast():
            module(x)
        assert module.fp8_forward_amax_history[0, 0] == x.abs().max()  # recorded, not yet rolled
        assert torch.equal(module.fp8_forward_scale, torch.ones(2))
    assert module.fp8_forward_amax_history[0].eq(0).all()
    assert module.fp8_forward_amax_history[-1, 0] == x.abs().max()
    assert module.fp8_forward_scale[0] == pytest.approx(448.0 / x.abs().max().item(), rel=2**-23)


def test_backward_update_runs_once_after_every_grad_is_cast(monkeypatch):
    updates = []
    original = DelayedScalingSync.reduce_and_update

    def counted(self):
        updates.append(len(self._states))  # how many modules' states this update covers
        original(self)

    monkeypatch.setattr(DelayedScalingSync, "reduce_and_update", counted)
    model = _stack()
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=HISTORY)):
        y = model(torch.randn(32, 64))
    assert updates == [3]  # the forward states of the three modules, at the exit
    y.square().sum().backward()
    assert updates == [3, 3]  # their backward states, once
    for layer in model:
        history = layer.fp8_backward_amax_history
        # rolled once, after the last grad of the region was cast: nothing waits in row 0
        assert history[0].eq(0).all() and history[-1].gt(0).all(), type(layer).__name__


def test_inner_regions_switch_fp8_off_or_change_the_recipe():
    module = Linear(64, 32, config=CONFIG)
    x = torch.randn(8, 64)
    with fp8_autocast(recipe=DelayedScaling(amax_history_len=HISTORY)):
        with fp8_autocast(enabled=False):
            assert fp8_frame() is None
            assert torch.equal(module(x), F.linear(x, module.weight, module.bias))
        with fp8_autocast(recipe=Float8CurrentScaling()):
            inner = module(x)
        assert isinstance(fp8_frame().recipe, DelayedScaling)
    with fp8_autocast(recipe=Float8CurrentScaling()):
        assert torch.equal(inner, module(x))
    assert module.fp8_forward_amax_history.eq(0).all()  # no delayed-scaling cast ran
    assert fp8_frame() is None


def test_an_exception_leaves_no_region_and_reduces_nothing():
    module = Linear(64, 32, config=CONFIG)
    with pytest.raises(RuntimeError, match="boom"):
        with fp8_autocast(recipe=DelayedScaling(amax_history_len=HISTORY)):
            module(torch.randn(8, 64))
            raise RuntimeError("boom")
    assert fp8_frame() is None
    assert module.fp8_forward_amax_history[0, 0] > 0  # recorded, never rolled


def test_regions_are_per_thread():
    seen = []
    with fp8_autocast(recipe=Float8CurrentScaling()):
        thread = threading.Thread(target=lambda: seen.append(fp8_frame()))
        thread.start()
        thread.join()
    assert seen == [None]


# ---- distributed: one all-reduce per region, one per backward


def _rank_input(rank: int) -> torch.Tensor:
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(100 + rank)) * (rank + 1)


def _train_two_steps(rank: int, world_size: int, counts: Counter, lock: threading.Lock, grouped: bool):
    model = _stack(seed=0)
    group = dist.group.WORLD if grouped else None
    per_step = []
    for _ in range(2):
        with fp8_autocast(recipe=DelayedScaling(amax_history_len=HISTORY), amax_reduction_group=group):
            y = model(_rank_input(rank))
            with lock:
                inside = counts[rank]
        with lock:
            after_forward = counts[rank]
        y.square().sum().backward()
        with lock:
            per_step.append((inside, after_forward, counts[rank]))
    return per_step, {name: b.clone() for name, b in model.state_dict().items() if name.startswith("0.fp8_")}


def _count_all_reduces(monkeypatch) -> tuple[Counter, threading.Lock]:
    # The Triton interpreter is not thread-safe (two ranks interpreting at once break its patched
    # `tl` globals), so threaded ranks run the kernels' reference implementations.
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    counts, lock = Counter(), threading.Lock()
    original = dist.all_reduce

    def counted(tensor, *args, **kwargs):
        with lock:
            counts[dist.get_rank()] += 1
        return original(tensor, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted)
    return counts, lock


def test_one_all_reduce_per_region_and_per_backward(monkeypatch):
    counts, lock = _count_all_reduces(monkeypatch)
    results = run_threads(_train_two_steps, 2, counts, lock, True)
    for per_step, _ in results:
        # (inside the region, after its exit, after backward): 0 -> 1 -> 2 per step, for three modules
        assert per_step == [(0, 1, 2), (2, 3, 4)]
    (_, state0), (_, state1) = results
    assert all(torch.equal(state0[name], state1[name]) for name in state0)  # every rank holds the reduced state
    # slot 0 of the first module is its GEMM input, the (default-initialized) LayerNorm of x
    local_amaxes = [F.layer_norm(_rank_input(rank), (64,)).abs().max().item() for rank in range(2)]
    assert local_amaxes[0] != local_amaxes[1]
    assert state0["0.fp8_forward_amax_history"][-1, 0].item() == pytest.approx(max(local_amaxes), rel=1e-6)


def test_no_group_means_no_all_reduce(monkeypatch):
    counts, lock = _count_all_reduces(monkeypatch)
    results = run_threads(_train_two_steps, 2, counts, lock, False)
    assert all(per_step == [(0, 0, 0), (0, 0, 0)] for per_step, _ in results)
    (_, state0), (_, state1) = results
    assert not torch.equal(state0["0.fp8_forward_amax_history"], state1["0.fp8_forward_amax_history"])


def _frame_under_te_keywords(rank, world_size):
    recipe, group = Float8CurrentScaling(), dist.group.WORLD
    with fp8_autocast(enabled=True, fp8_recipe=recipe, fp8_group=group):
        frame = fp8_frame()
        return frame.recipe is recipe, frame.amax_reduction_group is group


def test_transformer_engine_keywords_fp8_recipe_and_fp8_group():
    assert run_threads(_frame_under_te_keywords, 1) == [(True, True)]


def test_enabled_false_by_keyword_turns_fp8_off():
    with fp8_autocast(enabled=False, fp8_recipe=Float8CurrentScaling()):
        assert fp8_frame() is None


@pytest.mark.parametrize(
    "kwargs, names",
    [
        ({"recipe": DelayedScaling(), "fp8_recipe": Float8CurrentScaling()}, "recipe= or fp8_recipe="),
        ({"amax_reduction_group": "g", "fp8_group": "g"}, "amax_reduction_group= or fp8_group="),
    ],
)
def test_both_spellings_at_once_are_refused(kwargs, names):
    with pytest.raises(TypeError, match=names), fp8_autocast(**kwargs):
        pass
