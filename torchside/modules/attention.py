"""`DotProductAttention`: softmax(q k^T * scale + mask) v through torch's scaled_dot_product_attention.

Shape legend: B batch, Sq query length, Skv key/value length, N query heads, G key/value heads
(groups: N for plain multi-head, 1 for MQA, a divisor of N for GQA), H head dim.
`qkv_format` "sbhd": q [Sq, B, N, H], k and v [Skv, B, G, H], output [Sq, B, N*H];
"bshd": q [B, Sq, N, H], k and v [B, Skv, G, H], output [B, Sq, N*H].

No FP8 here: attention runs in the dtype of q, k and v, in whichever SDPA kernel torch picks (on
CUDA, flash attention for "no_mask" and "causal"; a mask tensor rules flash out). The FP8 GEMMs of
an attention block are its QKV and output projections (`MultiheadAttention`), which run inside
fp8_autocast like every other Linear.

Masks (`attn_mask_type`), with TransformerEngine's convention that True marks a position that
is masked out:

- "no_mask"; "causal": query i sees keys 0..i (top-left aligned, as SDPA's is_causal);
- "padding", "padding_causal": `attention_mask` is [B, 1, 1, S] (self-attention, Sq == Skv) or a
  tuple (q_mask [B, 1, 1, Sq], kv_mask [B, 1, 1, Skv]); padded keys are never attended to;
- "arbitrary": a bool mask that broadcasts to [B, N, Sq, Skv].

Tensor parallelism (`config.tp_size` > 1): heads are split, so this rank attends with its
N/tp query heads and G/tp key/value heads (the heads of its QKV projection's shard; query head n
reads key/value head n // (N/G), so each rank keeps whole groups); q, k and v above then hold
N/tp and G/tp heads, the output N/tp * H features. There is nothing to communicate: attention
always sees the whole sequence (under sequence parallelism the QKV projection gathered it).

An output row with no key left to attend to (a padded query, a fully masked row) is zero, on every
backend (SDPA's own result for such rows differs between kernels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchside.modules.config import ModuleConfig, check_size
from torchside.modules.transformer_config import (
    MASK_TYPES,
    QKV_FORMATS,
    check_choice,
    check_probability,
    check_layer_parallelism,
    check_softmax_scale,
)

AttentionMask = Tensor | tuple[Tensor, Tensor] | None


def _to_bnsh(x: Tensor, qkv_format: str) -> Tensor:
    """[S, B, N, H] or [B, S, N, H] as the [B, N, S, H] view SDPA takes."""
    return x.permute(1, 2, 0, 3) if qkv_format == "sbhd" else x.transpose(1, 2)


def _from_bnsh(out_BNSH: Tensor, qkv_format: str) -> Tensor:
    """SDPA's [B, N, Sq, H] output as [Sq, B, N*H] or [B, Sq, N*H]."""
    batch, heads, seq, head_dim = out_BNSH.shape
    if qkv_format == "sbhd":
        return out_BNSH.permute(2, 0, 1, 3).reshape(seq, batch, heads * head_dim)
    return out_BNSH.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def _check_bool_mask(name: str, mask: object, shape: tuple[int, ...] | None = None) -> Tensor:
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"{name} must be a bool tensor (True = masked out), got {got}; pass mask.bool()")
    if shape is not None and tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (True = padding), got {list(mask.shape)}")
    return mask


def _padding_keep_mask(attention_mask: AttentionMask, batch: int, seq_q: int, seq_kv: int) -> Tensor:
    """[B, 1, Sq, Skv] True where query and key are both real tokens."""
    if isinstance(attention_mask, tuple) and len(attention_mask) == 2:
        q_mask = _check_bool_mask("attention_mask[0] (queries)", attention_mask[0], (batch, 1, 1, seq_q))
        kv_mask = _check_bool_mask("attention_mask[1] (keys)", attention_mask[1], (batch, 1, 1, seq_kv))
    elif seq_q == seq_kv:
        q_mask = kv_mask = _check_bool_mask("attention_mask", attention_mask, (batch, 1, 1, seq_kv))
    else:
        raise ValueError(
            f"padding masks with Sq={seq_q} != Skv={seq_kv} need a tuple (q_mask [B, 1, 1, Sq], "
            f"kv_mask [B, 1, 1, Skv]), got {type(attention_mask).__name__}"
        )
    return (~q_mask).transpose(-1, -2) & ~kv_mask


def _keep_mask(mask_type: str, attention_mask: AttentionMask, shape_BNSS: tuple[int, int, int, int]) -> Tensor | None:
    """The bool mask SDPA takes (True = attend), or None for "no_mask" and "causal" (is_causal does those)."""
    batch, heads, seq_q, seq_kv = shape_BNSS
    if mask_type in ("no_mask", "causal"):
        if attention_mask is not None:
            raise ValueError(
                f"attn_mask_type={mask_type!r} takes no attention_mask; use 'padding', 'padding_causal' or "
                "'arbitrary' to pass one"
            )
        return None
    if attention_mask is None:
        raise ValueError(f"attn_mask_type={mask_type!r} needs an attention_mask (True = masked out)")
    if mask_type == "arbitrary":
        mask = _check_bool_mask("attention_mask", attention_mask)
        try:
            fits = torch.broadcast_shapes(mask.shape, shape_BNSS) == shape_BNSS
        except RuntimeError:
            fits = False
        if not fits:
            raise ValueError(
                f"an 'arbitrary' attention_mask must broadcast to [B, N, Sq, Skv] = {list(shape_BNSS)}, "
                f"got {list(mask.shape)}"
            )
        return ~mask
    keep = _padding_keep_mask(attention_mask, batch, seq_q, seq_kv)
    if mask_type == "padding_causal":
        keep = keep & torch.ones(seq_q, seq_kv, dtype=torch.bool, device=keep.device).tril()
    return keep


