"""Under jax.jit, every GEMM of a current-scaling Linear / LayerNormMLP step is a real FP8 GEMM on Hopper.

No silent fallback: compile one forward + backward, list the GEMM instructions of the optimized HLO
(`dot`, and cuBLAS custom calls) with the types of their two matrix operands, and assert that there
are exactly 3 per linear layer (fprop, dgrad, wgrad) and, on a Hopper GPU, that each multiplies
f8e4m3fn / f8e5m2 operands. On CPU, XLA upcasts FP8 dots, so only the count is checked there (which
also checks the HLO reading that the GPU test relies on).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from jaxside.hlo import FP8_TYPES, gemm_operand_types
from jaxside.modules import LayerNormMLP, Linear, fp8_autocast
from twinspec.recipe import Float8CurrentScaling


def _step_hlo(module, x) -> str:
    """The optimized HLO of one jitted current-scaling forward + backward (grads of the parameters and x)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def step(params, rest, x, dy):
        def loss(params, x):
            model = nnx.merge(graphdef, params, rest)
            with fp8_autocast(recipe=Float8CurrentScaling()):
                y = model(x)
            return jnp.sum(y.astype(jnp.float32) * dy)

        return jax.value_and_grad(loss, argnums=(0, 1))(params, x)  # the loss keeps fprop alive

    dy = jnp.ones(x.shape[:-1] + (module.hidden_size if isinstance(module, LayerNormMLP) else module.out_features,))
    return jax.jit(step).lower(params, rest, x, dy).compile().as_text()


CASES = {  # name -> (module builder, linear layers)
    "linear": (lambda: Linear(256, 512, params_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 1),
    "layernorm_mlp": (lambda: LayerNormMLP(256, 512, params_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), 2),
}


def _check(case: str, on_hopper: bool) -> None:
    build, linears = CASES[case]
    hlo = _step_hlo(build(), jnp.ones((2, 128, 256), jnp.bfloat16))
    gemms = gemm_operand_types(hlo)
    assert len(gemms) == 3 * linears, f"{case}: {len(gemms)} GEMMs, expected 3 per linear layer: {gemms}"
    if on_hopper:
        fallbacks = [pair for pair in gemms if not all(t in FP8_TYPES for t in pair)]
        assert not fallbacks, f"{case}: GEMMs not in FP8 (a silent high-precision fallback): {fallbacks}"


def test_cpu_hlo_has_three_gemms_per_linear():
    _check("linear", on_hopper=False)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_hopper_step_runs_every_gemm_in_fp8(case):
    device = jax.devices()[0]
    if device.platform != "gpu" or float(getattr(device, "compute_capability", "0")) < 9.0:
        pytest.skip(f"needs JAX on a Hopper (sm_90+) GPU; JAX runs on {device.platform} {device.device_kind}")
    _check(case, on_hopper=True)
