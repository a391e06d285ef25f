"""Flax NNX twins of torchside.modules: FP8 GEMMs through jax.custom_vjp inside `fp8_autocast`.

`Linear`, `LayerNormLinear` (LayerNorm or RMSNorm), `LayerNormMLP`, `LayerNorm`, `RMSNorm`,
`DotProductAttention`, `MultiheadAttention`, `TransformerLayer` (configured by `TransformerConfig`),
`GroupedLinear` and rotary embeddings, with torchside's parameter names and nesting, Flax's [in, out] kernels, logical axis names on every parameter (`place`
and `shardings` map them to a mesh by jaxside.sharding's rules) and torchside's DelayedScaling state.
A training step:

    def loss_fn(model, x, y):
        with fp8_autocast(recipe=recipe):
            prediction = model(x)
        return jnp.mean((prediction - y) ** 2)

    grads = nnx.grad(loss_fn, argnums=nnx.DiffState(0, GRAD_FILTER))(model, x, y)
    optimizer.update(model, finish_backward(model, grads, recipe))

Parameter paths are torch's, except that a GEMM's `weight` [out, in] is the Flax kernel [in, out]:
"weight" in its name becomes "kernel" (`weight` -> `kernel`, `fc1_weight` -> `fc1_kernel`,
GroupedLinear's `weight3` -> `kernel3`); norm weights keep their names.
"""

from jaxside.modules.attention import DotProductAttention
from jaxside.modules.autocast import fp8_autocast, fp8_frame
from jaxside.modules.base import GRAD_FILTER, FP8GradAmax, FP8Module, FP8State, default_kernel_init, finish_backward
from jaxside.modules.config import KERNEL_AXES, ModuleConfig
from jaxside.modules.functions import fp8_linear, linear, normalize, quantize_operand
from jaxside.modules.grouped_linear import GroupedLinear
from jaxside.modules.layernorm_mlp import ACTIVATIONS, LayerNormMLP
from jaxside.modules.linear import LayerNormLinear, Linear
from jaxside.modules.multihead_attention import MultiheadAttention
from jaxside.modules.normalization import LayerNorm, NormSettings, RMSNorm
from jaxside.modules.placement import place, shardings
from jaxside.modules.rotary import RotaryPositionEmbedding, apply_rotary_pos_emb
from jaxside.modules.transformer_config import TransformerConfig
from jaxside.modules.transformer_layer import TransformerLayer

__all__ = [
    "ACTIVATIONS",
    "DotProductAttention",
    "FP8GradAmax",
    "FP8Module",
    "FP8State",
    "GRAD_FILTER",
    "GroupedLinear",
    "KERNEL_AXES",
    "LayerNorm",
    "LayerNormLinear",
    "LayerNormMLP",
    "Linear",
    "ModuleConfig",
    "MultiheadAttention",
    "NormSettings",
    "RMSNorm",
    "RotaryPositionEmbedding",
    "TransformerConfig",
    "TransformerLayer",
    "apply_rotary_pos_emb",
    "default_kernel_init",
    "finish_backward",
    "fp8_autocast",
    "fp8_frame",
    "fp8_linear",
    "linear",
    "normalize",
    "place",
    "quantize_operand",
    "shardings",
]
