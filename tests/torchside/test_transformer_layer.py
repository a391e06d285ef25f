"""MultiheadAttention and TransformerLayer: float64 models of their FP8 math for every recipe; FP8 off
against a plain-torch pre-norm block written here; construction and argument checks. (Training:
test_transformer_layer_training.py.)

The float64 model composes tests/torchside/test_modules_numerics.py's model of each FP8 submodule
(kernels.reference quantization with that submodule's scales, float64 products, rounding to the
activation dtype where the module writes it) with tests/torchside/test_attention.py's float64
attention and complex rotation; the rotary angles are an input, the same tensor on both sides.
Its tolerance table is reused. These checks run in fp32: in bf16 torch's attention kernels round
inside (probabilities, partial sums) where no model can follow, and a one-bit difference ahead of
an FP8 cast can move that cast by a whole FP8 step.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels._backend import Backend, backend_for
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import FP8Module, LayerNormLinear, ModuleConfig
from torchside.modules.multihead_attention import MultiheadAttention, fused_from_qkv
from torchside.modules.rotary import RotaryPositionEmbedding
from torchside.modules.transformer_config import TransformerConfig
from torchside.modules.transformer_layer import TransformerLayer
from torchside.quantization import FALLBACK_CALLS, QuantizedTensor
from torchside.recipe import DelayedScaling, Float8CurrentScaling
from tests.torchside.test_attention import attention64, causal_keep, rotate64
from tests.torchside.test_modules_numerics import (
    CONFIG,
    RECIPES,
    TOLERANCE,
    QuantizedMath64,
    _forward64,
    _norm64,
    _relative_error,
    reference_kernels,  # noqa: F401 (a fixture)
)

HIDDEN, HEADS, HEAD_DIM, SEQ, BATCH = 64, 4, 16, 16, 2
CASES = {  # name: (config, num_gqa_groups, ffn_hidden_size, rotary)
    "layernorm-gelu-fused-sbhd": (TransformerConfig(module_config=CONFIG), None, 128, False),
    "rmsnorm-swiglu-gqa-separate-rotary-bshd": (
        TransformerConfig(normalization="RMSNorm", zero_centered_gamma=True, activation="swiglu", bias=False,
                          qkv_bias=True, fuse_qkv_params=False, qkv_format="bshd", module_config=CONFIG),
        2, 64, True,
    ),
    "rmsnorm-gqa-fused-rotary-sbhd": (
        TransformerConfig(normalization="RMSNorm", bias=False, module_config=CONFIG), 2, 64, True
    ),
}  # fmt: skip


def _sub(params: dict, prefix: str) -> dict:
    """One submodule's float64 parameters by their own names; a bias it was built without is None."""
    absent = dict.fromkeys(("bias", "fc1_bias", "fc2_bias", "layer_norm_bias"))
    return absent | {name.removeprefix(prefix): p for name, p in params.items() if name.startswith(prefix)}


def _angles(freqs):
    """The rotation angles of the rotary input, [S, R/2] in float64 (the module receives the same tensor)."""
    return None if freqs is None else freqs[:SEQ, 0, 0, : freqs.shape[-1] // 2].double().cpu()


def mha64(mha, params: dict, maths: dict, x, angles, prefix: str = ""):
    """Float64 model of MultiheadAttention's FP8 forward (and, by autograd, backward)."""
    config = mha.config

    def projection(name, values):
        return _forward64(getattr(mha, name), _sub(params, f"{prefix}{name}."), maths[f"{prefix}{name}"], values)

    if config.fuse_qkv_params:
        fused = projection("layernorm_qkv" if mha.input_layernorm else "qkv", x)
        q, k, v = mha.split_qkv(fused)
    else:
        if mha.input_layernorm:
            norm = _sub(params, f"{prefix}layernorm.")
            norm_params = {"layer_norm_weight": norm["weight"], "layer_norm_bias": norm["bias"]}
            x = maths[f"{prefix}query"].round(_norm64(mha.layernorm, norm_params, x))
        q, k, v = (projection(name, x) for name in ("query", "key", "value"))
    q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))
    math64 = maths[f"{prefix}proj"]  # any submodule's model rounds alike
    if angles is not None:
        if config.qkv_format == "bshd":  # rotate64 takes sequence-first tensors
            q, k = (rotate64(t.transpose(0, 1), angles).transpose(0, 1) for t in (q, k))
        else:
            q, k = rotate64(q, angles), rotate64(k, angles)
        q, k = math64.round(q), math64.round(k)
    context = math64.round(attention64(q, k, v, causal_keep(SEQ, SEQ), HEAD_DIM**-0.5, config.qkv_format))
    return projection("proj", context)


