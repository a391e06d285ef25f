"""`FP8Module`: parameters with logical axis names, FP8 state as NNX variables, and the per-GEMM FP8 call.

The state layout is torchside's (modules/base.py), so the bridge compares it name for name: for a
module of G GEMMs, `fp8_forward_scale` [2G] and `fp8_forward_amax_history` [amax_history_len, 2G]
hold the input (slot 2g) and weight (slot 2g + 1) of GEMM g, `fp8_backward_scale` [G] and
`fp8_backward_amax_history` [amax_history_len, G] its grad. JAX adds two variables:

- `fp8_grad_amax` [2, G] (an `FP8GradAmax`): never read; its gradient is, per GEMM, this step's
  grad amax (row 0) and the number of backward passes (row 1, 0 if the module did not run), which
  `finish_backward` turns into the backward DelayedScaling update;
- `fp8_rounding_step` (uint32): the NVFP4 grads' stochastic-rounding seed is the recipe's seed plus
  this step, advanced once per FP8 call (torchside advances it once per backward: the same in training).

Differentiate with `nnx.grad(loss, argnums=nnx.DiffState(0, GRAD_FILTER))`, then
`param_grads = finish_backward(model, grads, recipe)` before the optimizer update. Under
DelayedScaling a module runs once between two `finish_backward` calls: JAX adds the gradients of a
variable used twice, so two grad amaxes would be summed where torchside takes their max (a second
call in one fp8_autocast region is refused; one in a second region is not detected).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.formats import seed_as_uint32
from jaxside.modules import autocast, functions
from jaxside.modules.tokens import current_batch_dim
from jaxside.modules.config import ModuleConfig
from jaxside.quantize import delayed_scaling_update
from jaxside.sharding import spec_for
from twinspec.formats import FORMATS
from twinspec.recipe import RECIPE_CLASSES, DelayedScaling, NVFP4BlockScaling, Recipe

Initializer = Callable[[Array, tuple[int, ...], jnp.dtype], Array]

default_kernel_init: Initializer = nnx.initializers.normal(stddev=0.023)  # TransformerEngine's default


class FP8State(nnx.Variable):
    """DelayedScaling scales and amax histories, and the NVFP4 rounding step: set by FP8 bookkeeping, not optimizers."""


class FP8GradAmax(nnx.Variable):
    """[2, G]: this variable's gradient is each GEMM's grad amax and backward-pass count (see the module docstring)."""


GRAD_FILTER = nnx.Any(nnx.Param, FP8GradAmax)  # what a training step differentiates


def parameter(
    rngs: nnx.Rngs,
    init: Initializer,
    shape: tuple[int, ...],
    dtype,
    logical_axes: Sequence[str],
    role: str,
    mode: str | None,
) -> nnx.Param:
    """A parameter annotated with its logical axes and its row of jaxside.sharding's rules (role, parallel mode)."""
    spec_for(logical_axes, mode, role)  # refuse names the rules cannot place now, not at placement
    annotated = nnx.with_partitioning(init, tuple(logical_axes), parallel_role=role, parallel_mode=mode)
    # The names are logical: eager sharding would read them as mesh axes. jaxside.modules.place maps them.
    return nnx.Param(annotated(rngs.params(), shape, dtype), eager_sharding=False)


def resized_amax_history(history: Array, length: int) -> Array:
    """An amax history [rows, ...] with `length` rows: row 0 and the newest past rows kept (torchside.modules.base's)."""
    rows = history.shape[0]
    if length >= rows:
        return jnp.concatenate([history[:1], jnp.zeros((length - rows, *history.shape[1:]), history.dtype), history[1:]])
    return jnp.concatenate([history[:1], history[rows - length + 1 :]])


@dataclass(frozen=True)
class ForwardPlan:
    """One call's FP8 settings: the recipe and the NVFP4 grads' stochastic-rounding seed (uint32, or None)."""

    recipe: Recipe
    seed: Array | None


