"""jaxside.optim.fused_adam against torchside.optim.FusedAdam: 20 steps on the same gradients.

torch runs FusedAdam on CPU with the reference backend (fp8kernels/adam_reference.py, the spec); JAX
runs jitted on the (4, 2) mesh with parameters placed by jaxside.sharding. XLA fuses multiply-adds
into FMAs (one rounding where torch's reference rounds twice), so fp32 results differ by an ulp here
and there: the brief's bound is 1e-6 relative (||jax - torch|| / ||torch||) for parameters and
moments (masters included). bf16 parameters are an fp32 result rounded to nearest: where JAX's and
torch's results straddle a bf16 rounding boundary they differ by one bf16 ulp, and no more.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from bridge.numerics import relative_error
from jaxside import sharding as S
from fp8kernels._backend import Backend, backend_for
from jaxside.optim import fused_adam
from torchside.optim import FusedAdam

STEPS = 20
HYPERPARAMETERS = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
RELATIVE_TOLERANCE = 1e-6
# name -> (Flax shape, logical axes, role, gradient magnitude)
PARAMETERS = {
    "kernel": ((32, 16), ("embed", "mlp"), "kernel", 1.0),
    "bias": ((16,), ("mlp",), "bias", 1e-2),
    "norm": ((32,), ("embed",), "norm", 1e-7),
}
CASES = {  # name -> (adam_w_mode, torch dtype, jax dtype, master_weights)
    "adamw-fp32": (True, torch.float32, jnp.float32, False),
    "adam-l2-fp32": (False, torch.float32, jnp.float32, False),
    "adamw-bf16-master": (True, torch.bfloat16, jnp.bfloat16, True),
    "adam-l2-bf16": (False, torch.bfloat16, jnp.bfloat16, False),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_twenty_steps_match_torch_fused_adam(case, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # FusedAdam on CPU then runs fp8kernels/adam_reference.py
    assert backend_for("cpu") is Backend.REFERENCE
    adam_w_mode, torch_dtype, jax_dtype, master_weights = CASES[case]
    rng = np.random.default_rng(11)
    initial = {k: rng.standard_normal(shape).astype(np.float32) for k, (shape, *_) in PARAMETERS.items()}
    grads = [
        {k: (scale * rng.standard_normal(shape)).astype(np.float32) for k, (shape, *_, scale) in PARAMETERS.items()}
        for _ in range(STEPS)
    ]

    # torch keeps a Linear weight [out, in]: the transpose of the Flax kernel.
    torch_params = {k: torch.nn.Parameter(torch.tensor(v.T.copy()).to(torch_dtype)) for k, v in initial.items()}
    optimizer = FusedAdam(
        list(torch_params.values()), **HYPERPARAMETERS, adam_w_mode=adam_w_mode, master_weights=master_weights
    )
    for step_grads in grads:
        for k, param in torch_params.items():
            param.grad = torch.tensor(step_grads[k].T.copy()).to(torch_dtype)
        optimizer.step()

    mesh = S.make_mesh(dp_shard=4, tp=2)
    shardings = {k: S.named_sharding(mesh, axes, "column", role) for k, (_, axes, role, _) in PARAMETERS.items()}
    params = {k: jax.device_put(jnp.asarray(v, jax_dtype), shardings[k]) for k, v in initial.items()}
    lr, betas, eps, weight_decay = HYPERPARAMETERS.values()
    tx = fused_adam(lr, betas, eps, weight_decay, adam_w_mode=adam_w_mode, master_weights=master_weights)
    state = tx.init(params)

    @jax.jit
    def train_step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for step_grads in grads:
        params, state = train_step(params, state, {k: jax.device_put(g, shardings[k]) for k, g in step_grads.items()})

    for k, torch_param in torch_params.items():
        torch_state = optimizer.state[torch_param]
        for name in ("exp_avg", "exp_avg_sq") + (("master_param",) if master_weights else ()):
            expected = torch_state[name].float().numpy().T
            error = relative_error(getattr(state, name)[k], expected)
            assert error <= RELATIVE_TOLERANCE, f"{case}: {k} {name} relative error {error:.3g}"
        got, expected = np.asarray(params[k], np.float32), torch_param.detach().float().numpy().T
        if jax_dtype == jnp.float32:
            error = relative_error(got, expected)
            assert error <= RELATIVE_TOLERANCE, f"{case}: {k} parameter relative error {error:.3g}"
        else:
            one_ulp = np.abs(expected) * 2.0**-7  # bf16 keeps 8 significant bits: an ulp is at most |x| 2^-7
            assert np.all(np.abs(got - expected) <= one_ulp), f"{case}: {k} bf16 parameters"
