"""`MultiheadAttention`: QKV projection, rotary embeddings, DotProductAttention, output projection.

Shape legend: S sequence, B batch, D hidden size, N query heads, G key/value heads, H head dim.
Hidden states are [S, B, D] ("sbhd") or [B, S, D] ("bshd"), as `TransformerConfig.qkv_format` says.

The QKV projection is, by `fuse_qkv_params` and `input_layernorm`:

| fuse_qkv_params | input_layernorm | submodules |
|---|---|---|
| True | True | `layernorm_qkv`: LayerNormLinear D -> (N + 2G) H |
| True | False | `qkv`: Linear D -> (N + 2G) H |
| False | True | `layernorm` (LayerNorm or RMSNorm), then Linears `query`, `key`, `value` |
| False | False | Linears `query` D -> N H, `key` and `value` D -> G H |

The fused weight's rows are grouped by key/value head (TransformerEngine's default
`qkv_weight_interleaved=True` layout, Megatron's too): for each group g of the G, its N/G query
heads, then key head g, then value head g, each H rows; [(N + 2G) H, D] in all. `qkv_from_fused`
and `fused_from_qkv` convert to and from separate [N H, D], [G H, D], [G H, D] weights (or biases,
or outputs along their last dim). With separate weights the norm is its own module, because a
LayerNormLinear cannot hand its normalized input to the other two projections; each projection
casts that input to FP8 itself. The GEMMs of the QKV and output (`proj`) projections run in FP8
inside fp8_autocast; attention runs in the activation dtype (see DotProductAttention).

Tensor parallelism (`config.module_config.tp_size` > 1): the QKV projection is column-parallel and
`proj` row-parallel, so each rank computes the attention of its heads and the only collectives are
those of the two projections (under sequence parallelism: gather the tokens before QKV,
reduce-scatter after proj). Because the fused rows are grouped, a plain Shard(0) gives rank j the
groups j*G/tp .. (j+1)*G/tp - 1 with their query heads, the same heads the separate `query`, `key`
and `value` weights give it. G must divide by tp (ValueError otherwise).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchside.modules.attention import AttentionMask, DotProductAttention
from torchside.modules.base import FP8Module
from torchside.modules.config import check_size
from torchside.modules.layernorm_linear import LayerNormLinear
from torchside.modules.linear import Linear
from torchside.modules.normalization import LayerNorm, RMSNorm
from torchside.modules.rotary import apply_rotary_pos_emb
from torchside.modules.transformer_config import (
    InitMethod,
    TransformerConfig,
    check_layer_parallelism,
    check_transformer_config,
    with_parallel_mode,
)
from torchside.parallel.module_mesh import TensorParallelMixin

RotaryFreqs = Tensor | tuple[Tensor, Tensor] | None


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


def qkv_from_fused(fused: Tensor, groups: int, head_dim: int, dim: int = -1) -> tuple[Tensor, Tensor, Tensor]:
    """(q, k, v) of a fused QKV tensor in the grouped layout along `dim` (module docstring): N H, G H, G H there."""
    grouped = fused.movedim(dim, -1).unflatten(-1, (groups, -1, head_dim))  # [..., G, N/G + 2, H]
    q, k, v = grouped[..., :-2, :].flatten(-3), grouped[..., -2, :].flatten(-2), grouped[..., -1, :].flatten(-2)
    return q.movedim(-1, dim), k.movedim(-1, dim), v.movedim(-1, dim)


def fused_from_qkv(q: Tensor, k: Tensor, v: Tensor, groups: int, head_dim: int, dim: int = -1) -> Tensor:
    """The fused QKV tensor in the grouped layout of q (N H along `dim`), k and v (G H along `dim`)."""
    q, k, v = (t.movedim(dim, -1).unflatten(-1, (groups, -1, head_dim)) for t in (q, k, v))
    return torch.cat([q, k, v], dim=-2).flatten(-3).movedim(-1, dim)


def reset_fp8_submodules(module: nn.Module) -> None:
    """reset_parameters() of every FP8 submodule (after building on meta and `to_empty`)."""
    for child in module.modules():
        if isinstance(child, FP8Module):
            child.reset_parameters()


class MultiheadAttention(TensorParallelMixin, nn.Module):
    """Self-attention with TransformerEngine's te.MultiheadAttention structure; see the module docstring."""

    tp_unit = "attention"  # the kind of unit whose TP mode a placement plan chooses (twinspec.plan)

    def __init__(
        self,
        hidden_size: int,
        num_attention_heads: int,
        *,
        num_gqa_groups: int | None = None,
        input_layernorm: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method: InitMethod | None = None,
        output_layer_init_method: InitMethod | None = None,
        config: TransformerConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        super().__init__()
        owner = "MultiheadAttention"
        config = check_transformer_config(owner, config)
        if not isinstance(input_layernorm, bool):
            raise TypeError(f"{owner}(input_layernorm={input_layernorm!r}): pass True or False")
        module_config = check_layer_parallelism(owner, config.module_config)
        self._init_tensor_parallel(module_config)
        self.hidden_size = check_size(owner, "hidden_size", hidden_size)
        heads = check_size(owner, "num_attention_heads", num_attention_heads)
        head_dim = _head_dim(owner, hidden_size, heads, config)
        self.config, self.input_layernorm = config, input_layernorm
        # DotProductAttention checks num_gqa_groups (and its split over TP); built first so a bad
        # value fails before any weight.
        split = config.attention_tp == "split"  # "replicate": every TP rank attends with all heads
        self.core_attention = DotProductAttention(
            heads,
            head_dim,
            num_gqa_groups=num_gqa_groups,
            attention_dropout=config.attention_dropout,
            qkv_format=config.qkv_format,
            attn_mask_type=config.attn_mask_type,
            softmax_scale=config.softmax_scale,
            config=module_config if split else dataclasses.replace(module_config, tp_size=1, tp_group=None),
        )
        groups = self.core_attention.num_gqa_groups
        q_features, kv_features = heads * head_dim, groups * head_dim
        self._set_own_device_mesh(tp_mesh, weight_mesh)  # checks the meshes before any weight is built
        # The children get the meshes at construction: FP8 weights are cast with their amax group.
        common = {"params_dtype": params_dtype, "device": device, "tp_mesh": tp_mesh, "weight_mesh": weight_mesh}
        column = {"config": with_parallel_mode(module_config, "column" if split else None), **common}
        projection = {"bias": config.has_qkv_bias, "init_method": init_method, **column}
        norm = config.norm_settings()
        norm_args = {"eps": norm.eps, "zero_centered_gamma": norm.zero_centered_gamma}
        if config.fuse_qkv_params and input_layernorm:
            self.layernorm_qkv = LayerNormLinear(
                hidden_size, q_features + 2 * kv_features, normalization=norm.normalization, **norm_args, **projection
            )
        elif config.fuse_qkv_params:
            self.qkv = Linear(hidden_size, q_features + 2 * kv_features, **projection)
        else:
            if input_layernorm:
                norm_class = LayerNorm if norm.normalization == "LayerNorm" else RMSNorm
                self.layernorm = norm_class(hidden_size, **norm_args, config=module_config, **common)
            self.query = Linear(hidden_size, q_features, **projection)
            self.key = Linear(hidden_size, kv_features, **projection)
            self.value = Linear(hidden_size, kv_features, **projection)
        row = with_parallel_mode(module_config, "row" if split else None)
        self.proj = Linear(
            q_features, hidden_size, bias=config.bias, init_method=output_layer_init_method, config=row, **common
        )

    def reset_parameters(self) -> None:
        """Fill every parameter again (after building on meta: call `to_empty(device=...)` first)."""
        reset_fp8_submodules(self)

    def split_qkv(self, fused: Tensor, dim: int = -1) -> tuple[Tensor, Tensor, Tensor]:
        """(q, k, v) of this rank's fused QKV output (or weight, bias: dim=0), by `qkv_from_fused`."""
        attention = self.core_attention
        return qkv_from_fused(fused, attention.groups_per_rank, attention.kv_channels, dim)

    def _qkv(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [.., N, H], k and v [.., G, H] (this rank's heads) with the leading dims of hidden_states."""
        if self.config.fuse_qkv_params:
            fused = self.layernorm_qkv if self.input_layernorm else self.qkv
            q, k, v = self.split_qkv(fused(hidden_states))
        else:
            x = self.layernorm(hidden_states) if self.input_layernorm else hidden_states
            q, k, v = self.query(x), self.key(x), self.value(x)
        head_dim = self.core_attention.kv_channels
        return tuple(t.unflatten(-1, (-1, head_dim)) for t in (q, k, v))

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: AttentionMask = None,
        attn_mask_type: str | None = None,
        rotary_pos_emb: RotaryFreqs = None,
    ) -> Tensor:
        """Attention output, shaped like hidden_states; rotary_pos_emb: freqs, or (query freqs, key freqs)."""
        x = hidden_states
        if not isinstance(x, Tensor) or x.dim() != 3 or x.shape[-1] != self.hidden_size:
            got = list(x.shape) if isinstance(x, Tensor) else type(x).__name__
            layout = "[S, B, D]" if self.config.qkv_format == "sbhd" else "[B, S, D]"
            raise ValueError(f"MultiheadAttention takes hidden_states {layout} with D={self.hidden_size}, got {got}")
        q, k, v = self._qkv(hidden_states)
        if rotary_pos_emb is not None:
            q_freqs, k_freqs = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
            q = apply_rotary_pos_emb(q, q_freqs, self.config.qkv_format)
            k = apply_rotary_pos_emb(k, k_freqs, self.config.qkv_format)
        context = self.core_attention(q, k, v, attention_mask=attention_mask, attn_mask_type=attn_mask_type)
        return self.proj(context)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, input_layernorm={self.input_layernorm}, "
            f"fuse_qkv_params={self.config.fuse_qkv_params}, tp_size={self.tp_size}"
        )


__all__ = ["MultiheadAttention", "RotaryFreqs", "fused_from_qkv", "qkv_from_fused", "reset_fp8_submodules"]
