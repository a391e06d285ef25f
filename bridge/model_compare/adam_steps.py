"""`bridge.compare(..., steps=N)`: one Adam step on both sides from one state, and its checks.

torch takes a torchside FusedAdam step with its own gradients; JAX a jaxside.optim.fused_adam step
(the same arithmetic, bridge/crosscheck.py pairs them the same way) from torch's parameters and
moments before the step, with JAX's own gradients. Starting both from one state keeps each step's
checks about that step (bridge.numerics: left to run free, Adam turns rounding noise into +-lr steps).

Checked per parameter, stage names as verify's (bridge.numerics.STAGES):
- "param": max-abs <= 2 * adam_step_bound(lr), verify's rule (bridge.numerics.tolerance).
- "exp_avg": m' = b1 m + (1 - b1) g from the common m, so torch's and JAX's m' differ by exactly
  (1 - b1) ||g_jax - g_torch|| (the gradients' own distance, already checked) plus each side's
  fp32 rounding of the update, <= 3u (b1 ||m|| + (1 - b1) ||g||) per side; relative to ||m'_torch||.
- "exp_avg_sq": likewise (1 - b2) ||g_jax^2 - g_torch^2|| plus 3u (b2 ||v|| + (1 - b2) ||g^2||) per side.
So these two check the optimizer, not the gradients: a wrong beta, an L2 decay on one side or a
moment that is not decayed are named here, at the step where they first act.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
import optax
import torch
from torch import nn

from bridge.model_compare import jax_calls
from bridge.model_compare.checks import distance_check
from bridge.numerics import ADAM_BETAS, FP32_U, TensorCheck, Tolerance, adam_step_bound, local_stats, reduce_stats
from bridge.params import ParamPair, dotted
from jaxside.optim import FusedAdamState, fused_adam
from torchside.optim import FusedAdam

LR = 1e-3  # as verify's (bridge.crosscheck.LR)
ROUNDING = 2 * 3 * FP32_U  # two sides, each <= 3u of the summed magnitudes (module docstring)


def torch_adam(model: nn.Module) -> FusedAdam:
    return FusedAdam(model.parameters(), lr=LR, betas=ADAM_BETAS)


def jax_adam() -> optax.GradientTransformation:
    """jaxside's twin of `torch_adam`."""
    return fused_adam(LR, ADAM_BETAS)


def adam_step(
    torch_model: nn.Module, optimizer: FusedAdam, pairs: list[ParamPair], torch_grads: Mapping[str, torch.Tensor],
    jax_grads: Mapping[tuple, np.ndarray],
) -> list[TensorCheck]:  # fmt: skip
    """One step on both sides from torch's current state; the param, exp_avg and exp_avg_sq checks (docstring)."""
    params = dict(torch_model.named_parameters())
    before = {name: _moments(optimizer, p) for name, p in params.items()}
    steps_taken = int(next((s["step"] for s in optimizer.state.values() if "step" in s), 0))
    jax_new = _jax_step(pairs, params, before, jax_grads, steps_taken)
    for name, p in params.items():
        p.grad = torch_grads[name].clone() if name in torch_grads else None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

    beta1, beta2 = ADAM_BETAS
    param_limit = 2 * adam_step_bound(LR)
    checks = {"param": [], "exp_avg": [], "exp_avg_sq": []}
    for pair in pairs:
        name = pair.torch_name
        if name not in torch_grads:
            continue
        got = {stage: jax_calls.to_torch(pair.layout.to_torch(jax_new[stage][pair.jax_path])) for stage in checks}
        torch_new = {"param": params[name].detach(), **_moments(optimizer, params[name])}
        g_torch = torch_grads[name].cpu().double()
        g_jax = jax_calls.to_torch(pair.layout.to_torch(jax_grads[pair.jax_path])).double()
        m, v = (before[name][k].double() for k in ("exp_avg", "exp_avg_sq"))
        bounds = {
            "exp_avg": _moment_bound(
                (1 - beta1) * _norm(g_jax - g_torch), beta1 * _norm(m) + (1 - beta1) * _norm(g_torch),
                torch_new["exp_avg"],
            ),
            "exp_avg_sq": _moment_bound(
                (1 - beta2) * _norm(g_jax.square() - g_torch.square()),
                beta2 * _norm(v) + (1 - beta2) * _norm(g_torch.square()), torch_new["exp_avg_sq"],
            ),
        }  # fmt: skip
        checks["param"].append(_param_check(name, got["param"], torch_new["param"], param_limit))
        for moment, bound in bounds.items():
            checks[moment].append(distance_check(moment, name, [got[moment]], [torch_new[moment]], bound))
    return [check for stage in ("param", "exp_avg", "exp_avg_sq") for check in checks[stage]]


def _norm(x: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(x))


def _moment_bound(propagated: float, magnitude: float, torch_moment: torch.Tensor) -> float:
    """(the gradients' distance carried into the moment + both sides' rounding) / ||torch's new moment||."""
    difference, reference = propagated + ROUNDING * magnitude, _norm(torch_moment.double())
    if reference > 0:
        return difference / reference
    return 0.0 if difference == 0 else math.inf


def _param_check(name: str, got: torch.Tensor, expected: torch.Tensor, max_abs: float) -> TensorCheck:
    relative, largest, nan = reduce_stats(local_stats(got.cpu(), expected.cpu(), 1)[None])[0]
    limit = Tolerance(None, max_abs)
    return TensorCheck(0, "param", name, relative, largest, nan, limit, limit.passes(relative, largest, nan))


def _moments(optimizer: FusedAdam, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """FusedAdam's unscaled fp32 moments of `param` (zeros before its first step)."""
    state = optimizer.state.get(param, {})
    found = {}
    for key in ("exp_avg", "exp_avg_sq"):
        value = state.get(key)
        found[key] = torch.zeros(param.shape, dtype=torch.float32) if value is None else value.detach().float().cpu()
    return found


def _jax_step(pairs, params, before, jax_grads, steps_taken: int) -> dict[str, dict[tuple, np.ndarray]]:
    """{"param" | "exp_avg" | "exp_avg_sq": {JAX path: value}} after one jax_adam step from torch's state."""
    present = [pair for pair in pairs if pair.jax_path in jax_grads]
    to_jax = lambda pair, t: jnp.asarray(pair.layout.to_jax(jax_calls.to_numpy(t)))  # noqa: E731
    keyed = lambda f: {dotted(pair.jax_path): f(pair) for pair in present}  # noqa: E731
    param_tree = keyed(lambda pair: to_jax(pair, params[pair.torch_name].detach()))
    state = FusedAdamState(
        step=jnp.asarray(steps_taken, jnp.int32),
        exp_avg=keyed(lambda pair: to_jax(pair, before[pair.torch_name]["exp_avg"])),
        exp_avg_sq=keyed(lambda pair: to_jax(pair, before[pair.torch_name]["exp_avg_sq"])),
        master_param=keyed(lambda pair: None),
    )
    grads = keyed(lambda pair: jnp.asarray(jax_grads[pair.jax_path]))
    updates, new_state = jax_adam().update(grads, state, param_tree)
    new_params = optax.apply_updates(param_tree, updates)
    trees = {"param": new_params, "exp_avg": new_state.exp_avg, "exp_avg_sq": new_state.exp_avg_sq}
    return {
        stage: {pair.jax_path: np.asarray(tree[dotted(pair.jax_path)]) for pair in present}
        for stage, tree in trees.items()
    }


__all__ = ["LR", "adam_step", "jax_adam", "torch_adam"]
