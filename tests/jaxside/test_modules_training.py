"""200 training steps of a small LayerNormMLP stack end within 2% of the FP8-off loss (tests/torchside's twin).

The task, as tests/torchside/test_modules_training.py sets it (drawn with numpy here, so the samples
differ): y = x + teacher(x) + noise, with a fixed random tanh teacher and noise of std 0.5 (the best
loss is ~0.25 plus what the model cannot represent). Every step draws a fresh batch, the same
sequence in every run. Adam, bf16 parameters and activations, one jitted step per recipe.

Recipes: FP8 off, DelayedScaling (its scales and histories evolve over the 200 steps through
fp8_autocast and finish_backward), current scaling and MXFP8. Float8BlockScaling and NVFP4 are left
out for time, not doubt: their jitted step compiles in ~11 s and ~50 s on this 2-core CPU, and their
per-step math is the one test_modules_numerics.py checks against float64.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxside.modules import GRAD_FILTER, LayerNormMLP, ModuleConfig, finish_backward, fp8_autocast
from twinspec.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling
from tests.selection import in_ci

HIDDEN, FFN, TOKENS, STEPS = 32, 64, 256, 200
NOISE = 0.5
HISTORY = 16
RECIPES = {
    "delayed": DelayedScaling(amax_history_len=HISTORY),
    "current": Float8CurrentScaling(),
    "mxfp8": MXFP8BlockScaling(),
}
RELATIVE_GAP = 0.02  # the bar: the final loss within 2% of the FP8-off run's


class Stack(nnx.Module):
    """Two residual LayerNormMLP blocks."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        config = ModuleConfig(amax_history_len=HISTORY)
        self.blocks = nnx.List(
            [LayerNormMLP(HIDDEN, FFN, params_dtype=jnp.bfloat16, config=config, rngs=rngs) for _ in range(2)]
        )

    def __call__(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _batches() -> list[tuple[jnp.ndarray, jnp.ndarray]]:
    """The samples of every step: fresh ones each step, the same ones in every run."""
    teacher = np.random.default_rng(0)
    w_in, w_out = teacher.standard_normal((HIDDEN, FFN)), teacher.standard_normal((FFN, HIDDEN))
    batches = []
    for step in range(STEPS):
        rng = np.random.default_rng(1000 + step)
        x = rng.standard_normal((TOKENS, HIDDEN))
        y = x + np.tanh(x @ w_in / HIDDEN**0.5) @ w_out / FFN**0.5 + NOISE * rng.standard_normal((TOKENS, HIDDEN))
        batches.append((jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16)))
    return batches


def _loss(model, x, y, recipe):
    with fp8_autocast(enabled=recipe is not None, recipe=recipe):
        prediction = model(x)
    return jnp.mean(jnp.square(prediction.astype(jnp.float32) - y.astype(jnp.float32)))


def _final_loss(recipe, batches) -> float:
    """Mean loss of the last 10 steps of a run (FP8 off when recipe is None)."""
    model = Stack(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(_loss, argnums=nnx.DiffState(0, GRAD_FILTER))(model, x, y, recipe)
        optimizer.update(model, finish_backward(model, grads, recipe))
        return loss

    losses = [float(step(model, optimizer, x, y)) for x, y in batches]
    assert losses[-1] < 0.5 * losses[0], f"did not train: {losses[0]:.4f} -> {losses[-1]:.4f}"
    return sum(losses[-10:]) / 10


@pytest.fixture(scope="module")
def batches():
    return _batches()


@pytest.fixture(scope="module")
def fp8_off_loss(batches) -> float:
    return _final_loss(None, batches)


@pytest.mark.slow
@pytest.mark.parametrize("recipe_name", in_ci(RECIPES, ["current"]))  # each recipe ~15-20 s on 2 cores: the grid
def test_200_steps_end_within_2_percent_of_fp8_off(batches, fp8_off_loss, recipe_name):
    loss = _final_loss(RECIPES[recipe_name], batches)
    gap = abs(loss - fp8_off_loss) / fp8_off_loss
    assert gap <= RELATIVE_GAP, f"{recipe_name}: {loss:.5f} vs FP8 off {fp8_off_loss:.5f} ({gap:.2%})"