def layer64(layer, params: dict, maths: dict, x, angles):
    """Float64 model of TransformerLayer: two residual sublayers, each sum rounded where the module rounds it."""
    round_ = maths["layernorm_mlp"].round
    hidden = round_(x + mha64(layer.self_attention, params, maths, x, angles, prefix="self_attention."))
    mlp = _forward64(layer.layernorm_mlp, _sub(params, "layernorm_mlp."), maths["layernorm_mlp"], hidden)
    return round_(hidden + mlp)


def _build(kind: str, case: str, dtype=torch.float32, device="cpu"):
    config, groups, ffn, rotary = CASES[case]
    torch.manual_seed(0)
    init = {"init_method": lambda w: w.normal_(0, 0.1), "output_layer_init_method": lambda w: w.normal_(0, 0.1)}
    if kind == "mha":
        module = MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=groups, input_layernorm=True, params_dtype=dtype,
                                    config=config, **init)  # fmt: skip
    else:
        module = TransformerLayer(HIDDEN, ffn, HEADS, num_gqa_groups=groups, params_dtype=dtype, config=config, **init)
    with torch.no_grad():  # non-trivial norm weights and biases, so that their use is checked too
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape).to(dtype))
    freqs = RotaryPositionEmbedding(HEAD_DIM)(SEQ).to(device) if rotary else None
    return module.to(device), freqs


def check_against_float64(kind: str, case: str, recipe_name: str, dtype=torch.float32, device="cpu") -> None:
    """One FP8 step of the module and its float64 model; assert the relative error of y, dx and every grad."""
    module, freqs = _build(kind, case, dtype, device)
    recipe = RECIPES[recipe_name]
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator).to(dtype)  # [S, B, D] or, for "bshd", read as [B, S, D]
    if module.config.qkv_format == "bshd":
        x = x.transpose(0, 1).contiguous()
    extra = {"rotary_pos_emb": freqs}
    if isinstance(recipe, DelayedScaling):  # a first step fills the histories: the checked step has real scales
        with fp8_autocast(recipe=recipe):
            module(x.to(device), **extra).float().square().sum().backward()
        module.zero_grad()
    fp8_submodules = {n: m for n, m in module.named_modules() if isinstance(m, FP8Module) and m.num_gemms}
    maths = {name: QuantizedMath64(recipe, m, dtype) for name, m in fp8_submodules.items()}
    params64 = {n: p.detach().cpu().double().requires_grad_() for n, p in module.named_parameters()}
    x_module = x.to(device, copy=True).requires_grad_()
    with fp8_autocast(recipe=recipe):
        y = module(x_module, **extra)
    dy = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(dy.to(device))
    x64 = x.double().requires_grad_()
    model = mha64 if kind == "mha" else layer64
    y64 = model(module, params64, maths, x64, _angles(freqs))
    y64.backward(dy.double())

    errors = {
        "y": _relative_error(y.detach().cpu(), y64.detach()),
        "dx": _relative_error(x_module.grad.cpu(), x64.grad),
    }
    for name, param in module.named_parameters():
        errors[f"d{name}"] = _relative_error(param.grad.cpu(), params64[name].grad)
    tolerance = TOLERANCE[torch.device(device).type, dtype]
    if isinstance(recipe, DelayedScaling):
        # fmax / amax is not a power of 2: a layer's chained casts meet enough values that one may sit
        # within fp32 rounding of a code boundary and flip (seen once: 2.9e-4 on dx); one flip costs
        # ~2^-3 / sqrt(elements) of a tensor, a bug (skipped cast, wrong scale) more than 2^-5.
        tolerance = max(tolerance, 2**-10)
    failed = {name: f"{error:.2e}" for name, error in errors.items() if not error <= tolerance}
    assert not failed, f"{kind}/{case}/{recipe_name}: relative errors over {tolerance:.1e}: {failed}"


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("case", list(CASES)[:2])
def test_multihead_attention_matches_float64_quantized_math(reference_kernels, case, recipe_name):
    check_against_float64("mha", case, recipe_name)


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("case", list(CASES)[1:])
def test_transformer_layer_matches_float64_quantized_math(reference_kernels, case, recipe_name):
    check_against_float64("layer", case, recipe_name)


