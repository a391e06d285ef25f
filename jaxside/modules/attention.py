"""`DotProductAttention`: softmax(q k^T * scale + mask) v, torchside.modules.attention's twin.

Shape legend: B batch, Sq query length, Skv key/value length, N query heads, G key/value heads
(N for multi-head, 1 for MQA, a divisor of N for GQA; key/value head g serves query heads
g*N/G .. (g+1)*N/G - 1), R = N/G, H head dim.
`qkv_format` "sbhd": q [Sq, B, N, H], k and v [Skv, B, G, H], output [Sq, B, N*H];
"bshd": q [B, Sq, N, H], k and v [B, Skv, G, H], output [B, Sq, N*H].

No FP8 and no variables. As torchside's, the kernel depends on the device: on a CUDA GPU, bf16 or fp16
inputs with "no_mask" or "causal" self-attention run cuDNN's fused flash attention (torch's SDPA picks
flash attention there; both keep fp32 accumulators and round the probabilities to the input dtype for
the second product); otherwise the math runs in fp32 from inputs in the activation dtype (both products
with fp32 accumulation: q k^T of 16-bit inputs on the tensor cores, whose products are exact in fp32,
p v of the fp32 probabilities at HIGHEST precision; the softmax in fp32) and the output is rounded once
to q's dtype. Masks (`attn_mask_type`) follow TransformerEngine's convention, True = masked out:

- "no_mask"; "causal": query i sees keys 0..i (top-left aligned);
- "padding", "padding_causal": `attention_mask` is [B, 1, 1, S] (self-attention, Sq == Skv) or a
  tuple (q_mask [B, 1, 1, Sq], kv_mask [B, 1, 1, Skv]);
- "arbitrary": a bool mask that broadcasts to [B, N, Sq, Skv].

An output row with no key left to attend to is zero, as in torchside. Dropout is not implemented
(jaxside.modules.transformer_config says why): `attention_dropout` must be 0.0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array, lax

from jaxside.modules.config import ModuleConfig, check_config, check_size
from jaxside.modules.functions import exact_product_precision
from jaxside.modules.transformer_config import (
    MASK_TYPES,
    QKV_FORMATS,
    check_choice,
    check_no_dropout,
    check_softmax_scale,
)

AttentionMask = Array | tuple[Array, Array] | None


def _to_bnsh(x, qkv_format: str) -> Array:
    return x.transpose(1, 2, 0, 3) if qkv_format == "sbhd" else x.transpose(0, 2, 1, 3)


def _from_bnsh(out_BNSH, qkv_format: str) -> Array:
    moved = out_BNSH.transpose((2, 0, 1, 3) if qkv_format == "sbhd" else (0, 2, 1, 3))  # [S, B, N, H] or [B, S, N, H]
    return moved.reshape(*moved.shape[:2], -1)


def _check_bool_mask(name: str, mask: object, shape: tuple[int, ...] | None = None) -> Array:
    if not hasattr(mask, "dtype") or mask.dtype != jnp.bool_:
        got = mask.dtype if hasattr(mask, "dtype") else type(mask).__name__
        raise TypeError(f"{name} must be a bool array (True = masked out), got {got}; pass mask.astype(bool)")
    if shape is not None and tuple(mask.shape) != shape:
        raise ValueError(f"{name} must have shape {list(shape)} (True = padding), got {list(mask.shape)}")
    return mask


def _padding_keep_mask(attention_mask: AttentionMask, batch: int, seq_q: int, seq_kv: int) -> Array:
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
    return ~jnp.swapaxes(q_mask, -1, -2) & ~kv_mask


def _keep_mask(mask_type: str, attention_mask: AttentionMask, shape_BNSS: tuple[int, int, int, int]) -> Array | None:
    """True = attend, broadcasting to [B, N, Sq, Skv]; None for "no_mask"."""
    batch, _, seq_q, seq_kv = shape_BNSS
    causal = jnp.tril(jnp.ones((seq_q, seq_kv), jnp.bool_))
    if mask_type in ("no_mask", "causal"):
        if attention_mask is not None:
            raise ValueError(
                f"attn_mask_type={mask_type!r} takes no attention_mask; use 'padding', 'padding_causal' or "
                "'arbitrary' to pass one"
            )
        return causal if mask_type == "causal" else None
    if attention_mask is None:
        raise ValueError(f"attn_mask_type={mask_type!r} needs an attention_mask (True = masked out)")
    if mask_type == "arbitrary":
        mask = _check_bool_mask("attention_mask", attention_mask)
        try:
            fits = np.broadcast_shapes(mask.shape, shape_BNSS) == shape_BNSS
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"an 'arbitrary' attention_mask must broadcast to [B, N, Sq, Skv] = {list(shape_BNSS)}, "
                f"got {list(mask.shape)}"
            )
        return ~mask
    keep = _padding_keep_mask(attention_mask, batch, seq_q, seq_kv)
    return keep & causal if mask_type == "padding_causal" else keep


class DotProductAttention(nnx.Module):
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
        owner = "DotProductAttention"
        self.config = check_config(owner, config)
        self.num_attention_heads = check_size(owner, "num_attention_heads", num_attention_heads)
        self.kv_channels = check_size(owner, "kv_channels", kv_channels)
        groups = num_attention_heads if num_gqa_groups is None else check_size(owner, "num_gqa_groups", num_gqa_groups)
        if num_attention_heads % groups:
            raise ValueError(
                f"{owner}(num_gqa_groups={groups}) must divide num_attention_heads={num_attention_heads} "
                "(each key/value head serves the same number of query heads)"
            )
        self.num_gqa_groups = groups
        self.attention_dropout = check_no_dropout(owner, "attention_dropout", attention_dropout)
        self.qkv_format = check_choice(owner, "qkv_format", qkv_format, QKV_FORMATS)
        self.attn_mask_type = check_choice(owner, "attn_mask_type", attn_mask_type, MASK_TYPES)
        self.softmax_scale = check_softmax_scale(owner, softmax_scale)

    def _check_qkv(self, query, key, value) -> None:
        layout = "[S, B, heads, H]" if self.qkv_format == "sbhd" else "[B, S, heads, H]"
        batch_dim = 1 if self.qkv_format == "sbhd" else 0
        for name, t, heads in (("query", query, self.num_attention_heads), ("key", key, self.num_gqa_groups),
                               ("value", value, self.num_gqa_groups)):  # fmt: skip
            if not hasattr(t, "shape") or t.ndim != 4 or tuple(t.shape[2:]) != (heads, self.kv_channels):
                got = list(t.shape) if hasattr(t, "shape") else type(t).__name__
                raise ValueError(
                    f"{name} must be {layout} with {heads} heads of {self.kv_channels} (qkv_format="
                    f"{self.qkv_format!r}), got {got}"
                )
        if key.shape != value.shape or key.shape[batch_dim] != query.shape[batch_dim]:
            raise ValueError(
                f"key {list(key.shape)} and value {list(value.shape)} must match, with query "
                f"{list(query.shape)}'s batch size (qkv_format={self.qkv_format!r})"
            )

    def __call__(self, query, key, value, attention_mask: AttentionMask = None, attn_mask_type: str | None = None):
        """Output [Sq, B, N*H] ("sbhd") or [B, Sq, N*H] ("bshd"); attn_mask_type overrides the constructor's."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        check_choice("DotProductAttention", "attn_mask_type", mask_type, MASK_TYPES)
        self._check_qkv(query, key, value)
        if _runs_fused(query, key, mask_type):
            return self._fused(query, key, value, causal=mask_type == "causal")
        # q and k keep their dtype (16-bit products are exact in fp32); v meets the fp32 probabilities.
        q_BNSH, k_BGSH, v_BGSH = (_to_bnsh(t, self.qkv_format) for t in (query, key, value.astype(jnp.float32)))
        batch, heads, seq_q, head_dim = q_BNSH.shape
        groups, seq_kv = self.num_gqa_groups, k_BGSH.shape[2]
        q_BGRSH = q_BNSH.reshape(batch, groups, heads // groups, seq_q, head_dim)
        scale = self.softmax_scale if self.softmax_scale is not None else head_dim**-0.5
        scores_BGRQK = jnp.einsum(
            "bgrqh,bgkh->bgrqk",
            q_BGRSH,
            k_BGSH,
            precision=exact_product_precision(q_BGRSH, k_BGSH),
            preferred_element_type=jnp.float32,
        ) * jnp.float32(scale)
        scores_BNQK = scores_BGRQK.reshape(batch, heads, seq_q, seq_kv)
        keep = _keep_mask(mask_type, attention_mask, (batch, heads, seq_q, seq_kv))
        has_key = None
        if keep is not None:  # a row with no key left attends to every key, then is zeroed (module docstring)
            has_key = jnp.any(keep, axis=-1, keepdims=True)
            scores_BNQK = jnp.where(keep | ~has_key, scores_BNQK, -jnp.inf)
        probs_BNQK = jax.nn.softmax(scores_BNQK, axis=-1)
        out_BGRSH = jnp.einsum(
            "bgrqk,bgkh->bgrqh",
            probs_BNQK.reshape(batch, groups, heads // groups, seq_q, seq_kv),
            v_BGSH,
            precision=lax.Precision.HIGHEST,
            preferred_element_type=jnp.float32,
        )
        out_BNSH = out_BGRSH.reshape(batch, heads, seq_q, head_dim)
        if has_key is not None:
            out_BNSH = jnp.where(has_key, out_BNSH, 0.0)
        return _from_bnsh(out_BNSH, self.qkv_format).astype(query.dtype)

    def _fused(self, query, key, value, *, causal: bool) -> Array:
        """cuDNN's flash attention (module docstring); it takes [B, S, heads, H] and handles GQA itself."""
        to_bshd = (lambda t: t.transpose(1, 0, 2, 3)) if self.qkv_format == "sbhd" else (lambda t: t)
        out_BSNH = jax.nn.dot_product_attention(
            to_bshd(query), to_bshd(key), to_bshd(value), scale=self.softmax_scale, is_causal=causal,
            implementation="cudnn",
        )  # fmt: skip
        out = to_bshd(out_BSNH)
        return out.reshape(*out.shape[:2], -1)


def _runs_fused(query, key, mask_type: str) -> bool:
    """Whether cuDNN's fused attention applies: a CUDA backend, 16-bit inputs, no mask tensor, the same
    length of queries and keys (causal is then top-left aligned in both conventions), head dim a multiple
    of 8 up to 128. The backend is JAX's default one, where this computation is placed."""
    return (
        jax.default_backend() == "gpu"
        and query.dtype in (jnp.bfloat16, jnp.float16)
        and mask_type in ("no_mask", "causal")
        and query.shape[:2] == key.shape[:2]
        and query.shape[-1] % 8 == 0
        and query.shape[-1] <= 128
    )
