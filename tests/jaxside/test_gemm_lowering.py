"""The GEMMs jaxside emits are the forms XLA:GPU runs fast, with the numerics contract's math.

Read from the lowered StableHLO (what XLA receives), so the checks run on CPU:
- 16-bit high-precision dots (FP8 off, the Llama head, attention's q k^T off cuDNN) keep their bf16
  operands at DEFAULT precision with fp32 accumulation: bf16 products are exact in fp32, so that is
  fp32 math on the tensor cores (HIGHEST may make XLA:GPU upcast to an fp32 GEMM without them);
- block-scaled operands with power-of-2 scales are dequantized to bf16 (exact), else to fp32 at HIGHEST;
- per-tensor FP8 GEMMs scale their output by a rank-0 scale (XLA:GPU folds a scalar into cuBLASLt) and,
  with power-of-2 scales and no bias, round to the activation dtype in the dot itself.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxside.models.llama import VocabKernel
from jaxside.modules import DotProductAttention
from jaxside.modules.functions import fp8_linear, linear
from twinspec.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

_TYPE = r"tensor<[\dx]+x(\w+)>"
_DOT = re.compile(rf"stablehlo\.dot_general .*precision = \[(\w+), \w+\].*: \({_TYPE}, {_TYPE}\) -> {_TYPE}")


def _dots(fn, *args) -> list[tuple[str, str, str, str]]:
    """(precision, lhs type, rhs type, result type) of every dot_general in fn's lowered StableHLO."""
    return _DOT.findall(jax.jit(fn).lower(*args).as_text())


def _operands(in_features=256, out_features=128, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((64, in_features)), dtype)
    kernel = jnp.asarray(rng.standard_normal((in_features, out_features)) * in_features**-0.5, dtype)
    return x, kernel


def _fp8_step(recipe, bias=None):
    """The forward and backward GEMMs of one FP8 linear (the loss keeps fprop alive)."""

    def loss(x, kernel):
        y, _ = fp8_linear(x, kernel, bias, recipe)
        return jnp.sum(y.astype(jnp.float32) * y.astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1))


def test_a_bf16_high_precision_linear_multiplies_bf16_operands_with_fp32_accumulation():
    assert _dots(lambda x, k: linear(x, k, None), *_operands()) == [("DEFAULT", "bf16", "bf16", "f32")]


def test_an_fp32_high_precision_linear_stays_at_highest_precision():
    assert _dots(lambda x, k: linear(x, k, None), *_operands(dtype=jnp.float32)) == [("HIGHEST", "f32", "f32", "f32")]


@pytest.mark.parametrize("recipe", [Float8BlockScaling(), MXFP8BlockScaling()], ids=["block", "mxfp8"])
def test_power_2_block_scaled_gemms_multiply_bf16_values(recipe):
    assert _dots(_fp8_step(recipe), *_operands()) == [("DEFAULT", "bf16", "bf16", "f32")] * 3


def test_block_scaled_gemms_with_fp32_scales_multiply_fp32_values():
    dots = _dots(_fp8_step(Float8BlockScaling(power_2_scale=False)), *_operands())
    assert dots == [("HIGHEST", "f32", "f32", "f32")] * 3


def test_per_tensor_gemms_with_power_2_scales_round_to_the_activation_dtype_in_the_dot():
    dots = _dots(_fp8_step(Float8CurrentScaling(power_2_scale=True)), *_operands())
    assert [result for *_, result in dots] == ["bf16"] * 3
    assert all(lhs.startswith("f8") and rhs.startswith("f8") for _, lhs, rhs, _ in dots)


def test_per_tensor_gemms_with_other_scales_or_a_bias_accumulate_to_fp32():
    x, kernel = _operands()
    bias = jnp.zeros(kernel.shape[1], jnp.bfloat16)
    fprop_with_bias = lambda x, k: fp8_linear(x, k, bias, Float8CurrentScaling(power_2_scale=True))[0]  # noqa: E731
    assert [result for *_, result in _dots(fprop_with_bias, x, kernel)] == ["f32"]
    assert [result for *_, result in _dots(_fp8_step(Float8CurrentScaling()), x, kernel)] == ["f32"] * 3


def test_per_tensor_gemms_scale_by_a_rank_0_scale():
    fprop = lambda x, k: fp8_linear(x, k, None, Float8CurrentScaling())[0]  # noqa: E731
    hlo = jax.jit(fprop).lower(*_operands()).as_text()
    to_output = r"broadcast_in_dim \S+, dims = \[[\d, ]*\] : \((tensor<[^>]*>)\) -> tensor<64x128xf32>"
    scale_broadcasts = re.findall(to_output, hlo)
    assert scale_broadcasts == ["tensor<f32>"]


def test_the_llama_head_multiplies_bf16_operands_at_default_precision():
    head = VocabKernel(64, 128, nnx.initializers.normal(0.02), jnp.bfloat16, nnx.Rngs(0))
    h = jnp.ones((8, 2, 64), jnp.bfloat16)
    assert [(precision, lhs, rhs) for precision, lhs, rhs, _ in _dots(head.logits, h)] == [("DEFAULT", "bf16", "bf16")]


def test_attention_off_cudnn_takes_bf16_scores_on_tensor_cores_and_fp32_probabilities_at_highest():
    attention = DotProductAttention(4, 12, attn_mask_type="causal")  # head dim 12: cuDNN's kernel never applies
    q = k = v = jnp.ones((8, 2, 4, 12), jnp.bfloat16)
    assert _dots(attention, q, k, v) == [("DEFAULT", "bf16", "bf16", "f32"), ("HIGHEST", "f32", "f32", "f32")]