class DotProductAttention(nn.Module):
    """Scaled dot-product attention with te.DotProductAttention's arguments; see the module docstring."""

    def __init__(
        self,
        num_attention_heads: int,
        kv_channels: int,
        *,
        num_gqa_groups: int | None = None,
        attention_dropout: float = 0.0,
        qkv_format: str = "sbhd",
        attn_mask_type: str = "causal",
        softmax_scale: float | None = None,
        config: ModuleConfig | None = None,
    ) -> None:
        super().__init__()
        owner = "DotProductAttention"
        self.config = check_layer_parallelism(owner, ModuleConfig() if config is None else config)
        self.num_attention_heads = check_size(owner, "num_attention_heads", num_attention_heads)
        self.kv_channels = check_size(owner, "kv_channels", kv_channels)
        groups = num_attention_heads if num_gqa_groups is None else check_size(owner, "num_gqa_groups", num_gqa_groups)
        if num_attention_heads % groups:
            raise ValueError(
                f"{owner}(num_gqa_groups={groups}) must divide num_attention_heads={num_attention_heads} "
                "(each key/value head serves the same number of query heads)"
            )
        tp_size = self.config.tp_size
        if groups % tp_size:  # then heads divide too: groups divides heads
            raise ValueError(
                f"{owner}: num_gqa_groups={groups} (key/value heads) does not divide by tp_size={tp_size}, and each "
                f"TP rank must hold whole groups: choose num_gqa_groups (and num_attention_heads) a multiple of "
                f"{tp_size}, or a smaller tp_size"
            )
        self.num_gqa_groups = groups
        self.heads_per_rank, self.groups_per_rank = num_attention_heads // tp_size, groups // tp_size
        self.attention_dropout = check_probability(owner, "attention_dropout", attention_dropout)
        self.qkv_format = check_choice(owner, "qkv_format", qkv_format, QKV_FORMATS)
        self.attn_mask_type = check_choice(owner, "attn_mask_type", attn_mask_type, MASK_TYPES)
        self.softmax_scale = check_softmax_scale(owner, softmax_scale)

    def _check_qkv(self, query: Tensor, key: Tensor, value: Tensor) -> None:
        layout = "[S, B, heads, H]" if self.qkv_format == "sbhd" else "[B, S, heads, H]"
        batch_dim = 1 if self.qkv_format == "sbhd" else 0
        for name, t, heads in (("query", query, self.heads_per_rank), ("key", key, self.groups_per_rank),
                               ("value", value, self.groups_per_rank)):  # fmt: skip
            if not isinstance(t, Tensor) or t.dim() != 4 or t.shape[2:] != (heads, self.kv_channels):
                got = list(t.shape) if isinstance(t, Tensor) else type(t).__name__
                raise ValueError(
                    f"{name} must be {layout} with {heads} heads of {self.kv_channels} (qkv_format="
                    f"{self.qkv_format!r}), got {got}"
                )
        if key.shape != value.shape or key.shape[batch_dim] != query.shape[batch_dim]:
            raise ValueError(
                f"key {list(key.shape)} and value {list(value.shape)} must match, with query "
                f"{list(query.shape)}'s batch size (qkv_format={self.qkv_format!r})"
            )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: AttentionMask = None,
        attn_mask_type: str | None = None,
    ) -> Tensor:
        """Output [Sq, B, N*H] ("sbhd") or [B, Sq, N*H] ("bshd"); attn_mask_type overrides the constructor's."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        check_choice("DotProductAttention.forward", "attn_mask_type", mask_type, MASK_TYPES)
        self._check_qkv(query, key, value)
        q_BNSH, k_BGSH, v_BGSH = (_to_bnsh(t, self.qkv_format) for t in (query, key, value))
        shape_BNSS = (q_BNSH.shape[0], self.heads_per_rank, q_BNSH.shape[2], k_BGSH.shape[2])
        keep = _keep_mask(mask_type, attention_mask, shape_BNSS)
        empty_rows = None
        if keep is not None:
            # A row with nothing to attend to would be NaN or backend-dependent: let it attend to
            # everything, then zero it.
            empty_rows = ~keep.any(dim=-1, keepdim=True)
            keep = keep | empty_rows
        out_BNSH = F.scaled_dot_product_attention(
            q_BNSH,
            k_BGSH,
            v_BGSH,
            attn_mask=keep,
            dropout_p=self.attention_dropout if self.training else 0.0,
            is_causal=mask_type == "causal",
            scale=self.softmax_scale,
            enable_gqa=self.groups_per_rank != self.heads_per_rank,
        )
        if empty_rows is not None:
            out_BNSH = out_BNSH.masked_fill(empty_rows, 0.0)
        return _from_bnsh(out_BNSH, self.qkv_format)

    def extra_repr(self) -> str:
        return (
            f"num_attention_heads={self.num_attention_heads}, kv_channels={self.kv_channels}, "
            f"num_gqa_groups={self.num_gqa_groups}, qkv_format={self.qkv_format}, "
            f"attn_mask_type={self.attn_mask_type}, attention_dropout={self.attention_dropout}, "
            f"tp_size={self.config.tp_size}"
        )


__all__ = ["AttentionMask", "DotProductAttention"]
