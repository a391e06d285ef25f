"""jaxside.optim.fused_adam against a float64 numpy model of FusedAdam's update (no torch).

Parameters live on the FSDP x TP mesh (4, 2), placed by jaxside.sharding; 50 jitted steps take a
fixed sequence of gradients of three magnitudes: 1 (a kernel), 1e2 (a bias) and 1e-8 (a norm
weight, where sqrt(v) is of the order of eps, so eps's place in the formula shows).

Tolerance, from the arithmetic: every step rounds each fp32 operation once (relative error
u = 2^-24; XLA may fuse a multiply-add into one rounding), about 10 roundings on the way to the new
parameter, and a parameter's error is the sum of its steps' errors. So after N steps
|p - p64| <= N * 10 * u * (max|p| + lr * max|m / sqrt(v)|), about 7e-5 here; the moments are
averages of fresh gradients and stay within a few u of max|g| (or max|g|^2). A wrong bias
correction, eps placement or weight decay moves the parameters by ~lr * 1e-2 or more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxside import sharding as S
from jaxside.optim import fused_adam

STEPS = 50
LR, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1
U = 2.0**-24
# name -> (shape, logical axes, role, gradient magnitude)
PARAMETERS = {
    "kernel": ((16, 8), ("embed", "mlp"), "kernel", 1.0),
    "bias": ((8,), ("mlp",), "bias", 1e2),
    "norm": ((16,), ("embed",), "norm", 1e-8),
}


def _inputs(dtype) -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(7)
    params = {k: rng.standard_normal(shape).astype(np.float32) for k, (shape, *_, scale) in PARAMETERS.items()}
    params = {k: np.asarray(v.astype(dtype), np.float32) for k, v in params.items()}  # representable in dtype
    grads = [
        {k: (scale * rng.standard_normal(shape) * rng.uniform(0.5, 2.0)).astype(np.float32)
         for k, (shape, *_, scale) in PARAMETERS.items()}
        for _ in range(STEPS)
    ]  # fmt: skip
    return params, grads


def _adam_float64(params, grads, lrs, adam_w_mode: bool, grad_dtype) -> tuple[dict, dict, dict]:
    """FusedAdam's update in float64 (fp8kernels/adam_reference.py), grads first cast to the parameter dtype."""
    beta1, beta2 = BETAS
    p = {k: v.astype(np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    for t, (step_grads, lr) in enumerate(zip(grads, lrs), start=1):
        for k in p:
            g = step_grads[k].astype(grad_dtype).astype(np.float64)
            if not adam_w_mode:
                g = g + WEIGHT_DECAY * p[k]
            m[k] = beta1 * m[k] + (1 - beta1) * g
            v[k] = beta2 * v[k] + (1 - beta2) * g * g
            m_hat, v_hat = m[k] / (1 - beta1**t), v[k] / (1 - beta2**t)
            decay = 1 - lr * WEIGHT_DECAY if adam_w_mode else 1.0
            p[k] = p[k] * decay - lr * m_hat / (np.sqrt(v_hat) + EPS)
    return p, m, v


def _placed(values: dict, dtype, mesh) -> dict:
    placed = {}
    for k, x in values.items():
        _, axes, role, _ = PARAMETERS[k]
        placed[k] = jax.device_put(jnp.asarray(x, dtype), S.named_sharding(mesh, axes, "column", role))
    return placed


CASES = {
    "adamw-fp32": dict(adam_w_mode=True, dtype=jnp.float32, schedule=False),
    "adam-l2-fp32-schedule": dict(adam_w_mode=False, dtype=jnp.float32, schedule=True),
    "adamw-bf16-master": dict(adam_w_mode=True, dtype=jnp.bfloat16, schedule=False),
    "adam-l2-bf16-master-schedule": dict(adam_w_mode=False, dtype=jnp.bfloat16, schedule=True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fifty_steps_match_a_float64_model(case):
    adam_w_mode, dtype, scheduled = CASES[case]["adam_w_mode"], CASES[case]["dtype"], CASES[case]["schedule"]
    schedule = optax.linear_schedule(LR, LR / 10, STEPS)
    lrs = [float(np.float32(schedule(t))) for t in range(STEPS)] if scheduled else [LR] * STEPS
    params_np, grads_np = _inputs(dtype)
    mesh = S.make_mesh(dp_shard=4, tp=2)
    params = _placed(params_np, dtype, mesh)
    learning_rate = schedule if scheduled else LR
    tx = fused_adam(learning_rate, BETAS, EPS, WEIGHT_DECAY, adam_w_mode=adam_w_mode, master_weights=True)
    state = tx.init(params)

    @jax.jit
    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for grads in grads_np:
        params, state = train_step(params, state, _placed(grads, jnp.float32, mesh))

    grad_dtype = ml_dtypes.bfloat16 if dtype == jnp.bfloat16 else np.float32
    p64, m64, v64 = _adam_float64(params_np, grads_np, lrs, adam_w_mode, grad_dtype)
    assert int(state.step) == STEPS
    for k in PARAMETERS:
        master = params[k] if dtype == jnp.float32 else state.master_param[k]
        got = np.asarray(master, np.float64)
        bound = STEPS * 10 * U * (np.abs(p64[k]).max() + LR * 10)  # betas (0.9, 0.95): |m_hat / sqrt(v_hat)| < 6
        np.testing.assert_allclose(got, p64[k], rtol=0, atol=bound, err_msg=f"{case}: {k}")
        l2 = 0.0 if adam_w_mode else WEIGHT_DECAY  # Adam's L2 term is part of the gradient the moments see
        grad_max = np.abs([g[k] for g in grads_np]).max() + l2 * (np.abs(params_np[k]).max() + STEPS * LR * 10)
        np.testing.assert_allclose(np.asarray(state.exp_avg[k]), m64[k], rtol=0, atol=8 * U * grad_max)
        np.testing.assert_allclose(np.asarray(state.exp_avg_sq[k]), v64[k], rtol=0, atol=8 * U * grad_max**2)
        if dtype == jnp.bfloat16:  # the parameter is its master rounded to nearest even, to the bit
            rounded = np.asarray(state.master_param[k]).astype(ml_dtypes.bfloat16)
            assert np.array_equal(np.asarray(params[k]).view(np.uint16), rounded.view(np.uint16)), k


def test_state_is_sharded_like_the_parameters_before_and_after_a_jitted_step():
    mesh = S.make_mesh(dp_replicate=2, dp_shard=2, tp=2)
    params_np, grads_np = _inputs(np.float32)
    params = _placed(params_np, jnp.bfloat16, mesh)
    params["fp32_norm"] = jax.device_put(params_np["norm"], params["norm"].sharding)
    grads = _placed(grads_np[0], jnp.float32, mesh)
    grads["fp32_norm"] = grads["norm"]
    tx = fused_adam(LR, master_weights=True)
    state = tx.init(params)
    assert state.master_param["fp32_norm"] is None  # an fp32 parameter is its own master
    updates, stepped = jax.jit(tx.update)(grads, state, params)
    trees = [updates, state.exp_avg, state.exp_avg_sq, state.master_param]
    trees += [stepped.exp_avg, stepped.exp_avg_sq, stepped.master_param]
    for tree in trees:
        for name, value in tree.items():
            if value is not None:
                assert value.sharding.is_equivalent_to(params[name].sharding, value.ndim), name


@pytest.mark.parametrize(
    "make, error, message",
    [
        (lambda: fused_adam(-1.0), ValueError, "learning_rate must be >= 0"),
        (lambda: fused_adam(betas=(0.9, 1.0)), ValueError, r"betas must lie in \[0, 1\)"),
        (lambda: fused_adam(eps=-1e-8), ValueError, "eps and weight_decay must be >= 0"),
        (lambda: fused_adam().init({"w": jnp.zeros(3, jnp.int32)}), TypeError, r"parameter \['w'\] is int32"),
        (lambda: fused_adam().update({"w": jnp.zeros(3)}, None), ValueError, "needs the parameters"),
    ],
)
def test_mistakes_raise_errors_that_say_what_to_do(make, error, message):
    with pytest.raises(error, match=message):
        make()
