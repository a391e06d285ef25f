"""Float64 numpy references for attention and rotary embeddings (JAX tests), independent of jaxside.

`attention64` is the definition: scores = q k^T * scale over the kept (query, key) pairs, softmax
over each row's kept keys, times v; key/value head g serves query heads g*N/G .. (g+1)*N/G - 1 (the
float64 model repeats k and v per head and sums their gradients back); a row with no kept key is
zero. Its backward is the textbook one (dS = P * (dP - rowsum(dP * P))). The rotary reference
multiplies each channel pair by e^(i * angle) as a complex number; its backward by e^(-i * angle).
"""

from __future__ import annotations

import numpy as np


def attention64(q, k, v, keep, scale: float):
    """(out [B, Sq, N*H], backward) on float64 [B, S, heads, H] arrays; keep broadcasts to [B, N, Sq, Skv]."""
    repeats = q.shape[2] // k.shape[2]
    k_full, v_full = np.repeat(k, repeats, axis=2), np.repeat(v, repeats, axis=2)
    keep = np.broadcast_to(keep, (q.shape[0], q.shape[2], q.shape[1], k.shape[1]))
    has_key = keep.any(-1, keepdims=True)
    scores = np.einsum("bqnh,bknh->bnqk", q, k_full) * scale
    scores = np.where(keep | ~has_key, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs = probs / probs.sum(-1, keepdims=True)
    row_kept = has_key.transpose(0, 2, 1, 3)  # [B, Sq, N, 1]
    out = np.einsum("bnqk,bknh->bqnh", probs, v_full) * row_kept

    def fold(grad_full):  # the gradient of a repeated k or v, summed over the query heads of its group
        return grad_full.reshape(*grad_full.shape[:2], k.shape[2], repeats, -1).sum(3)

    def backward(dout):
        dout = dout.reshape(out.shape) * row_kept
        dprobs = np.einsum("bqnh,bknh->bnqk", dout, v_full)
        dscores = probs * (dprobs - (dprobs * probs).sum(-1, keepdims=True)) * scale
        dq = np.einsum("bnqk,bknh->bqnh", dscores, k_full)
        dk = fold(np.einsum("bnqk,bqnh->bknh", dscores, q))
        dv = fold(np.einsum("bnqk,bqnh->bknh", probs, dout))
        return dq, dk, dv

    return out.reshape(*out.shape[:2], -1), backward


def rotate64(t, angles, tensor_format: str = "sbhd"):
    """(rotated t, backward): channel pairs (i, i + R/2) times e^(i * angle); angles [S, R/2] in float64."""
    half = angles.shape[-1]
    shape = (len(angles), 1, 1, half) if tensor_format == "sbhd" else (1, len(angles), 1, half)
    turn = np.exp(1j * angles.reshape(shape))

    def rotate(x, turn):
        pairs = (x[..., :half] + 1j * x[..., half : 2 * half]) * turn
        return np.concatenate([pairs.real, pairs.imag, x[..., 2 * half :]], axis=-1)

    return rotate(t, turn), lambda dt: rotate(dt, np.conj(turn))


def causal_keep(seq_q: int, seq_kv: int) -> np.ndarray:
    return (np.arange(seq_kv)[None, :] <= np.arange(seq_q)[:, None])[None, None]
