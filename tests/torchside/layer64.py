"""One FP8 step of MultiheadAttention or TransformerLayer and its float64 model (test_transformer_layer.py's cases).

Shared by tests/torchside/test_transformer_layer.py and benchmarks/diagnose/diagnose_cuda_layer.py. The
float64 model composes tests/torchside/quantized_math64.py's model of each FP8 submodule with
tests/torchside/attention64.py's float64 attention and complex rotation; the rotary angles are an
input, the same tensor on both sides.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from torchside.autocast import fp8_autocast
from torchside.modules import FP8Module
from torchside.modules.multihead_attention import MultiheadAttention
from torchside.modules.rotary import RotaryPositionEmbedding
from torchside.modules.transformer_config import TransformerConfig
from torchside.modules.transformer_layer import TransformerLayer
from torchside.recipe import DelayedScaling
from tests.torchside.attention64 import attention64, causal_keep, rotate64
from tests.torchside.fp8_capture import Recording, record_fp8_step
from tests.torchside.quantized_math64 import CONFIG, RECIPES, QuantizedMath64, forward64, norm64, relative_error

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
        return forward64(getattr(mha, name), _sub(params, f"{prefix}{name}."), maths[f"{prefix}{name}"], values)

    if config.fuse_qkv_params:
        fused = projection("layernorm_qkv" if mha.input_layernorm else "qkv", x)
        q, k, v = mha.split_qkv(fused)
    else:
        if mha.input_layernorm:
            norm = _sub(params, f"{prefix}layernorm.")
            norm_params = {"layer_norm_weight": norm["weight"], "layer_norm_bias": norm["bias"]}
            x = maths[f"{prefix}query"].round(norm64(mha.layernorm, norm_params, x))
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
    mlp = forward64(layer.layernorm_mlp, _sub(params, "layernorm_mlp."), maths["layernorm_mlp"], hidden)
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


@dataclass
class Step:
    """One FP8 step of a module: its inputs, results and float64 copies of its parameters."""

    module: nn.Module
    recipe: object
    freqs: torch.Tensor | None
    x: torch.Tensor  # CPU, the module's input values
    dy: torch.Tensor  # CPU
    y: torch.Tensor  # the module's output (its device)
    dx: torch.Tensor
    params64: dict
    maths: dict  # FP8 submodule name -> its QuantizedMath64 (scales read before the step)
    recording: Recording | None


def fp8_step(kind: str, case: str, recipe_name: str, dtype=torch.float32, device="cpu", record=False) -> Step:
    """Build the module as the tests do and run one FP8 forward and backward (recorded when `record`)."""
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
    with record_fp8_step(module) if record else contextlib.nullcontext() as recording:
        with fp8_autocast(recipe=recipe):
            y = module(x_module, **extra)
        dy = torch.randn(y.shape, generator=generator).to(dtype)
        y.backward(dy.to(device))
    return Step(module, recipe, freqs, x, dy, y.detach(), x_module.grad, params64, maths, recording)


def model_errors(kind: str, step: Step, maths: dict) -> dict[str, float]:
    """Relative errors of y, dx and every parameter's grad against the float64 model run with `maths`."""
    x64 = step.x.double().requires_grad_()
    params64 = {n: p.detach().clone().requires_grad_() for n, p in step.params64.items()}
    model = mha64 if kind == "mha" else layer64
    y64 = model(step.module, params64, maths, x64, _angles(step.freqs))
    y64.backward(step.dy.double())
    errors = {"y": relative_error(step.y.cpu(), y64.detach()), "dx": relative_error(step.dx.cpu(), x64.grad)}
    for name, param in step.module.named_parameters():
        errors[f"d{name}"] = relative_error(param.grad.cpu(), params64[name].grad)
    return errors
