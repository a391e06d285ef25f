"""jaxside.modules against torchside.modules: the same weights and inputs give the same outputs and gradients.

Each torch module (kernels on their pure-torch reference backend) and its JAX twin get the same
parameters (torch `weight` [out, in] -> Flax `kernel` [in, out], the rest as they are), the same
input and the same output gradient, as the same bits. Compared:

- quantized bytes, where both sides cast the same tensor: the operands of the Linear's three GEMMs
  (x, weight and dy: what torch hands `scaled_mm`, against jaxside.modules.quantize_operand with the
  JAX module's scales and seed), and the weights of every GEMM module. They must be identical;
- outputs and gradients: each side is within the per-element bound of test_modules_numerics.py of
  the same float64 computation (tests/torchside/test_modules_numerics.py and
  tests/jaxside/test_modules_numerics.py check that), so they are within twice that of each other,
  outside at most 1/16 of a tensor moved by flipped codes (values computed in fp32 on both sides,
  by different summation orders, may round to neighbouring codes of a later cast);
- DelayedScaling state after two steps: histories and scales, to the bit for the Linear (its amaxes
  are of identical tensors); within 2^-16 relative otherwise (an amax of values computed in fp32 on
  two frameworks differs by a few ulps at most).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxside.modules as JM
import jaxside.recipe as jax_recipe
import torchside.modules as TM
import torchside.modules.functions as torch_functions
import torchside.recipe as torch_recipe
from jaxside.quantize import BUFFERS
from kernels._backend import Backend, backend_for
from tests.bridge.test_quantize_cross import _as_jax, assert_same_bytes
from tests.jaxside.test_modules_numerics import mismatches
from torchside.autocast import fp8_autocast as torch_fp8_autocast

HISTORY = 8
TOKENS = (2, 32)  # 64 tokens, as in tests/jaxside (the quantizers' compiles are shared)
RECIPES = {  # name -> (class name, arguments) of a recipe built alike from torchside.recipe and jaxside.recipe
    "off": None,
    "current": ("Float8CurrentScaling", {}),
    "delayed": ("DelayedScaling", {"amax_history_len": HISTORY}),
    "block": ("Float8BlockScaling", {"power_2_scale": False}),
    "mxfp8": ("MXFP8BlockScaling", {}),
    "nvfp4": ("NVFP4BlockScaling", {"stochastic_rounding_seed": 11}),
}
RMS_ZERO_CENTERED = {"normalization": "RMSNorm", "zero_centered_gamma": True}
MODULES = {  # name -> (class name, sizes, arguments) of a module built alike on both sides
    "linear": ("Linear", (32, 64), {}),  # not square: a kernel left untransposed shows
    "linear_square": ("Linear", (64, 64), {}),
    "rmsnorm_linear_zero_centered": ("LayerNormLinear", (64, 64), RMS_ZERO_CENTERED),
    "layernorm_mlp": ("LayerNormMLP", (64, 64), {}),
    "layernorm": ("LayerNorm", (64,), {}),
    "rmsnorm": ("RMSNorm", (64,), {}),
}
GEMM_MODULES = ("linear", "rmsnorm_linear_zero_centered", "layernorm_mlp")
CASES = [
    *[(module, recipe, torch.float32) for module in GEMM_MODULES for recipe in ("off", "current", "delayed")],
    ("linear", "block", torch.float32),
    ("linear", "mxfp8", torch.float32),
    ("linear_square", "nvfp4", torch.float32),  # NVFP4 compiles slowly on CPU: the shapes tests/jaxside compiles
    *[("linear", recipe, torch.bfloat16) for recipe in ("off", "current", "delayed")],
    ("layernorm", "current", torch.float32),
    ("rmsnorm", "current", torch.bfloat16),
]
JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}
STATE = ("fp8_forward_scale", "fp8_forward_amax_history", "fp8_backward_scale", "fp8_backward_amax_history")


@pytest.fixture
def reference_kernels(monkeypatch):
    """torchside's kernels through their pure-torch reference (kernels._backend reads this when called)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_for("cpu") is Backend.REFERENCE
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