def test_triton_interpreter_layer_matches_float64_quantized_math():
    if backend_for("cpu") is not Backend.INTERPRETER:
        pytest.skip("runs with TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    check_against_float64("layer", "rmsnorm-gqa-fused-rotary-sbhd", "current")


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_cuda_layer_matches_float64_quantized_math(recipe_name):
    fallbacks = sum(FALLBACK_CALLS.values())
    check_against_float64("layer", "rmsnorm-swiglu-gqa-separate-rotary-bshd", recipe_name, device="cuda")
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "a QuantizedTensor op ran on dequantized values"


class PlainPreNormBlock(nn.Module):
    """A Llama/GPT pre-norm block in plain torch, batch-first [B, S, D], causal, for the FP8-off comparison."""

    def __init__(self, groups: int, ffn: int, normalization: str, gated: bool, bias: bool, qkv_bias: bool) -> None:
        super().__init__()
        norm = nn.LayerNorm if normalization == "LayerNorm" else nn.RMSNorm
        self.norm1, self.norm2 = norm(HIDDEN, eps=1e-5), norm(HIDDEN, eps=1e-5)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=qkv_bias)
        self.k = nn.Linear(HIDDEN, groups * HEAD_DIM, bias=qkv_bias)
        self.v = nn.Linear(HIDDEN, groups * HEAD_DIM, bias=qkv_bias)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=bias)
        self.up = nn.Linear(HIDDEN, 2 * ffn if gated else ffn, bias=bias)
        self.down = nn.Linear(ffn, HIDDEN, bias=bias)
        self.groups, self.gated = groups, gated

    def forward(self, x, angles=None):
        batch = x.shape[0]
        h = self.norm1(x)
        q = self.q(h).view(batch, SEQ, HEADS, HEAD_DIM)
        k = self.k(h).view(batch, SEQ, self.groups, HEAD_DIM)
        v = self.v(h).view(batch, SEQ, self.groups, HEAD_DIM)
        if angles is not None:  # channel pairs (i, i + H/2) turned as complex numbers
            turn = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
            turned = (torch.view_as_real(torch.complex(*t.chunk(2, dim=-1)) * turn) for t in (q, k))
            q, k = (t.movedim(-1, -2).flatten(-2) for t in turned)  # [.., H/2, (re, im)] -> [re.., im..]
        k, v = (t.repeat_interleave(HEADS // self.groups, dim=2) for t in (k, v))
        scores = torch.einsum("bqnh,bknh->bnqk", q, k) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), -math.inf)
        x = x + self.o(torch.einsum("bnqk,bknh->bqnh", scores.softmax(-1), v).reshape(batch, SEQ, -1))
        u = self.up(self.norm2(x))
        if self.gated:
            gate, linear = u[..., 0::2], u[..., 1::2]  # fc1's rows alternate gate, up
            return x + self.down(F.silu(gate) * linear)
        return x + self.down(F.gelu(u, approximate="tanh"))


