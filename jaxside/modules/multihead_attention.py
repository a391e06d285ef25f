"""`MultiheadAttention`: QKV projection, rotary embeddings, DotProductAttention, output projection.

The twin of torchside.modules.multihead_attention. Shape legend: S sequence, B batch, D hidden size,
N query heads, G key/value heads, H head dim. Hidden states are [S, B, D] ("sbhd") or [B, S, D]
("bshd"), as `TransformerConfig.qkv_format` says.

The submodules have torchside's attribute names, so every parameter path is torch's with a GEMM's
`weight` [out, in] read as the Flax `kernel` [in, out]:

| fuse_qkv_params | input_layernorm | submodules |
|---|---|---|
| True | True | `layernorm_qkv`: LayerNormLinear D -> (N + 2G) H |
| True | False | `qkv`: Linear D -> (N + 2G) H |
| False | True | `layernorm` (LayerNorm or RMSNorm), then Linears `query`, `key`, `value` |
| False | False | Linears `query` D -> N H, `key` and `value` D -> G H |

plus `proj` (Linear N H -> D) and `core_attention` (no variables). The fused kernel's output
columns are torch's fused weight rows, grouped by key/value head: for each group g, its N/G query
heads, then key head g, then value head g, H columns each. Placement: the QKV projections are
column-parallel with kernel axes ("embed", "heads"), `proj` row-parallel with ("heads", "embed")
(jaxside.sharding's rules); with the grouped layout a contiguous split of the fused columns over
tp is a head split (tp must divide G), the same heads the separate kernels give each tp rank.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.attention import AttentionMask, DotProductAttention
from jaxside.modules.base import Initializer
from jaxside.modules.config import check_size
from jaxside.modules.linear import LayerNormLinear, Linear
from jaxside.modules.normalization import LayerNorm, RMSNorm
from jaxside.modules.rotary import apply_rotary_pos_emb
from jaxside.modules.tokens import batch_dim
from jaxside.modules.transformer_config import TransformerConfig

RotaryFreqs = Array | tuple[Array, Array] | None
QKV_AXES, PROJ_AXES = ("embed", "heads"), ("heads", "embed")


def check_transformer_config(owner: str, config: TransformerConfig | None) -> TransformerConfig:
    """config, or the default TransformerConfig when None; TypeError for anything else."""
    if config is None:
        return TransformerConfig()
    if not isinstance(config, TransformerConfig):
        raise TypeError(f"{owner}(config={config!r}): pass a jaxside.modules.TransformerConfig or None")
    return config


def _head_dim(owner: str, hidden_size: int, num_attention_heads: int, config: TransformerConfig) -> int:
    """config.kv_channels, or hidden_size / num_attention_heads when that divides evenly."""
    if config.kv_channels is not None:
        return config.kv_channels
    if hidden_size % num_attention_heads:
        raise ValueError(
            f"{owner}: hidden_size={hidden_size} is not a multiple of num_attention_heads={num_attention_heads}; "
            "set TransformerConfig(kv_channels=...) to choose the head dim"
        )
    return hidden_size // num_attention_heads


class MultiheadAttention(nnx.Module):
    """Self-attention with TransformerEngine's te.MultiheadAttention structure; see the module docstring."""

    tp_unit = "attention"  # the kind of unit whose TP mode a placement plan chooses (twinspec.plan)

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        input_layernorm: bool = False,
        params_dtype=jnp.float32,
        kernel_init: Initializer | None = None,
        output_kernel_init: Initializer | None = None,
        config: TransformerConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        owner = "MultiheadAttention"
        config = check_transformer_config(owner, config)
        if not isinstance(input_layernorm, bool):
            raise TypeError(f"{owner}(input_layernorm={input_layernorm!r}): pass True or False")
        self.hidden_size = check_size(owner, "hidden_size", hidden_size)
        heads = check_size(owner, "num_attention_heads", num_attention_heads)
        head_dim = _head_dim(owner, hidden_size, heads, config)
        self.config, self.input_layernorm = config, input_layernorm
        # DotProductAttention checks num_gqa_groups; built first so a bad value fails before any weight.
        self.core_attention = DotProductAttention(
            heads,
            head_dim,
            num_gqa_groups=num_gqa_groups,
            attention_dropout=config.attention_dropout,
            qkv_format=config.qkv_format,
            attn_mask_type=config.attn_mask_type,
            softmax_scale=config.softmax_scale,
            config=config.module_config,
        )
        groups = self.core_attention.num_gqa_groups
        self.split_features = (heads * head_dim, groups * head_dim, groups * head_dim)  # q, k, v
        split = config.attention_tp == "split"  # "replicate": no parameter splits over tp
        column = dataclasses.replace(config.module_config, parallel_mode="column" if split else None)
        row = dataclasses.replace(config.module_config, parallel_mode="row" if split else None)
        common = {"params_dtype": params_dtype, "rngs": rngs}
        projection = {"bias": config.has_qkv_bias, "kernel_init": kernel_init, "kernel_axes": QKV_AXES, **common}
        norm = config.norm_settings()
        norm_args = {"eps": norm.eps, "zero_centered_gamma": norm.zero_centered_gamma}
        if config.fuse_qkv_params and input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size,
                sum(self.split_features),
                normalization=norm.normalization,
                config=column,
                **norm_args,
                **projection,
            )
        elif config.fuse_qkv_params:
            self.qkv = Linear(hidden_size, sum(self.split_features), config=column, **projection)
        else:
            if input_layernorm:
                norm_class = LayerNorm if norm.normalization == "LayerNorm" else RMSNorm
                self.layernorm = norm_class(hidden_size, config=config.module_config, **norm_args, **common)
            self.query = Linear(hidden_size, self.split_features[0], config=column, **projection)
            self.key = Linear(hidden_size, self.split_features[1], config=column, **projection)
            self.value = Linear(hidden_size, self.split_features[2], config=column, **projection)
        self.proj = Linear(
            heads * head_dim,
            hidden_size,
            bias=config.bias,
            kernel_init=output_kernel_init,
            kernel_axes=PROJ_AXES,
            config=row,
            **common,
        )

    def _qkv(self, hidden_states) -> tuple[Array, Array, Array]:
        """q [.., N, H], k and v [.., G, H] with the leading dims of hidden_states."""
        head_dim = self.core_attention.kv_channels
        if self.config.fuse_qkv_params:
            fused = self.layernorm_qkv if self.input_layernorm else self.qkv
            grouped = fused(hidden_states)
            grouped = grouped.reshape(*grouped.shape[:-1], self.core_attention.num_gqa_groups, -1, head_dim)
            q, k, v = (t.reshape(*t.shape[:-3], -1) for t in (grouped[..., :-2, :], grouped[..., -2:-1, :],
                                                              grouped[..., -1:, :]))  # fmt: skip
        else:
            x = self.layernorm(hidden_states) if self.input_layernorm else hidden_states
            q, k, v = self.query(x), self.key(x), self.value(x)
        return tuple(t.reshape(*t.shape[:-1], -1, head_dim) for t in (q, k, v))

    def __call__(
        self,
        hidden_states,
        attention_mask: AttentionMask = None,
        attn_mask_type: str | None = None,
        rotary_pos_emb: RotaryFreqs = None,
    ) -> Array:
        """Attention output, shaped like hidden_states; rotary_pos_emb: freqs, or (query freqs, key freqs)."""
        x = hidden_states
        if not hasattr(x, "shape") or x.ndim != 3 or x.shape[-1] != self.hidden_size:
            got = list(x.shape) if hasattr(x, "shape") else type(x).__name__
            layout = "[S, B, D]" if self.config.qkv_format == "sbhd" else "[B, S, D]"
            raise ValueError(f"MultiheadAttention takes hidden_states {layout} with D={self.hidden_size}, got {got}")
        with batch_dim(1 if self.config.qkv_format == "sbhd" else 0):  # where data parallelism splits the tokens
            q, k, v = self._qkv(hidden_states)
            if rotary_pos_emb is not None:
                q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
                q = apply_rotary_pos_emb(q, q_freqs, self.config.qkv_format)
                k = apply_rotary_pos_emb(k, k_freqs, self.config.qkv_format)
            context = self.core_attention(q, k, v, attention_mask=attention_mask, attn_mask_type=attn_mask_type)
            return self.proj(context)
