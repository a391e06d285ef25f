"""200 training steps of a small LayerNormMLP stack end within 2% of the bf16 (FP8 off) loss, for every recipe.

The task: y = x + teacher(x) + noise, with a fixed random tanh teacher and noise of std 0.5 (so the
best loss is ~0.25 plus what the model cannot represent). Every step draws a fresh batch, the same
sequence in every run: nothing can be memorized and the runs are compared on the same samples.
Adam, bf16 parameters and activations. Measured gaps on CPU: the FP8 recipes 0.04-0.15%, NVFP4
1.4% (E2M1 with 16-element blocks over a 32-wide hidden dim is the coarsest case; it was 2.9% with
an ffn size of 32 and 3.2% with hidden 64, so that bar is close for NVFP4).

The kernels run through their pure-torch reference (byte-identical to the Triton kernels, as
tests/kernels checks), because 6 x 200 steps in the Triton interpreter would take minutes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchside.autocast import fp8_autocast
from torchside.modules import LayerNormMLP, ModuleConfig
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

HIDDEN, FFN, TOKENS, STEPS = 32, 64, 256, 200
NOISE = 0.5
HISTORY = 16
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=HISTORY),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
RELATIVE_GAP = 0.02  # the bar: the final loss within 2% of the bf16 run's


class Stack(nn.Module):
    """Two residual LayerNormMLP blocks."""

    def __init__(self) -> None:
        super().__init__()
        config = ModuleConfig(amax_history_len=HISTORY)
        self.blocks = nn.ModuleList(
            LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16, config=config) for _ in range(2)
        )

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _teacher() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(HIDDEN, FFN, generator=generator), torch.randn(FFN, HIDDEN, generator=generator)


def _batch(step: int, teacher: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of one step: fresh ones every step, the same ones in every run."""
    generator = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(TOKENS, HIDDEN, generator=generator)
    y = x + torch.tanh(x @ teacher[0] / HIDDEN**0.5) @ teacher[1] / FFN**0.5
    y = y + NOISE * torch.randn(y.shape, generator=generator)
    return x.bfloat16(), y.bfloat16()


def _final_loss(recipe) -> float:
    """Mean loss of the last 10 steps of a run (FP8 off when recipe is None)."""
    torch.manual_seed(0)
    model = Stack()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    teacher = _teacher()
    losses = []
    for step in range(STEPS):
        x, y = _batch(step, teacher)
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            prediction = model(x)
        loss = (prediction.float() - y.float()).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], f"did not train: {losses[0]:.4f} -> {losses[-1]:.4f}"
    return sum(losses[-10:]) / 10


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: a second intra-op thread only spins, and on a shared 2-core machine it costs 5-10x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bf16_loss(one_thread) -> float:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        return _final_loss(None)


# NVFP4's 200 steps through the reference kernels take over a minute of CI's 2 cores: `grid`. In CI its steps
# are checked against float64 (test_modules_numerics), over 5 sharded steps (test_fsdp_tp's nvfp4 case), and
# this same 200-step task converges under NVFP4 with the JAX twin (tests/jaxside/test_modules_training.py),
# whose casts are byte-identical to these (tests/bridge/test_quantize_cross.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe_name", [pytest.param(r, marks=pytest.mark.grid) if r == "nvfp4" else r for r in RECIPES]
)
def test_200_steps_end_within_2_percent_of_bf16(bf16_loss, recipe_name, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the reference kernels (see the module docstring)
    loss = _final_loss(RECIPES[recipe_name])
    assert abs(loss - bf16_loss) <= RELATIVE_GAP * bf16_loss, f"{recipe_name}: {loss:.5f} vs bf16 {bf16_loss:.5f}"