def _plain_twin(layer: TransformerLayer) -> tuple[PlainPreNormBlock, dict[str, str]]:
    """The plain block with the layer's weights, and {plain param name: layer param name} for fused QKV rows too."""
    attention, config = layer.self_attention, layer.config
    plain = PlainPreNormBlock(
        attention.core_attention.num_gqa_groups,
        layer.layernorm_mlp.ffn_hidden_size,
        config.normalization,
        gated=config.activation == "swiglu",
        bias=config.bias,
        qkv_bias=config.has_qkv_bias,
    )
    names = {"o.weight": "self_attention.proj.weight", "up.weight": "layernorm_mlp.fc1_weight",
             "down.weight": "layernorm_mlp.fc2_weight", "norm2.weight": "layernorm_mlp.layer_norm_weight"}  # fmt: skip
    if config.bias:
        names |= {"o.bias": "self_attention.proj.bias", "up.bias": "layernorm_mlp.fc1_bias",
                  "down.bias": "layernorm_mlp.fc2_bias"}  # fmt: skip
    if config.normalization == "LayerNorm":
        names |= {"norm1.bias": "self_attention.layernorm_qkv.layer_norm_bias",
                  "norm2.bias": "layernorm_mlp.layer_norm_bias"}  # fmt: skip
    names["norm1.weight"] = "self_attention.layernorm_qkv.layer_norm_weight"
    params = dict(layer.named_parameters())
    with torch.no_grad():
        for plain_name, layer_name in names.items():
            plain.get_parameter(plain_name).copy_(params[layer_name])
        fused = attention.layernorm_qkv
        weights, biases = attention.split_qkv(fused.weight, dim=0), attention.split_qkv(fused.bias, dim=0)
        for part, w, b in zip("qkv", weights, biases, strict=True):
            getattr(plain, part).weight.copy_(w)
            getattr(plain, part).bias.copy_(b)
    return plain, names


# FP8 off, fp32: both sides compute the same math in fp32 in other orders (norm kernel vs torch,
# SDPA vs einsum + softmax over 16 keys, GEMM blockings): a few 2^-24 per op, chained through ~10 ops.
FP32_ROUNDING = 2**-18


