"""FP8 modules against a float64 computation of the same quantized math, for every recipe.

The reference here is written independently of torchside.modules: it quantizes each GEMM operand
with fp8kernels.reference (the byte-exact spec; the arguments are written out per recipe below),
dequantizes (code * scale_inv, rounded to fp32 as the spec does), multiplies in float64, and rounds
to the activation dtype exactly where the module writes a tensor in that dtype (norm output, GEMM
outputs, activation ops, and their gradients), so that the same values reach every FP8 cast. Norms
and activations are float64 torch ops.

Most cases run the kernels' pure-torch reference backend (fast); INTERPRETER_CASES run the Triton
kernels under TRITON_INTERPRET=1; GPU cases run compiled Triton on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from fp8kernels._backend import Backend, backend_for
from tests.torchside.quantized_math64 import (
    CONFIG,
    RECIPES,
    TOLERANCE,
    QuantizedMath64,
    forward64,
    relative_error,
)
from torchside.autocast import fp8_autocast
from torchside.modules import LayerNormLinear, LayerNormMLP, Linear
from torchside.quantization import FALLBACK_CALLS
from torchside.recipe import DelayedScaling

TOKENS = (2, 32)  # [B, S]: the modules flatten leading dims


def _init(weight):
    torch.nn.init.normal_(weight, std=0.1)  # larger than TE's 0.023, so outputs are O(1)


MODULES = {
    "linear": lambda dtype: Linear(64, 96, params_dtype=dtype, init_method=_init, config=CONFIG),
    "layernorm_linear": lambda dtype: LayerNormLinear(64, 96, params_dtype=dtype, init_method=_init, config=CONFIG),
    "rmsnorm_linear_zero_centered": lambda dtype: LayerNormLinear(
        128, 64, normalization="RMSNorm", zero_centered_gamma=True, params_dtype=dtype, init_method=_init, config=CONFIG
    ),
    "mlp_gelu": lambda dtype: LayerNormMLP(64, 128, params_dtype=dtype, init_method=_init, config=CONFIG),
    "mlp_swiglu_rmsnorm": lambda dtype: LayerNormMLP(
        64, 64, activation="swiglu", normalization="RMSNorm", params_dtype=dtype, init_method=_init, config=CONFIG
    ),
}


def check_against_float64(module_name: str, recipe_name: str, dtype: torch.dtype, device: str = "cpu") -> dict:
    """Run one FP8 forward and backward of the module and its float64 model; assert every relative error."""
    generator = torch.Generator().manual_seed(1234)
    torch.manual_seed(0)
    module = MODULES[module_name](dtype)
    with torch.no_grad():  # non-trivial gamma and biases, so that their use is checked too
        for param in module.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator).to(dtype))
    module.to(device)
    recipe = RECIPES[recipe_name]
    in_features = module.hidden_size if isinstance(module, LayerNormMLP) else module.in_features
    x = torch.randn(*TOKENS, in_features, generator=generator).to(dtype)
    if isinstance(recipe, DelayedScaling):  # a first step fills the histories: the checked step has real scales
        with fp8_autocast(recipe=recipe):
            module(x.to(device)).float().square().sum().backward()
        module.zero_grad()
    math = QuantizedMath64(recipe, module, dtype)
    params64 = {n: p.detach().cpu().double().requires_grad_() for n, p in module.named_parameters()}
    x_module = x.to(device, copy=True).requires_grad_()
    with fp8_autocast(recipe=recipe):
        y = module(x_module)
    dy = torch.randn(y.shape, generator=generator).to(dtype)
    y.backward(dy.to(device))
    x64 = x.double().requires_grad_()
    y64 = forward64(module, params64, math, x64)
    y64.backward(dy.double())

    errors = {
        "y": relative_error(y.detach().cpu(), y64.detach()),
        "dx": relative_error(x_module.grad.cpu(), x64.grad),
    }
    for name, param in module.named_parameters():
        errors[f"d{name}"] = relative_error(param.grad.cpu(), params64[name].grad)
    tolerance = TOLERANCE[torch.device(device).type, dtype]
    failed = {name: f"{error:.2e}" for name, error in errors.items() if not error <= tolerance}
    assert not failed, f"{module_name}/{recipe_name}/{dtype}: relative errors over {tolerance:.1e}: {failed}"
    return errors


@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("module_name", MODULES)
def test_fp32_matches_float64_quantized_math(reference_kernels, module_name, recipe_name):
    check_against_float64(module_name, recipe_name, torch.float32)


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("module_name", ["linear", "mlp_gelu"])
def test_bf16_matches_float64_quantized_math(reference_kernels, module_name, recipe_name):
    check_against_float64(module_name, recipe_name, torch.bfloat16)


INTERPRETER_CASES = [  # one per recipe family, every module kind
    ("linear", "current", torch.bfloat16),
    ("mlp_swiglu_rmsnorm", "delayed", torch.float32),
    ("layernorm_linear", "block", torch.float32),
    ("rmsnorm_linear_zero_centered", "mxfp8", torch.bfloat16),
    ("mlp_gelu", "nvfp4", torch.float32),
]


@pytest.mark.parametrize("module_name, recipe_name, dtype", INTERPRETER_CASES)
def test_triton_interpreter_matches_float64_quantized_math(module_name, recipe_name, dtype):
    if backend_for("cpu") is not Backend.INTERPRETER:
        pytest.skip("runs with TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    check_against_float64(module_name, recipe_name, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
@pytest.mark.parametrize("module_name", MODULES)
def test_cuda_matches_float64_quantized_math(module_name, recipe_name):
    fallbacks = sum(FALLBACK_CALLS.values())
    check_against_float64(module_name, recipe_name, torch.bfloat16, device="cuda")
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "a QuantizedTensor op ran on dequantized values"
