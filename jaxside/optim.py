"""Adam and AdamW with torchside's FusedAdam arithmetic, as an Optax GradientTransformation.

The math is `fp8kernels/adam_reference.py`'s, per element in fp32, t the step count from 1:

    g  = fp32(grad cast to the parameter's dtype)       FusedAdam casts grads to the parameter dtype
    g  = g + weight_decay * p                            Adam with L2 only (adam_w_mode=False)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g * g
    p  = p * param_decay - step_size * (m / (sqrt(v) * inv_bias_correction2_sqrt + eps))

with step_size = lr / (1 - beta1^t), inv_bias_correction2_sqrt = 1 / sqrt(1 - beta2^t) and
param_decay = 1 - lr * weight_decay (AdamW) or 1, computed as FusedAdam does: in float64 from Python
numbers, then rounded to fp32. JAX keeps no float64 on the device unless x64 is switched on for the
whole program, so these three numbers come from a host callback, one small transfer per step.
`1 - beta1` and the like are Python float64 rounded to fp32, as torch rounds a Python scalar.

State (`FusedAdamState`), a pytree sharded like the parameters when `init` runs on placed parameters
(under `jax.jit`, pass `out_shardings` to keep that): the step count, fp32 `exp_avg` and `exp_avg_sq`,
and with `master_weights=True` an fp32 `master_param` for every bf16/fp16 parameter (None elsewhere:
an fp32 parameter is its own master). The new parameter is the fp32 result rounded to the
parameter's dtype (to nearest even), and the update returned is `new - param` in fp32, which
`optax.apply_updates` adds back in fp32:
- bf16/fp16 parameters: the difference of two values with 8 or 11 significant bits is exact in fp32
  unless their magnitudes differ by more than 2^13, so `param + update` is `new` to the bit.
- fp32 parameters: exact whenever the step keeps the parameter within a factor of 2 (Sterbenz);
  otherwise off by at most one rounding of the difference.

Not bitwise with the reference: XLA fuses a multiply-add into one FMA (one rounding where the torch
reference rounds twice), as Triton does on the GPU, so results agree to about an ulp per step
(tests/bridge/test_optim_cross.py). XLA on CPU also flushes subnormals (see `_fp32.py`) where torch
keeps them, so moments below 2^-126 can differ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

PARAM_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)  # what FusedAdam updates


class FusedAdamState(NamedTuple):
    """Optimizer state; the names are FusedAdam's state keys."""

    step: jax.Array  # int32 scalar: steps taken
    exp_avg: optax.Updates  # fp32, shaped and sharded like the parameters
    exp_avg_sq: optax.Updates
    master_param: optax.Params  # fp32 masters of bf16/fp16 parameters; None leaves where there is none


class _LeafStep(NamedTuple):
    update: jax.Array
    exp_avg: jax.Array
    exp_avg_sq: jax.Array
    master_param: jax.Array | None