def _recipes(name: str):
    """(torch recipe, JAX recipe), or (None, None) for FP8 off."""
    if RECIPES[name] is None:
        return None, None
    cls, kwargs = RECIPES[name]
    return getattr(torch_recipe, cls)(**kwargs), getattr(jax_recipe, cls)(**kwargs)


def _jax_name(torch_name: str, ndim: int) -> str:
    """A GEMM weight (torch `weight`, `fc1_weight`: 2-D) is a Flax kernel; norm parameters keep their names."""
    return torch_name.removesuffix("weight") + "kernel" if ndim == 2 else torch_name


def _twins(name: str, dtype: torch.dtype):
    """(torch module, JAX module) with the same parameters (non-trivial gammas and biases)."""
    cls, sizes, kwargs = MODULES[name]
    torch_kwargs, jax_kwargs = dict(kwargs, params_dtype=dtype), dict(kwargs, params_dtype=JAX_DTYPES[dtype])
    if name in GEMM_MODULES or cls == "Linear":
        torch_kwargs["config"] = TM.ModuleConfig(amax_history_len=HISTORY)
        jax_kwargs["config"] = JM.ModuleConfig(amax_history_len=HISTORY)
    torch_module = getattr(TM, cls)(*sizes, **torch_kwargs)
    jax_module = getattr(JM, cls)(*sizes, **jax_kwargs, rngs=nnx.Rngs(0))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in torch_module.named_parameters():
            param.copy_((0.1 * torch.randn(param.shape, generator=generator) + (param.dim() == 1)).to(dtype))
            getattr(jax_module, _jax_name(name, param.dim()))[...] = _as_jax(param.T if param.dim() == 2 else param)
    return torch_module, jax_module


def _features(module) -> tuple[int, int]:
    """(in, out) features of a module."""
    if isinstance(module, (JM.Linear, JM.LayerNormLinear)):
        return module.in_features, module.out_features
    return module.hidden_size, module.hidden_size


def _torch_step(module, recipe, x, dy) -> dict:
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with torch_fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    y.backward(dy)
    return {"y": y, "x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def _jax_step(module, recipe, x, dy) -> dict:
    """y, dx and the parameter grads under torch's names and layout ([out, in] weights)."""

    def loss(module, x):
        with JM.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, JM.GRAD_FILTER), 1), has_aux=True)(module, x)
    results = {"y": y, "x": dx}
    for path, grad in nnx.to_flat_state(JM.finish_backward(module, grads, recipe)):
        name, value = path[-1], grad.get_value()
        if value.ndim == 2:  # a kernel [in, out]: torch's weight [out, in]
            name, value = name.removesuffix("kernel") + "weight", value.T
        results[name] = value
    return results


def _jax_operands(module, recipe, x, dy) -> dict:
    """What the JAX module casts this step (its scales and seed, read before the step): x, dy, each GEMM's weight."""
    delayed = isinstance(recipe, jax_recipe.DelayedScaling)
    forward = module.fp8_forward_scale[...] if delayed else None
    backward = module.fp8_backward_scale[...] if delayed else None

    def scale(scales, slot):
        return None if scales is None else scales[slot : slot + 1]

    seed = getattr(recipe, "stochastic_rounding_seed", 0) + int(module.fp8_rounding_step[...])
    operands = {
        "x": JM.quantize_operand(x.reshape(-1, x.shape[-1]), recipe, "input", scale=scale(forward, 0)),
        "dy": JM.quantize_operand(dy.reshape(-1, dy.shape[-1]), recipe, "grad", scale=scale(backward, 0), seed=seed),
    }
    kernels = ["fc1_kernel", "fc2_kernel"] if isinstance(module, JM.LayerNormMLP) else ["kernel"]
    for gemm, kernel in enumerate(kernels):
        kernel_OI = getattr(module, kernel)[...].T
        operands[kernel] = JM.quantize_operand(kernel_OI, recipe, "weight", scale=scale(forward, 2 * gemm + 1))
    return operands


