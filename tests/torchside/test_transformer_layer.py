"""MultiheadAttention and TransformerLayer: float64 models of their FP8 math for every recipe; FP8 off
against a plain-torch pre-norm block written here; construction and argument checks. (Training:
test_transformer_layer_training.py.)

The float64 model (tests/torchside/layer64.py) composes tests/torchside/quantized_math64.py's model of
each FP8 submodule (fp8kernels.reference quantization with that submodule's scales, float64 products,
rounding to the activation dtype where the module writes it) with a float64 attention and complex
rotation; the rotary angles are an input, the same tensor on both sides.
Its tolerance table is reused. These checks run in fp32: in bf16 torch's attention kernels round
inside (probabilities, partial sums) where no model can follow, and a one-bit difference ahead of
an FP8 cast can move that cast by a whole FP8 step.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchside.modules.functions as functions

from fp8kernels._backend import Backend, backend_for
from fp8kernels.gemm_reference import operand_values
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import LayerNormLinear, ModuleConfig
from torchside.modules.multihead_attention import MultiheadAttention, fused_from_qkv
from torchside.modules.rotary import RotaryPositionEmbedding
from torchside.modules.transformer_config import TransformerConfig
from torchside.modules.transformer_layer import TransformerLayer
from torchside.quantization import FALLBACK_CALLS, QuantizedTensor
from torchside.recipe import DelayedScaling, Float8CurrentScaling
from tests.torchside.fp8_capture import on_cpu
from tests.torchside.layer64 import BATCH, CASES, HEAD_DIM, HEADS, HIDDEN, SEQ, fp8_step, model_errors
from tests.torchside.quantized_math64 import CONFIG, RECIPES, TOLERANCE, QuantizedMath64, relative_error


def _assert_within(errors: dict[str, float], tolerance: float, label: str) -> None:
    failed = {name: f"{error:.2e}" for name, error in errors.items() if not error <= tolerance}
    assert not failed, f"{label}: relative errors over {tolerance:.1e}: {failed}"


def check_against_float64(kind: str, case: str, recipe_name: str, dtype=torch.float32, device="cpu") -> None:
    """One FP8 step of the module and its float64 model; assert the relative error of y, dx and every grad."""
    step = fp8_step(kind, case, recipe_name, dtype, device)
    tolerance = TOLERANCE[torch.device(device).type, dtype]
    if isinstance(step.recipe, DelayedScaling):
        # fmax / amax is not a power of 2: a layer's chained casts meet enough values that one may sit
        # within fp32 rounding of a code boundary and flip (seen once: 2.9e-4 on dx); one flip costs
        # ~2^-3 / sqrt(elements) of a tensor, a bug (skipped cast, wrong scale) more than 2^-5.
        tolerance = max(tolerance, 2**-10)
    _assert_within(model_errors(kind, step, step.maths), tolerance, f"{kind}/{case}/{recipe_name}")


# Hopper's FP8 tensor cores add a GEMM's products in a reduced-precision accumulator (~14 bits kept,
# DeepSeek-V3 report 3.3.2), and with K <= 128 (every GEMM here) nothing is promoted to fp32 within a
# GEMM: an output may be off by ~2^-13 of sum |a b|. Allowed: 4x that, plus the output's rounding.
# A wrong scale, operand or layout costs a whole FP8 step (2^-4 .. 2^-2 of the products) or more.
GEMM_ACCUMULATION = 2**-11
OUT_ROUNDING = {torch.float32: 2**-24, torch.bfloat16: 2**-8}
# Errors that large flip FP8 codes of later casts where a value sits that close to a rounding
# boundary, and in a layer the flips compound: attention's backward (softmax's sum of P * dP cancels)
# turns a 2^-13 GEMM error into percent-level QKV weight grads (reproduced on CPU by
# test_local_check_holds_under_hopper_accumulation_error). So on CUDA the float64 model follows the
# module's own codes, each checked bit for bit against the model's cast of the module's cast input,
# and what reaches each cast must agree with the model within CAST_INPUT: with 2^-13 errors in every
# GEMM the worst cast input, the query/key grads behind attention's backward, is 7e-4 (~2^-10.5, CPU,
# four recipes, two seeds); 2^-8 allows 4x that, as GEMM_ACCUMULATION does. A skipped cast or a wrong
# tensor in a cast moves its input by far more (an FP8 step is 2^-4 of the value or more).
CAST_INPUT = 2**-8


def check_locally_against_float64(
    kind: str, case: str, recipe_name: str, dtype=torch.float32, device="cpu", tolerance: float | None = None
) -> dict:
    """The check that holds on Hopper (comment above): every cast, every GEMM, every cast input and result
    (within `tolerance`, by default TOLERANCE for the device and dtype).

    Returns {"casts": {key: relative error of the cast input}, "results": {tensor: relative error}}.
    """
    step = fp8_step(kind, case, recipe_name, dtype, device, record=True)
    label = f"{kind}/{case}/{recipe_name}"
    casts, gemms = step.recording.casts, step.recording.gemms
    for (name, role, gemm), cast in casts.items():
        want = step.maths[name].quantize(cast.x.cpu(), role, gemm)  # the recipe's rules, the module's input
        for buffer in ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv"):
            got = getattr(cast.q, buffer)
            same = got is not None and torch.equal(got.cpu(), getattr(want, buffer))
            assert same, f"{label}: cast {name} {role} {gemm}: {buffer} differs from the model's cast of its input"
    for gemm in gemms:
        exact, magnitude = gemm.float64()
        error = (gemm.out.cpu().double() - exact).abs()
        allowed = GEMM_ACCUMULATION * magnitude + OUT_ROUNDING[gemm.out.dtype] * exact.abs()
        worst = (error / magnitude.clamp_min(torch.finfo(torch.float64).tiny)).max()
        where = f"{label}: {gemm.key} {gemm.role} ({gemm.provider})"
        assert (error <= allowed).all(), f"{where} error {worst:.1e} of sum |ab|"
    follow: dict[str, dict] = {name: {} for name in step.maths}
    for (name, role, gemm), cast in casts.items():
        follow[name][role, gemm] = on_cpu(cast.q)
    maths = {name: QuantizedMath64(step.recipe, step.module.get_submodule(name), dtype, follow=follow[name])
             for name in step.maths}  # fmt: skip
    results = model_errors(kind, step, maths)
    used = {(name, role, gemm) for name, math in maths.items() for role, gemm in math.cast_inputs}
    only = f"casts of the module only {set(casts) - used}, of the model only {used - set(casts)}"
    assert used == set(casts), f"{label}: {only}"
    inputs = {
        key: relative_error(cast.x.cpu(), maths[key[0]].cast_inputs[key[1:]].double()) for key, cast in casts.items()
    }
    _assert_within({" ".join(map(str, key)): e for key, e in inputs.items()}, CAST_INPUT, f"{label} cast inputs")
    _assert_within(results, tolerance or TOLERANCE[torch.device(device).type, dtype], label)
    return {"casts": inputs, "results": results}


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
    check_locally_against_float64("layer", "rmsnorm-swiglu-gqa-separate-rotary-bshd", recipe_name, device="cuda")
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "a QuantizedTensor op ran on dequantized values"


@contextlib.contextmanager
def gemm_error(relative: float, gemm_role: str | None = None, seed: int = 0):
    """The modules' GEMMs (those of `gemm_role`, or all) with an error up to `relative` * sum |a b| per output,
    the size of Hopper's reduced-precision FP8 accumulation (GEMM_ACCUMULATION's comment)."""
    original, generator = functions.scaled_mm, torch.Generator().manual_seed(seed)

    def scaled_mm(a, b, *, a_columnwise=False, b_columnwise=False, **kwargs):
        out = original(a, b, a_columnwise=a_columnwise, b_columnwise=b_columnwise, **kwargs)
        if gemm_role not in (None, "wgrad" if a_columnwise else "dgrad" if b_columnwise else "fprop"):
            return out
        magnitude = operand_values(a, a_columnwise).double().abs() @ operand_values(b, b_columnwise).double().abs().T
        error = (2 * torch.rand(out.shape, generator=generator, dtype=torch.float64) - 1) * relative * magnitude
        return (out.double() + error).to(out.dtype)

    functions.scaled_mm = scaled_mm
    try:
        yield
    finally:
        functions.scaled_mm = original


CUDA_FP32 = TOLERANCE["cuda", torch.float32]


def test_local_check_holds_under_hopper_accumulation_error(reference_kernels):
    case = "rmsnorm-swiglu-gqa-separate-rotary-bshd"
    with gemm_error(2**-13):  # the end-to-end comparison fails as on the H200: QKV weight grads
        errors = model_errors("layer", step := fp8_step("layer", case, "current"), step.maths)
    over = {name for name, e in errors.items() if e > CUDA_FP32}
    assert over >= {"dself_attention.query.weight", "dself_attention.value.weight"}, errors
    with gemm_error(2**-13):
        local = check_locally_against_float64("layer", case, "current", tolerance=CUDA_FP32)
    assert max(local["results"].values()) < 2**-9  # following the module's codes, only the GEMM errors are left


@pytest.mark.parametrize("gemm_role", ["fprop", "wgrad"])
def test_local_check_catches_a_gemm_off_by_an_fp8_step(reference_kernels, gemm_role):
    with gemm_error(2**-4, gemm_role), pytest.raises(AssertionError, match=f"{gemm_role} .*of sum"):
        check_locally_against_float64("layer", "rmsnorm-swiglu-gqa-separate-rotary-bshd", "block", tolerance=CUDA_FP32)


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
    assert relative_error(y_layer, y_plain.double()) <= FP32_ROUNDING
    assert relative_error(x_layer.grad, x_plain.grad.double()) <= FP32_ROUNDING
    params = dict(layer.named_parameters())
    for plain_name, layer_name in names.items():
        grad = plain.get_parameter(plain_name).grad.double()
        assert relative_error(params[layer_name].grad, grad) <= FP32_ROUNDING, layer_name
    qkv_grad = fused_from_qkv(*(getattr(plain, part).weight.grad for part in "qkv"), 2, HEAD_DIM, dim=0).double()
    assert relative_error(params["self_attention.layernorm_qkv.weight"].grad, qkv_grad) <= FP32_ROUNDING


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