def fused_adam(
    learning_rate: float | Callable[[jax.Array], jax.Array] = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    *,
    adam_w_mode: bool = True,
    master_weights: bool = False,
) -> optax.GradientTransformation:
    """FusedAdam's Adam (L2) or AdamW (`adam_w_mode`, the default); `learning_rate` a float or an Optax schedule.

    A schedule is evaluated at the number of steps taken before the current one (Optax's convention)
    and passed to the host in fp32, as FusedAdam reads a tensor learning rate.
    """
    beta1, beta2 = _checked_hyperparameters(learning_rate, betas, eps, weight_decay)
    l2 = np.float32(0.0 if adam_w_mode else weight_decay)
    beta1_f32, one_minus_beta1 = np.float32(beta1), np.float32(1.0 - beta1)
    beta2_f32, one_minus_beta2 = np.float32(beta2), np.float32(1.0 - beta2)
    eps_f32 = np.float32(eps)

    def host_scalars(step: np.ndarray, lr: np.ndarray | float = learning_rate) -> np.ndarray:
        """(step_size, inv_bias_correction2_sqrt, param_decay): fp8kernels.adam_reference.adam_scalars' host path."""
        step, lr = float(step), float(lr)
        step_size = lr / (1 - beta1**step)
        inv_bias_correction2_sqrt = 1 / math.sqrt(1 - beta2**step)
        param_decay = (1 - lr * weight_decay) if adam_w_mode else 1.0
        return np.array([step_size, inv_bias_correction2_sqrt, param_decay], dtype=np.float32)

    def keeps_master(param: jax.Array) -> bool:
        return master_weights and param.dtype != jnp.float32

    def init(params: optax.Params) -> FusedAdamState:
        _check_param_dtypes(params)
        return FusedAdamState(
            step=jnp.zeros([], jnp.int32),
            exp_avg=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params),
            exp_avg_sq=jax.tree.map(lambda p: jnp.zeros_like(p, dtype=jnp.float32), params),
            master_param=jax.tree.map(lambda p: p.astype(jnp.float32) if keeps_master(p) else None, params),
        )

    def update(
        grads: optax.Updates, state: FusedAdamState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, FusedAdamState]:
        if params is None:
            raise ValueError("fused_adam needs the parameters: call update(grads, state, params)")
        # A float learning rate stays a Python float (float64) in the callback's closure; passed as an
        # argument it would become an fp32 array.
        scheduled_lr = (jnp.asarray(learning_rate(state.step), jnp.float32),) if callable(learning_rate) else ()
        step = state.step + 1
        scalars = jax.pure_callback(
            host_scalars, jax.ShapeDtypeStruct((3,), jnp.float32), step, *scheduled_lr, vmap_method="sequential"
        )
        step_size, inv_bias_correction2_sqrt, param_decay = scalars

        def leaf_step(master, param, grad, exp_avg, exp_avg_sq) -> _LeafStep:
            p = param.astype(jnp.float32) if master is None else master
            g = grad.astype(param.dtype).astype(jnp.float32)
            if not adam_w_mode:  # L2: the decay goes through the gradient
                g = g + l2 * p
            exp_avg = beta1_f32 * exp_avg + one_minus_beta1 * g
            exp_avg_sq = beta2_f32 * exp_avg_sq + one_minus_beta2 * g * g
            p = p * param_decay - step_size * (exp_avg / (jnp.sqrt(exp_avg_sq) * inv_bias_correction2_sqrt + eps_f32))
            new_param = p.astype(param.dtype)
            update = new_param.astype(jnp.float32) - param.astype(jnp.float32)
            return _LeafStep(update, exp_avg, exp_avg_sq, None if master is None else p)

        stepped = jax.tree.map(
            leaf_step, state.master_param, params, grads, state.exp_avg, state.exp_avg_sq, is_leaf=_is_none
        )
        is_step = lambda x: isinstance(x, _LeafStep)  # noqa: E731
        field = lambda name: jax.tree.map(lambda s: getattr(s, name), stepped, is_leaf=is_step)  # noqa: E731
        new_state = FusedAdamState(step, field("exp_avg"), field("exp_avg_sq"), field("master_param"))
        return field("update"), new_state

    return optax.GradientTransformation(init, update)


def _is_none(x: Any) -> bool:
    return x is None


def _check_param_dtypes(params: optax.Params) -> None:
    for path, param in jax.tree_util.tree_leaves_with_path(params):
        if param.dtype not in PARAM_DTYPES:
            raise TypeError(
                f"parameter {jax.tree_util.keystr(path)} is {param.dtype}; fused_adam updates float32, bfloat16 "
                "and float16 parameters (keep FP8 weights as a bf16/fp32 parameter and quantize it in the module)"
            )


def _checked_hyperparameters(learning_rate, betas, eps, weight_decay) -> tuple[float, float]:
    if not callable(learning_rate) and not float(learning_rate) >= 0:
        raise ValueError(f"learning_rate must be >= 0 or an Optax schedule, got {learning_rate!r}")
    beta1, beta2 = (float(b) for b in betas)
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"betas must lie in [0, 1), got {tuple(betas)}")
    if not (eps >= 0 and weight_decay >= 0):
        raise ValueError(f"eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
    return beta1, beta2
