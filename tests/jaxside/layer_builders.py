"""The two jaxside attention/transformer modules that the layer, sharded-execution and collective tests build."""

import jax
from flax import nnx

from jaxside.modules import ModuleConfig, MultiheadAttention, TransformerConfig, TransformerLayer

HIDDEN, HEADS, GQA_GROUPS, HEAD_DIM, SEQ, BATCH = 64, 4, 2, 16, 16, 4  # 64 tokens: the quantizer shapes of tests/jaxside
MODULE_CONFIG = ModuleConfig(amax_history_len=8)
SEPARATE_QKV = TransformerConfig(
    normalization="RMSNorm", zero_centered_gamma=True, bias=False, qkv_bias=True, fuse_qkv_params=False,
    qkv_format="bshd", module_config=MODULE_CONFIG,
)  # fmt: skip
FUSED_QKV = TransformerConfig(module_config=MODULE_CONFIG)  # LayerNorm, gelu, biases, "sbhd"
_init = jax.nn.initializers.normal(0.1)
BUILDERS = {
    "mha_separate_qkv_rotary_bshd": lambda: MultiheadAttention(
        HIDDEN, HEADS, num_gqa_groups=GQA_GROUPS, input_layernorm=True, kernel_init=_init, output_kernel_init=_init,
        config=SEPARATE_QKV, rngs=nnx.Rngs(0),
    ),
    "layer_fused_qkv_sbhd": lambda: TransformerLayer(
        HIDDEN, 64, HEADS, num_gqa_groups=GQA_GROUPS, kernel_init=_init, output_kernel_init=_init, config=FUSED_QKV,
        rngs=nnx.Rngs(0),
    ),
}  # fmt: skip