class FP8Module(nnx.Module):
    """Base of the modules: see the module docstring."""

    def __init__(self, num_gemms: int, config: ModuleConfig) -> None:
        self.config = config
        self.num_gemms = num_gemms
        if not num_gemms:
            return
        history_len = config.amax_history_len or DelayedScaling().amax_history_len  # None: a recipe's, later
        slots = 2 * num_gemms
        self.fp8_forward_scale = FP8State(jnp.ones(slots, jnp.float32))
        self.fp8_forward_amax_history = FP8State(jnp.zeros((history_len, slots), jnp.float32))
        self.fp8_backward_scale = FP8State(jnp.ones(num_gemms, jnp.float32))
        self.fp8_backward_amax_history = FP8State(jnp.zeros((history_len, num_gemms), jnp.float32))
        self.fp8_grad_amax = FP8GradAmax(jnp.zeros((2, num_gemms), jnp.float32))
        self.fp8_rounding_step = FP8State(jnp.zeros((), jnp.uint32))

    def fp8_plan(self) -> ForwardPlan | None:
        """This call's FP8 settings under the active fp8_autocast; None when FP8 is off."""
        frame = autocast.fp8_frame()
        if frame is None or not self.num_gemms:
            return None
        recipe, seed = frame.recipe, None
        if isinstance(recipe, DelayedScaling):
            if self.config.amax_history_len is None:
                self._fit_amax_histories(recipe.amax_history_len)
            frame.region.enlist(self, recipe)
        if isinstance(recipe, NVFP4BlockScaling) and recipe.stochastic_for("grad"):
            step = self.fp8_rounding_step[...]
            seed = seed_as_uint32(recipe.stochastic_rounding_seed) + step  # wraps mod 2^32, as torchside's seed
            self.fp8_rounding_step[...] = step + 1
        return ForwardPlan(recipe, seed)

    def _fit_amax_histories(self, length: int) -> None:
        """Give both amax histories `length` rows (the recipe's, as torchside does), keeping the newest."""
        for history in (self.fp8_forward_amax_history, self.fp8_backward_amax_history):
            if history[...].shape[0] != length:
                history.set_value(resized_amax_history(history[...], length))

    def linear(self, plan: ForwardPlan | None, gemm: int, x, kernel, bias) -> Array:
        """x @ kernel + bias as GEMM `gemm` of this module: FP8 under `plan`, high precision when it is None."""
        if plan is None:
            return functions.linear(x, kernel, bias)
        scales = grad_amax_sink = None
        if isinstance(plan.recipe, DelayedScaling):
            forward_slots = self.fp8_forward_scale[...][2 * gemm : 2 * gemm + 2]
            scales = jnp.concatenate([forward_slots, self.fp8_backward_scale[...][gemm : gemm + 1]])
            grad_amax_sink = self.fp8_grad_amax[...][:, gemm]
        y, amaxes = functions.fp8_linear(
            x,
            kernel,
            bias,
            plan.recipe,
            scales=scales,
            grad_amax_sink=grad_amax_sink,
            seed=plan.seed,
            batch_dim=current_batch_dim(),
        )
        if amaxes is not None:  # row 0 collects the max of this step's amaxes, as torchside's quantizers do
            history = self.fp8_forward_amax_history[...]
            current = jnp.maximum(history[0, 2 * gemm : 2 * gemm + 2], amaxes)
            self.fp8_forward_amax_history[...] = history.at[0, 2 * gemm : 2 * gemm + 2].set(current)
        return y

    def update_forward_scaling(self, recipe: DelayedScaling) -> None:
        """Set the input and weight scales from the history and roll it (at the outermost fp8_autocast exit)."""
        fmax = FORMATS[recipe.fp8_format.for_role("input")].max
        history, scale = delayed_scaling_update(
            self.fp8_forward_amax_history[...],
            self.fp8_forward_scale[...],
            fmax,
            margin=recipe.margin,
            algo=recipe.amax_compute_algo,
        )
        self.fp8_forward_amax_history[...] = history
        self.fp8_forward_scale[...] = scale

    def update_backward_scaling(self, recipe: DelayedScaling) -> None:
        """Record the grad amaxes `fp8_grad_amax` received, set the grad scales and roll, if any GEMM of it ran."""
        grad_amax, backward_passes = self.fp8_grad_amax[...]
        old_history, old_scale = self.fp8_backward_amax_history[...], self.fp8_backward_scale[...]
        history = old_history.at[0].set(jnp.maximum(old_history[0], grad_amax))
        fmax = FORMATS[recipe.fp8_format.for_role("grad")].max
        history, scale = delayed_scaling_update(
            history, old_scale, fmax, margin=recipe.margin, algo=recipe.amax_compute_algo
        )
        # torchside updates the whole state of each module whose backward ran (a GroupedLinear group
        # without rows included), and leaves the modules not called in the step alone
        ran = jnp.any(backward_passes > 0)
        self.fp8_backward_amax_history[...] = jnp.where(ran, history, old_history)
        self.fp8_backward_scale[...] = jnp.where(ran, scale, old_scale)
        self.fp8_grad_amax[...] = jnp.zeros_like(self.fp8_grad_amax[...])


def finish_backward(model: nnx.Module, grads: nnx.State, recipe: Recipe | None) -> nnx.State:
    """The backward DelayedScaling update of every FP8 module of `model`; returns the parameter grads.

    `grads` is what nnx.grad(loss, argnums=nnx.DiffState(0, GRAD_FILTER))(model, ...) returned;
    `recipe` is the step's fp8_autocast recipe (None when FP8 was off: nothing to update).
    """
    if recipe is not None and not isinstance(recipe, RECIPE_CLASSES):
        raise TypeError(f"finish_backward(recipe={recipe!r}): pass the step's twinspec.recipe recipe, or None")
    grad_amaxes, param_grads = nnx.split_state(grads, FP8GradAmax, ...)
    if isinstance(recipe, DelayedScaling):
        modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, FP8Module) and node.num_gemms]
        if modules and not jax.tree.leaves(grad_amaxes):
            raise ValueError(
                "grads hold no FP8 grad amaxes, so DelayedScaling cannot update its grad scales: take them with "
                "nnx.grad(loss, argnums=nnx.DiffState(0, jaxside.modules.GRAD_FILTER))"
            )
        nnx.update(model, grad_amaxes)
        for module in modules:
            module.update_backward_scaling(recipe)
    return param_grads
