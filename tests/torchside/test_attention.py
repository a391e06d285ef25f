"""DotProductAttention and rotary embeddings against float64 references, forward and backward.

The references are in attention64.py. Masks are built here from sequence lengths and index
arithmetic, not from the module's helpers.

Tolerances, as ||module - float64|| / ||float64||: fp32 2^-18 (two sums of at most 24 products and
an exp, each within a few 2^-24 of their size; measured 2e-7); bf16 on CPU 2^-7 (inputs are exact
bf16; torch rounds the output to bf16, 2^-9, and rounds probabilities and their gradients to bf16
inside; measured up to 4.5e-3 on dk); CUDA 2^-6 (the flash kernels round P and dS tile by tile).
"""

from __future__ import annotations

import pytest
import torch

from bridge.numerics import relative_error
from tests.torchside.attention64 import attention64, causal_keep, rotate64
from torchside.autocast import fp8_autocast
from torchside.modules import ModuleConfig
from torchside.modules.attention import DotProductAttention
from torchside.modules.rotary import RotaryPositionEmbedding, apply_rotary_pos_emb
from torchside.recipe import Float8CurrentScaling

TOLERANCE = {("cpu", torch.float32): 2**-18, ("cpu", torch.bfloat16): 2**-7, ("cuda", torch.bfloat16): 2**-6}
BATCH, SEQ_Q, SEQ_KV, HEAD_DIM = 3, 12, 12, 8
LENGTHS = (12, 7, 1)  # real tokens per sequence; the rest is padding at the end


def _valid(lengths, seq: int) -> torch.Tensor:
    return torch.arange(seq)[None, :] < torch.tensor(lengths)[:, None]  # [B, S]


# name: (attn_mask_type, needs a mask argument)
MASKS = ["no_mask", "causal", "padding", "padding_causal", "arbitrary"]
# name: (N, G)
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}