def _as_held(jax_q, torch_q):
    """The JAX operand with only the buffers the torch operand holds (dgrad and wgrad keep one copy)."""
    return dataclasses.replace(jax_q, **{name: None for name in BUFFERS if getattr(torch_q, name) is None})


def _check_operand_bytes(gemm_operands: list, jax_operands: dict, torch_module, x, dy, label: str) -> None:
    """Every operand cast from a tensor both sides hold: each GEMM's weight in fprop; for a Linear, x and dy too."""
    kernels = [name for name in jax_operands if name.endswith("kernel")]
    for gemm, kernel in enumerate(kernels):  # the g-th scaled_mm call is GEMM g's fprop: (x_g, w_g)
        weight_q = gemm_operands[gemm][1]
        weight = getattr(torch_module, kernel.removesuffix("kernel") + "weight").detach()
        assert_same_bytes(weight_q, _as_held(jax_operands[kernel], weight_q), weight, f"{label}: {kernel} in fprop")
    if not isinstance(torch_module, TM.Linear):
        return  # the inputs of the other modules' GEMMs are values each side computes itself
    (fprop_x, _), (dgrad_dy, dgrad_w), (wgrad_dy, wgrad_x) = gemm_operands
    weight = torch_module.weight.detach()
    checks = [
        ("x", fprop_x, x),
        ("dy", dgrad_dy, dy),
        ("kernel", dgrad_w, weight),
        ("dy", wgrad_dy, dy),
        ("x", wgrad_x, x),
    ]
    for name, torch_q, source in checks:
        held = _as_held(jax_operands[name], torch_q)
        assert_same_bytes(torch_q, held, source.reshape(-1, source.shape[-1]), f"{label}: {name}")


@pytest.mark.parametrize("module_name, recipe_name, dtype", CASES)
def test_jax_module_matches_torch_module(reference_kernels, monkeypatch, module_name, recipe_name, dtype):
    torch_module, jax_module = _twins(module_name, dtype)
    torch_r, jax_r = _recipes(recipe_name)
    label = f"{module_name}/{recipe_name}/{dtype}"
    generator = torch.Generator().manual_seed(6)
    in_features, out_features = _features(jax_module)
    x = torch.randn(*TOKENS, in_features, generator=generator).to(dtype)
    dy = torch.randn(*TOKENS, out_features, generator=generator).to(dtype)
    gemm_operands = []  # (a, b) of every torch scaled_mm call, in call order
    scaled_mm = torch_functions.scaled_mm

    def recording_scaled_mm(a, b, **kwargs):
        gemm_operands.append((a, b))
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch_functions, "scaled_mm", recording_scaled_mm)
    casts = jax_r is not None and jax_module.num_gemms > 0
    for _ in range(2 if recipe_name == "delayed" else 1):  # DelayedScaling: the second step has real scales
        gemm_operands.clear()
        jax_operands = _jax_operands(jax_module, jax_r, _as_jax(x), _as_jax(dy)) if casts else None
        expected = _torch_step(torch_module, torch_r, x, dy)
        got = _jax_step(jax_module, jax_r, _as_jax(x), _as_jax(dy))
    if casts:
        _check_operand_bytes(gemm_operands, jax_operands, torch_module, x, dy, label)
    expected = {name: _as_jax(value.detach()) for name, value in expected.items()}
    assert set(got) == set(expected), f"{label}: gradients {sorted(got)} vs torch's {sorted(expected)}"
    failed = mismatches(got, expected, JAX_DTYPES[dtype], jax_r, slack=2.0)
    assert not failed, f"{label}: {failed}"
    if recipe_name == "delayed":  # to the bit where both record amaxes of identical tensors
        rtol = 0 if isinstance(torch_module, TM.Linear) else 2**-16
        for name in STATE:
            torch_value, jax_value = getattr(torch_module, name).numpy(), np.asarray(getattr(jax_module, name)[...])
            np.testing.assert_allclose(jax_value, torch_value, rtol=rtol, atol=0, err_msg=f"{label}: {name}")
