"""`TransformerLayer`: a pre-norm transformer block, torchside.modules.transformer_layer's twin.

Shape legend: S sequence, B batch, D hidden size, F ffn hidden size. Hidden states are [S, B, D]
("sbhd") or [B, S, D] ("bshd").

    h   = x + self_attention(x)        self_attention: norm -> QKV -> attention -> proj
    out = h + layernorm_mlp(h)         layernorm_mlp: norm -> fc1 -> activation -> fc2

`self_attention` is a MultiheadAttention with its input norm, `layernorm_mlp` a LayerNormMLP (both
norms `TransformerConfig.normalization`), so parameter paths are torch's (e.g.
`self_attention.layernorm_qkv.kernel`, `layernorm_mlp.fc1_kernel`); each residual sum is rounded
to the activation dtype, as torch's. No hidden dropout (TransformerConfig requires 0.0).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.attention import AttentionMask
from jaxside.modules.base import Initializer
from jaxside.modules.config import check_size
from jaxside.modules.layernorm_mlp import LayerNormMLP
from jaxside.modules.multihead_attention import MultiheadAttention, RotaryFreqs, check_transformer_config
from jaxside.modules.tokens import batch_dim
from jaxside.modules.transformer_config import TransformerConfig


class TransformerLayer(nnx.Module):
    """Pre-norm self-attention + MLP block with TransformerEngine's te.TransformerLayer sizes; knobs in the config."""

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        params_dtype=jnp.float32,
        kernel_init: Initializer | None = None,
        output_kernel_init: Initializer | None = None,
        config: TransformerConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        owner = "TransformerLayer"
        config = check_transformer_config(owner, config)
        check_size(owner, "ffn_hidden_size", ffn_hidden_size)
        self.config = config
        inits = {"kernel_init": kernel_init, "output_kernel_init": output_kernel_init}
        self.self_attention = MultiheadAttention(
            hidden_size,
            num_attention_heads,
            num_gqa_groups=num_gqa_groups,
            input_layernorm=True,
            params_dtype=params_dtype,
            config=config,
            rngs=rngs,
            **inits,
        )
        norm = config.norm_settings()
        self.layernorm_mlp = LayerNormMLP(
            hidden_size,
            ffn_hidden_size,
            eps=norm.eps,
            bias=config.bias,
            normalization=norm.normalization,
            activation=config.activation,
            glu_interleave=config.glu_interleave,
            zero_centered_gamma=norm.zero_centered_gamma,
            params_dtype=params_dtype,
            set_parallel_mode=config.mlp_tp == "split",
            config=config.module_config,
            rngs=rngs,
            **inits,
        )

    def __call__(
        self,
        hidden_states,
        attention_mask: AttentionMask = None,
        self_attn_mask_type: str | None = None,
        rotary_pos_emb: RotaryFreqs = None,
    ) -> Array:
        """The block's output, shaped like hidden_states ([S, B, D] or [B, S, D] by qkv_format)."""
        attention_out = self.self_attention(
            hidden_states,
            attention_mask=attention_mask,
            attn_mask_type=self_attn_mask_type,
            rotary_pos_emb=rotary_pos_emb,
        )
        hidden = hidden_states + attention_out
        with batch_dim(1 if self.config.qkv_format == "sbhd" else 0):  # where data parallelism splits the tokens
            return hidden + self.layernorm_mlp(hidden)
