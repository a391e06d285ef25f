"""Float64 references for attention and rotary embeddings (torch), written independently of torchside.

`attention64` is the definition: scores = q k^T * scale over the kept (query, key) pairs, softmax
over each row's kept keys, times v; key/value head g serves query heads g*N/G .. (g+1)*N/G - 1; a
row with no kept key is zero. The rotary reference multiplies each channel pair by e^(i * angle) as a
complex number.
"""

from __future__ import annotations

import math

import torch


def attention64(q, k, v, keep, scale: float, qkv_format: str):
    """Float64 attention on [S, B, heads, H] ("sbhd") or [B, S, heads, H] tensors; keep [B or 1, N or 1, Sq, Skv]."""
    if qkv_format == "sbhd":
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # -> [B, S, heads, H]
    heads, groups = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // groups, dim=2)
    v = v.repeat_interleave(heads // groups, dim=2)
    scores = torch.einsum("bqnh,bknh->bnqk", q, k) * scale
    has_key = keep.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~(keep | ~has_key), -math.inf)  # an empty row: any finite softmax, zeroed below
    out = torch.einsum("bnqk,bknh->bqnh", torch.softmax(scores, dim=-1), v) * has_key.transpose(1, 2)
    out = out.flatten(2)
    return out.transpose(0, 1) if qkv_format == "sbhd" else out


def causal_keep(seq_q: int, seq_kv: int) -> torch.Tensor:
    """[1, 1, Sq, Skv]: query i keeps keys j <= i."""
    return (torch.arange(seq_kv)[None, :] <= torch.arange(seq_q)[:, None])[None, None]


def rotate64(x_SBNH, angles_SR2):
    """Channel pairs (i, i + R/2) of [S, ..., H] as complex numbers times e^(i * angle[s, i]), in float64."""
    half = angles_SR2.shape[-1]
    turn = torch.polar(torch.ones_like(angles_SR2), angles_SR2)
    turn = turn.reshape(angles_SR2.shape[0], *[1] * (x_SBNH.dim() - 2), half)
    pairs = torch.complex(x_SBNH[..., :half].double(), x_SBNH[..., half : 2 * half].double()) * turn
    return torch.cat([pairs.real, pairs.imag, x_SBNH[..., 2 * half :].double()], dim=-1)
