"""jaxside DotProductAttention and rotary embeddings against float64 numpy references, forward and backward.

The references (forward and backward) are in attention64.py. Masks are built here from sequence
lengths and index arithmetic, not from the module's helpers.

Tolerances, as ||module - float64|| / ||float64||: fp32 2^-18 (sums of at most 16 products and an
exp, each within a few 2^-24 of their size); bf16 2^-8 (inputs exact in bf16; the module computes in
fp32 and rounds the output once, 2^-9, and autodiff rounds dq, dk, dv once each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from bridge.numerics import relative_error
from jaxside.modules import DotProductAttention, RotaryPositionEmbedding, apply_rotary_pos_emb
from tests.jaxside.attention64 import attention64, causal_keep, rotate64

TOLERANCE = {np.dtype(np.float32): 2**-18, np.dtype(ml_dtypes.bfloat16): 2**-8}
BATCH, SEQ, HEAD_DIM, HEADS = 3, 12, 8, 4
LENGTHS = (12, 7, 1)  # real tokens per sequence; the rest is padding at the end
GROUPS = {"mha": 4, "gqa": 2, "mqa": 1}


def _valid(lengths) -> np.ndarray:
    return np.arange(SEQ)[None, :] < np.asarray(lengths)[:, None]  # [B, S]


def _masks(mask_type: str, rng) -> tuple:
    """(attention_mask for the module, keep [.., Sq, Skv] for the float64 model), built independently."""
    valid = _valid(LENGTHS)
    padding = ~valid[:, None, None, :]  # [B, 1, 1, S], True = padding
    both_real = valid[:, None, :, None] & valid[:, None, None, :]
    if mask_type == "no_mask":
        return None, np.ones((1, 1, SEQ, SEQ), bool)
    if mask_type == "causal":
        return None, causal_keep(SEQ, SEQ)
    if mask_type == "padding":
        return jnp.asarray(padding), both_real
    if mask_type == "padding_causal":
        return jnp.asarray(padding), both_real & causal_keep(SEQ, SEQ)
    masked = rng.random((BATCH, HEADS, SEQ, SEQ)) < 0.3
    masked[0, 0, 3] = True  # one row with nothing to attend to
    return jnp.asarray(masked), ~masked


def _relative_error(got, want) -> float:
    assert np.isfinite(np.asarray(got, np.float64)).all(), "NaN or inf in the module's result"
    return relative_error(got, want)


def check_attention(mask_type: str, groups: int, qkv_format: str, dtype) -> None:
    rng = np.random.default_rng(0)
    dtype = np.dtype(dtype)
    mask, keep = _masks(mask_type, rng)
    q, k, v = (rng.standard_normal((BATCH, SEQ, heads, HEAD_DIM)).astype(dtype) for heads in (HEADS, groups, groups))
    dout = rng.standard_normal((BATCH, SEQ, HEADS * HEAD_DIM)).astype(dtype)
    module = DotProductAttention(HEADS, HEAD_DIM, num_gqa_groups=groups, qkv_format=qkv_format, attn_mask_type=mask_type)

    def layout(t):  # the float64 model works on [B, S, ...]
        return jnp.asarray(t.swapaxes(0, 1) if qkv_format == "sbhd" else t)

    out, vjp = jax.vjp(lambda q, k, v: module(q, k, v, attention_mask=mask), *map(layout, (q, k, v)))
    grads = vjp(layout(dout))
    f64 = [t.astype(np.float64) for t in (q, k, v)]
    out64, backward64 = attention64(*f64, keep, HEAD_DIM**-0.5)
    grads64 = backward64(dout.astype(np.float64))
    errors = {"out": _relative_error(np.asarray(out).swapaxes(0, 1) if qkv_format == "sbhd" else out, out64)}
    for name, grad, grad64 in zip(("dq", "dk", "dv"), grads, grads64):
        errors[name] = _relative_error(np.asarray(grad).swapaxes(0, 1) if qkv_format == "sbhd" else grad, grad64)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    failed = {name: f"{e:.1e}" for name, e in errors.items() if not e <= TOLERANCE[dtype]}
    assert not failed, f"{mask_type}/{groups} groups/{qkv_format}/{dtype}: {failed}"


@pytest.mark.parametrize("mask_type", ["no_mask", "causal", "padding", "padding_causal", "arbitrary"])
@pytest.mark.parametrize("head_case", GROUPS)
def test_fp32_matches_float64(mask_type, head_case):
    check_attention(mask_type, GROUPS[head_case], "sbhd" if mask_type != "padding" else "bshd", np.float32)


@pytest.mark.parametrize("mask_type", ["causal", "padding_causal"])
def test_bf16_matches_float64(mask_type):
    check_attention(mask_type, GROUPS["gqa"], "bshd", ml_dtypes.bfloat16)


def test_padded_queries_give_zero_rows_and_softmax_scale_is_used():
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((1, SEQ, 2, HEAD_DIM)), jnp.float32) for _ in range(3))
    valid = _valid((5,))
    padding = jnp.asarray(~valid[:, None, None, :])
    module = DotProductAttention(2, HEAD_DIM, qkv_format="bshd", attn_mask_type="padding", softmax_scale=0.7)
    out = np.asarray(module(q, k, v, attention_mask=padding))
    assert not out[0, 5:].any() and out[0, :5].all()
    keep = valid[:, None, :, None] & valid[:, None, None, :]
    out64, _ = attention64(*(np.asarray(t, np.float64) for t in (q, k, v)), keep, 0.7)
    assert _relative_error(out, out64) <= TOLERANCE[np.dtype(np.float32)]


@pytest.mark.parametrize("qkv_format, rotary_percent, offset", [("sbhd", 1.0, 0), ("bshd", 0.5, 3)])
def test_rotary_matches_complex_rotation(qkv_format, rotary_percent, offset):
    rng = np.random.default_rng(2)
    freqs = RotaryPositionEmbedding(HEAD_DIM, rotary_percent=rotary_percent)(SEQ, offset=offset)
    rotary_dim = int(HEAD_DIM * rotary_percent)
    exponents = np.arange(0, rotary_dim, 2) / rotary_dim
    angles = np.arange(offset, offset + SEQ)[:, None] * 10000.0**-exponents  # [S, R/2]
    np.testing.assert_allclose(np.asarray(freqs)[:, 0, 0, : rotary_dim // 2], angles, rtol=2**-20)
    shape = (SEQ, BATCH, HEADS, HEAD_DIM) if qkv_format == "sbhd" else (BATCH, SEQ, HEADS, HEAD_DIM)
    t, dt = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    out, vjp = jax.vjp(lambda t: apply_rotary_pos_emb(t, freqs, qkv_format), jnp.asarray(t))
    angles32 = np.asarray(freqs, np.float64)[:SEQ, 0, 0, : rotary_dim // 2]  # the module's own fp32 angles
    out64, backward64 = rotate64(t.astype(np.float64), angles32, qkv_format)
    assert _relative_error(out, out64) <= 2**-20
    assert _relative_error(vjp(jnp.asarray(dt))[0], backward64(dt.astype(np.float64))) <= 2**-20


@pytest.mark.parametrize(
    "make, error, match",
    [
        (lambda: DotProductAttention(4, 8, num_gqa_groups=3), ValueError, r"must divide num_attention_heads=4"),
        (lambda: DotProductAttention(4, 8, attention_dropout=0.1), ValueError, r"no dropout.*pass 0.0"),
        (lambda: DotProductAttention(4, 8, qkv_format="bhsd"), ValueError, r"'sbhd', 'bshd'"),
        (lambda: DotProductAttention(4, 8, softmax_scale=0.0), ValueError, r"finite float > 0"),
        (lambda: RotaryPositionEmbedding(8, rotary_percent=0.1), ValueError, r"even number >= 2"),
    ],
)
def test_bad_arguments_raise_with_the_fix(make, error, match):
    with pytest.raises(error, match=match):
        make()


def test_bad_calls_raise_with_the_fix():
    module = DotProductAttention(4, 8, attn_mask_type="padding")
    q = jnp.zeros((SEQ, 2, 4, 8))
    with pytest.raises(ValueError, match=r"key must be \[S, B, heads, H\] with 4 heads of 8"):
        module(q, q[:, :, :3], q)
    with pytest.raises(ValueError, match=r"needs an attention_mask"):
        module(q, q, q)
    with pytest.raises(TypeError, match=r"bool array"):
        module(q, q, q, attention_mask=jnp.zeros((2, 1, 1, SEQ)))
    with pytest.raises(ValueError, match=r"takes no attention_mask"):
        module(q, q, q, attention_mask=jnp.zeros((2, 1, 1, SEQ), bool), attn_mask_type="causal")
    with pytest.raises(ValueError, match=rf"freqs must be \[S >= {SEQ}"):
        apply_rotary_pos_emb(q, jnp.zeros((8, 1, 1, 8)))