@pytest.mark.parametrize(
    "activation, normalization, rotary", [("gelu", "LayerNorm", False), ("swiglu", "RMSNorm", True)]
)
def test_fp8_off_matches_a_plain_torch_pre_norm_block(activation, normalization, rotary):
    config = TransformerConfig(activation=activation, normalization=normalization, qkv_format="bshd")
    torch.manual_seed(0)
    layer = TransformerLayer(HIDDEN, 64, HEADS, num_gqa_groups=2, config=config)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    plain, names = _plain_twin(layer)
    freqs = RotaryPositionEmbedding(HEAD_DIM)(SEQ) if rotary else None
    x = torch.randn(BATCH, SEQ, HIDDEN)
    x_layer, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_layer = layer(x_layer, rotary_pos_emb=freqs)
    y_plain = plain(x_plain, None if freqs is None else freqs[:SEQ, 0, 0, : HEAD_DIM // 2])
    dy = torch.randn_like(y_plain)
    y_layer.backward(dy)
    y_plain.backward(dy)
    assert _relative_error(y_layer, y_plain.double()) <= FP32_ROUNDING
    assert _relative_error(x_layer.grad, x_plain.grad.double()) <= FP32_ROUNDING
    params = dict(layer.named_parameters())
    for plain_name, layer_name in names.items():
        grad = plain.get_parameter(plain_name).grad.double()
        assert _relative_error(params[layer_name].grad, grad) <= FP32_ROUNDING, layer_name
    qkv_grad = fused_from_qkv(*(getattr(plain, part).weight.grad for part in "qkv"), 2, HEAD_DIM, dim=0).double()
    assert _relative_error(params["self_attention.layernorm_qkv.weight"].grad, qkv_grad) <= FP32_ROUNDING


# ---- construction and arguments


def test_meta_build_then_reset_gives_the_eager_values():
    config = TransformerConfig(module_config=CONFIG)
    torch.manual_seed(0)
    eager = TransformerLayer(HIDDEN, 64, HEADS, num_gqa_groups=2, config=config)
    lazy = TransformerLayer(HIDDEN, 64, HEADS, num_gqa_groups=2, config=config, device="meta")
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.reset_parameters()
    for (name, want), got in zip(eager.state_dict().items(), lazy.state_dict().values(), strict=True):
        assert torch.equal(got, want), name


def test_quantized_model_init_makes_every_gemm_weight_fp8(reference_kernels):
    recipe = Float8CurrentScaling()
    with quantized_model_init(recipe=recipe):
        layer = TransformerLayer(HIDDEN, 64, HEADS, num_gqa_groups=2, params_dtype=torch.bfloat16)
    fp8 = {name for name, p in layer.named_parameters() if isinstance(p, QuantizedTensor)}
    assert fp8 == {"self_attention.layernorm_qkv.weight", "self_attention.proj.weight", "layernorm_mlp.fc1_weight",
                   "layernorm_mlp.fc2_weight"}  # fmt: skip
    fallbacks = sum(FALLBACK_CALLS.values())
    with fp8_autocast(recipe=recipe):
        y = layer(torch.randn(SEQ, BATCH, HIDDEN, dtype=torch.bfloat16))
    y.float().square().mean().backward()
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "a QuantizedTensor op ran on dequantized values"
    assert all(p.grad is not None for p in layer.parameters())


def test_kv_channels_sets_the_head_dim():
    layer = TransformerLayer(60, 64, 4, num_gqa_groups=1, config=TransformerConfig(kv_channels=8))
    assert isinstance(layer.self_attention.layernorm_qkv, LayerNormLinear)
    assert layer.self_attention.layernorm_qkv.out_features == (4 + 2) * 8
    assert layer.self_attention.proj.in_features == 32
    assert layer(torch.randn(SEQ, BATCH, 60)).shape == (SEQ, BATCH, 60)


def test_hidden_dropout_acts_in_training_only():
    torch.manual_seed(0)
    layer = TransformerLayer(HIDDEN, 64, HEADS, config=TransformerConfig(hidden_dropout=0.5))
    plain = TransformerLayer(HIDDEN, 64, HEADS)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(SEQ, BATCH, HIDDEN)
    layer.eval()
    assert torch.equal(layer(x), plain(x))
    layer.train()
    assert not torch.equal(layer(x), plain(x))


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"normalization": "BatchNorm"}, ValueError, "normalization"),
        ({"activation": "tanh"}, ValueError, "activation"),
        ({"hidden_dropout": 1.5}, ValueError, "hidden_dropout"),
        ({"kv_channels": 0}, ValueError, "kv_channels"),
        ({"fuse_qkv_params": "yes"}, TypeError, "fuse_qkv_params"),
        ({"qkv_format": "thd"}, ValueError, "qkv_format"),
        ({"module_config": None}, TypeError, "module_config"),
    ],
)
def test_bad_config_raises_with_the_fix(fields, error, match):
    with pytest.raises(error, match=match):
        TransformerConfig(**fields)


def test_bad_arguments_raise_with_the_fix():
    with pytest.raises(ValueError, match="kv_channels"):
        TransformerLayer(60, 64, 8)
    with pytest.raises(TypeError, match="TransformerConfig"):
        TransformerLayer(HIDDEN, 64, HEADS, config=ModuleConfig())
    with pytest.raises(ValueError, match="must divide num_attention_heads"):
        MultiheadAttention(HIDDEN, HEADS, num_gqa_groups=3)
    with pytest.raises(ValueError, match=r"hidden_states \[S, B, D\] with D=64"):
        TransformerLayer(HIDDEN, 64, HEADS)(torch.randn(SEQ, BATCH, 32))