def _inputs(heads: int, groups: int, dtype: torch.dtype, qkv_format: str, seq_kv: int = SEQ_KV, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def sample(seq, n):
        shape = (seq, BATCH, n, HEAD_DIM) if qkv_format == "sbhd" else (BATCH, seq, n, HEAD_DIM)
        return torch.randn(shape, generator=generator).to(dtype)

    return sample(SEQ_Q, heads), sample(seq_kv, groups), sample(seq_kv, groups)


def _mask_and_keep(mask_type: str, heads: int, seq_kv: int = SEQ_KV):
    """(the module's attention_mask argument, True = masked out; the reference's keep mask)."""
    full = torch.ones(1, 1, SEQ_Q, seq_kv, dtype=torch.bool)
    if mask_type == "no_mask":
        return None, full
    if mask_type == "causal":
        return None, causal_keep(SEQ_Q, seq_kv)
    if mask_type in ("padding", "padding_causal"):
        valid_q, valid_kv = _valid(LENGTHS, SEQ_Q), _valid(LENGTHS, seq_kv)
        keep = (valid_q[:, :, None] & valid_kv[:, None, :])[:, None]
        if mask_type == "padding_causal":
            keep = keep & causal_keep(SEQ_Q, seq_kv)
        if SEQ_Q == seq_kv:
            return ~valid_kv[:, None, None, :], keep
        return (~valid_q[:, None, None, :], ~valid_kv[:, None, None, :]), keep
    generator = torch.Generator().manual_seed(3)  # arbitrary: random per head, one row fully masked
    keep = torch.rand(BATCH, heads, SEQ_Q, seq_kv, generator=generator) < 0.6
    keep[1, 2, 5] = False
    return ~keep, keep


def _check(mask_type, head_case, qkv_format, dtype, softmax_scale=None, seq_kv=SEQ_KV, device="cpu"):
    heads, groups = HEADS[head_case]
    module = DotProductAttention(
        heads, HEAD_DIM, num_gqa_groups=groups, qkv_format=qkv_format, attn_mask_type=mask_type,
        softmax_scale=softmax_scale,
    )  # fmt: skip
    q, k, v = _inputs(heads, groups, dtype, qkv_format, seq_kv)
    attention_mask, keep = _mask_and_keep(mask_type, heads, seq_kv)
    if isinstance(attention_mask, tuple):
        attention_mask = tuple(m.to(device) for m in attention_mask)
    elif attention_mask is not None:
        attention_mask = attention_mask.to(device)
    ours = [t.to(device, copy=True).requires_grad_() for t in (q, k, v)]
    out = module(*ours, attention_mask=attention_mask)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(dtype)
    out.backward(dout.to(device))
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    scale = softmax_scale if softmax_scale is not None else HEAD_DIM**-0.5
    out64 = attention64(*ref, keep, scale, qkv_format)
    out64.backward(dout.double())
    assert out.shape == out64.shape and out.dtype == dtype
    pairs = {"out": (out, out64), "dq": (ours[0].grad, ref[0].grad), "dk": (ours[1].grad, ref[1].grad),
             "dv": (ours[2].grad, ref[2].grad)}  # fmt: skip
    errors = {name: relative_error(a, b) for name, (a, b) in pairs.items()}
    tolerance = TOLERANCE[torch.device(device).type, dtype]
    failed = {name: f"{e:.1e}" for name, e in errors.items() if not e <= tolerance}
    assert not failed, f"{mask_type}/{head_case}/{qkv_format}/{dtype}: {failed}"
    return out.cpu()


@pytest.mark.parametrize("qkv_format", ["sbhd", "bshd"])
@pytest.mark.parametrize("head_case", HEADS)
@pytest.mark.parametrize("mask_type", MASKS)
def test_fp32_matches_float64(mask_type, head_case, qkv_format):
    _check(mask_type, head_case, qkv_format, torch.float32)


@pytest.mark.parametrize("mask_type, head_case", [("causal", "gqa"), ("padding_causal", "mqa"), ("arbitrary", "mha")])
def test_bf16_matches_float64(mask_type, head_case):
    _check(mask_type, head_case, "bshd", torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("mask_type, head_case", [("causal", "gqa"), ("padding_causal", "mqa"), ("arbitrary", "mha")])
def test_cuda_bf16_matches_float64(mask_type, head_case):
    _check(mask_type, head_case, "sbhd", torch.bfloat16, device="cuda")


def test_softmax_scale_and_cross_attention_lengths():
    _check("no_mask", "gqa", "sbhd", torch.float32, softmax_scale=0.3, seq_kv=5)
    _check("padding", "mha", "bshd", torch.float32, seq_kv=9)  # (q_mask, kv_mask) tuple


def test_padded_queries_give_zero_rows():
    out = _check("padding", "gqa", "bshd", torch.float32)
    for b, length in enumerate(LENGTHS):
        assert torch.equal(out[b, length:], torch.zeros_like(out[b, length:]))


def test_fp8_autocast_leaves_attention_alone():
    """FP8 lives in the projections: attention inside fp8_autocast is the same computation."""
    module = DotProductAttention(4, HEAD_DIM, num_gqa_groups=2)
    q, k, v = _inputs(4, 2, torch.bfloat16, "sbhd")
    with fp8_autocast(recipe=Float8CurrentScaling()):
        inside = module(q, k, v)
    assert torch.equal(inside, module(q, k, v))


def test_dropout_drops_probabilities_and_rescales_in_training_only():
    """With v = 1 each output is the sum of its row's kept probabilities / (1 - p): mean 1, spread > 0."""
    module = DotProductAttention(4, HEAD_DIM, attention_dropout=0.5, qkv_format="bshd", attn_mask_type="no_mask")
    q, k, _ = _inputs(4, 4, torch.float32, "bshd")
    v = torch.ones_like(k)
    module.eval()
    assert torch.allclose(module(q, k, v), torch.ones(BATCH, SEQ_Q, 4 * HEAD_DIM))
    module.train()
    torch.manual_seed(0)
    row_sums = module(q, k, v)
    assert abs(row_sums.mean().item() - 1.0) < 0.1 and row_sums.std().item() > 0.2


def test_bad_arguments_raise_with_the_fix():
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        DotProductAttention(4, 8, num_gqa_groups=3)
    for bad in ({"qkv_format": "thd"}, {"attn_mask_type": "causal_bottom_right"}, {"attention_dropout": 1.0},
                {"softmax_scale": -1.0}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            DotProductAttention(4, 8, **bad)
    with pytest.raises(ValueError, match="leave parallel_mode None"):
        DotProductAttention(4, 8, config=ModuleConfig(parallel_mode="column"))
    module = DotProductAttention(4, HEAD_DIM, num_gqa_groups=2, attn_mask_type="padding")
    q, k, v = _inputs(4, 2, torch.float32, "sbhd")
    with pytest.raises(ValueError, match="needs an attention_mask"):
        module(q, k, v)
    with pytest.raises(TypeError, match="bool tensor"):
        module(q, k, v, attention_mask=torch.zeros(BATCH, 1, 1, SEQ_KV))
    with pytest.raises(ValueError, match=r"shape \[3, 1, 1, 12\]"):
        module(q, k, v, attention_mask=torch.zeros(BATCH, SEQ_KV, dtype=torch.bool))
    with pytest.raises(ValueError, match="takes no attention_mask"):
        module(q, k, v, attention_mask=torch.zeros(BATCH, 1, 1, SEQ_KV, dtype=torch.bool), attn_mask_type="causal")
    arbitrary = DotProductAttention(4, HEAD_DIM, num_gqa_groups=2, attn_mask_type="arbitrary")
    with pytest.raises(ValueError, match=r"must broadcast to \[B, N, Sq, Skv\]"):
        arbitrary(q, k, v, attention_mask=torch.zeros(2, BATCH, 4, SEQ_Q, SEQ_KV, dtype=torch.bool))
    with pytest.raises(ValueError, match="key must be"):
        module(q, q, v, attn_mask_type="causal")


@pytest.mark.parametrize("qkv_format, rotary_percent, offset", [("sbhd", 1.0, 0), ("bshd", 0.5, 3)])
def test_rotary_matches_complex_rotation(qkv_format, rotary_percent, offset):
    seq, head_dim = 6, 8
    rope = RotaryPositionEmbedding(head_dim, rotary_percent=rotary_percent, rotary_base=100.0)
    freqs = rope(seq + 2, offset=offset)  # longer than the sequence: the first `seq` rows are used
    assert freqs.shape == (seq + 2, 1, 1, int(head_dim * rotary_percent)) and freqs.dtype == torch.float32
    x_SBNH = torch.randn(seq, 2, 3, head_dim)
    x = x_SBNH if qkv_format == "sbhd" else x_SBNH.transpose(0, 1)
    got = apply_rotary_pos_emb(x, freqs, qkv_format)
    got_SBNH = got if qkv_format == "sbhd" else got.transpose(0, 1)
    exponents = torch.arange(0, rope.rotary_dim, 2, dtype=torch.float64) / rope.rotary_dim
    angles = torch.arange(offset, offset + seq, dtype=torch.float64)[:, None] * 100.0**-exponents
    want = rotate64(x_SBNH, angles)
    assert relative_error(got_SBNH, want) < 2**-20
    assert torch.equal(got_SBNH[..., rope.rotary_dim :], x_SBNH[..., rope.rotary_dim :])


def test_rotary_bad_arguments_raise():
    with pytest.raises(ValueError, match="even number"):
        RotaryPositionEmbedding(6, rotary_percent=0.5)
    with pytest.raises(ValueError, match=r"freqs must be \[S >= 6"):
        apply_rotary_pos_emb(torch.randn(6, 1, 2, 8), RotaryPositionEmbedding(8)(4))
