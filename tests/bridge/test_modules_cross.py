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
import torchside.modules as TM
import torchside.modules.functions as torch_functions
import torchside.modules.grouped_linear as torch_grouped_linear
import twinspec.recipe as recipes
from jaxside.quantize import BUFFERS
from fp8kernels._backend import Backend, backend_for
from tests.bridge.byte_compare import as_jax, assert_same_bytes
from tests.jaxside.quantized_math64 import mismatches
from tests.selection import in_ci
from torchside.autocast import fp8_autocast as torch_fp8_autocast

HISTORY = 8
TOKENS = (2, 32)  # 64 tokens, as in tests/jaxside (the quantizers' compiles are shared)
RECIPES = {  # name -> (class name, arguments) of the recipe both frameworks run
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
    """torchside's kernels through their pure-torch reference (fp8kernels._backend reads this when called)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert backend_for("cpu") is Backend.REFERENCE
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors on a shared 2-core machine
    yield
    torch.set_num_threads(threads)


def _recipe(name: str):
    """The one recipe object both frameworks run (twinspec.recipe), or None for FP8 off."""
    if RECIPES[name] is None:
        return None
    cls, kwargs = RECIPES[name]
    return getattr(recipes, cls)(**kwargs)


def _jax_name(torch_name: str, ndim: int) -> str:
    """A GEMM weight (torch `weight`, `fc1_weight`, `weight3`: 2-D) is a Flax kernel; norm parameters keep their names."""
    return torch_name.replace("weight", "kernel") if ndim == 2 else torch_name


def _torch_name(jax_name: str, ndim: int) -> str:
    return jax_name.replace("kernel", "weight") if ndim == 2 else jax_name


def _jax_variable(jax_module, torch_name: str, ndim: int):
    """The JAX variable at torch's dotted parameter path (the same nesting; the last name by `_jax_name`)."""
    *owners, leaf = torch_name.split(".")
    for owner in owners:
        jax_module = getattr(jax_module, owner)
    return getattr(jax_module, _jax_name(leaf, ndim))


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
            _jax_variable(jax_module, name, param.dim())[...] = as_jax(param.T if param.dim() == 2 else param)
    return torch_module, jax_module


def _features(module) -> tuple[int, int]:
    """(in, out) features of a module."""
    if isinstance(module, (JM.Linear, JM.LayerNormLinear)):
        return module.in_features, module.out_features
    return module.hidden_size, module.hidden_size


def _torch_step(module, recipe, x, dy, **call) -> dict:
    x = x.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    with torch_fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x, **call)
    y.backward(dy)
    return {"y": y, "x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def _jax_step(module, recipe, x, dy, **call) -> dict:
    """y, dx and the parameter grads under torch's (dotted) names and layout ([out, in] weights)."""

    def loss(module, x):
        with JM.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x, **call)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (grads, dx), y = nnx.grad(loss, argnums=(nnx.DiffState(0, JM.GRAD_FILTER), 1), has_aux=True)(module, x)
    results = {"y": y, "x": dx}
    for path, grad in nnx.to_flat_state(JM.finish_backward(module, grads, recipe)):
        value = grad.get_value()
        name = ".".join([*map(str, path[:-1]), _torch_name(path[-1], value.ndim)])
        results[name] = value.T if value.ndim == 2 else value  # a kernel [in, out]: torch's weight [out, in]
    return results


def _jax_operands(module, recipe, x, dy) -> dict:
    """What the JAX module casts this step (its scales and seed, read before the step): x, dy, each GEMM's weight."""
    delayed = isinstance(recipe, recipes.DelayedScaling)
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
    recipe = _recipe(recipe_name)
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
    casts = recipe is not None and jax_module.num_gemms > 0
    for _ in range(2 if recipe_name == "delayed" else 1):  # DelayedScaling: the second step has real scales
        gemm_operands.clear()
        jax_operands = _jax_operands(jax_module, recipe, as_jax(x), as_jax(dy)) if casts else None
        expected = _torch_step(torch_module, recipe, x, dy)
        got = _jax_step(jax_module, recipe, as_jax(x), as_jax(dy))
    if casts:
        _check_operand_bytes(gemm_operands, jax_operands, torch_module, x, dy, label)
    expected = {name: as_jax(value.detach()) for name, value in expected.items()}
    assert set(got) == set(expected), f"{label}: gradients {sorted(got)} vs torch's {sorted(expected)}"
    failed = mismatches(got, expected, JAX_DTYPES[dtype], recipe, slack=2.0)
    assert not failed, f"{label}: {failed}"
    if recipe_name == "delayed":  # to the bit where both record amaxes of identical tensors
        rtol = 0 if isinstance(torch_module, TM.Linear) else 2**-16
        for name in STATE:
            torch_value, jax_value = getattr(torch_module, name).numpy(), np.asarray(getattr(jax_module, name)[...])
            np.testing.assert_allclose(jax_value, torch_value, rtol=rtol, atol=0, err_msg=f"{label}: {name}")


# ----------------------------------------------------------------------------- attention, layer, grouped GEMMs

HEADS, GQA_GROUPS, SEQ, BATCH = 4, 2, 16, 4  # hidden 64, head dim 16: 64 tokens, the quantizer shapes above
SEPARATE_QKV = {  # TransformerConfig fields, the same on both sides
    "normalization": "RMSNorm",
    "zero_centered_gamma": True,
    "bias": False,
    "qkv_bias": True,
    "fuse_qkv_params": False,
    "qkv_format": "bshd",
}
# name -> (class name, sizes, constructor arguments, TransformerConfig fields or None,
#          (FP8 submodule path, kernel name, GEMM index) of every GEMM weight in forward order)
BLOCKS = {
    "mha_separate_qkv_rotary_bshd": (
        "MultiheadAttention", (64, HEADS), {"num_gqa_groups": GQA_GROUPS, "input_layernorm": True}, SEPARATE_QKV,
        [("query", "kernel", 0), ("key", "kernel", 0), ("value", "kernel", 0), ("proj", "kernel", 0)],
    ),
    "layer_fused_qkv_sbhd": (
        "TransformerLayer", (64, 64, HEADS), {"num_gqa_groups": GQA_GROUPS}, {},
        [("self_attention.layernorm_qkv", "kernel", 0), ("self_attention.proj", "kernel", 0),
         ("layernorm_mlp", "fc1_kernel", 0), ("layernorm_mlp", "fc2_kernel", 1)],
    ),
    "grouped_linear": ("GroupedLinear", (3, 64, 64), {}, None, [("", "kernel0", 0), ("", "kernel2", 2)]),
}  # fmt: skip
M_SPLITS = [32, 0, 32]  # group 1 has no rows; 32 rows fit MXFP8's and NVFP4's wgrad blocks
# Three recipes on GroupedLinear (per-tensor, blocks, FP4), two each on the attention blocks: their
# quantizer shapes compile slowly on CPU (all six recipes passed on each when written; tests/jaxside
# checks every recipe against float64). CI runs one of each block (10-25 s each on 2 cores), the grid the rest.
BLOCK_CASES = [
    *[("grouped_linear", recipe) for recipe in ("delayed", "mxfp8", "nvfp4")],
    *[("layer_fused_qkv_sbhd", recipe) for recipe in ("current", "delayed")],
    *[("mha_separate_qkv_rotary_bshd", recipe) for recipe in ("off", "block")],
]
BLOCK_CASES_IN_CI = [
    ("grouped_linear", "mxfp8"), ("layer_fused_qkv_sbhd", "current"), ("mha_separate_qkv_rotary_bshd", "block")
]  # fmt: skip


def _block_twins(name: str):
    """(torch module, JAX module, call arguments for each side) with the same parameters, in fp32."""
    cls, sizes, kwargs, config_fields, _ = BLOCKS[name]
    if config_fields is None:
        torch_kwargs = dict(kwargs, config=TM.ModuleConfig(amax_history_len=HISTORY))
        jax_kwargs = dict(kwargs, config=JM.ModuleConfig(amax_history_len=HISTORY))
    else:
        torch_config = TM.TransformerConfig(**config_fields, module_config=TM.ModuleConfig(amax_history_len=HISTORY))
        jax_config = JM.TransformerConfig(**config_fields, module_config=JM.ModuleConfig(amax_history_len=HISTORY))
        torch_kwargs, jax_kwargs = dict(kwargs, config=torch_config), dict(kwargs, config=jax_config)
    torch_module = getattr(TM, cls)(*sizes, params_dtype=torch.float32, **torch_kwargs)
    jax_module = getattr(JM, cls)(*sizes, params_dtype=jnp.float32, **jax_kwargs, rngs=nnx.Rngs(0))
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param_name, param in torch_module.named_parameters():
            param.copy_(0.1 * torch.randn(param.shape, generator=generator) + (param.dim() == 1))
            _jax_variable(jax_module, param_name, param.dim())[...] = as_jax(param.T if param.dim() == 2 else param)
    if cls == "GroupedLinear":
        return torch_module, jax_module, {"m_splits": M_SPLITS}, {"m_splits": M_SPLITS}
    if config_fields.get("qkv_format") != "bshd":
        return torch_module, jax_module, {}, {}
    freqs = TM.RotaryPositionEmbedding(64 // HEADS)(SEQ)  # the same angles on both sides
    return torch_module, jax_module, {"rotary_pos_emb": freqs}, {"rotary_pos_emb": as_jax(freqs)}


def _submodule(module, path: str):
    for owner in filter(None, path.split(".")):
        module = getattr(module, owner)
    return module


def _jax_weight_operands(jax_module, recipe, gemm_weights) -> list:
    """What the JAX module casts from each GEMM weight this step (its DelayedScaling scale, read before the step)."""
    operands = []
    for path, kernel, gemm in gemm_weights:
        owner = _submodule(jax_module, path)
        delayed = isinstance(recipe, recipes.DelayedScaling)
        scale = owner.fp8_forward_scale[...][2 * gemm + 1 : 2 * gemm + 2] if delayed else None
        operands.append(JM.quantize_operand(getattr(owner, kernel)[...].T, recipe, "weight", scale=scale))
    return operands


@pytest.mark.parametrize("block_name, recipe_name", in_ci(BLOCK_CASES, BLOCK_CASES_IN_CI))
def test_jax_blocks_match_torch_blocks(reference_kernels, monkeypatch, block_name, recipe_name):
    """MultiheadAttention, TransformerLayer, GroupedLinear: weight bytes, outputs, grads and state, as above."""
    torch_module, jax_module, torch_call, jax_call = _block_twins(block_name)
    gemm_weights = BLOCKS[block_name][-1]
    recipe = _recipe(recipe_name)
    label = f"{block_name}/{recipe_name}"
    generator = torch.Generator().manual_seed(6)
    shape = (64, 64) if "m_splits" in torch_call else (SEQ, BATCH, 64)  # "bshd" reads it as [B, S, D]: same size
    x, dy = (torch.randn(*shape, generator=generator) for _ in range(2))
    weight_operands = []  # the B operand of every forward GEMM (weights), in call order
    scaled_mm, grouped = torch_functions.scaled_mm, torch_grouped_linear.grouped_scaled_mm

    def is_fprop(kwargs) -> bool:  # dgrad reads B columnwise, wgrad both operands
        return not kwargs.get("a_columnwise") and not kwargs.get("b_columnwise")

    def recording_scaled_mm(a, b, **kwargs):
        weight_operands.extend([b] if is_fprop(kwargs) else [])
        return scaled_mm(a, b, **kwargs)

    def recording_grouped(a, b, **kwargs):
        weight_operands.extend(b if is_fprop(kwargs) else [])
        return grouped(a, b, **kwargs)

    monkeypatch.setattr(torch_functions, "scaled_mm", recording_scaled_mm)
    monkeypatch.setattr(torch_grouped_linear, "grouped_scaled_mm", recording_grouped)
    for _ in range(2 if recipe_name == "delayed" else 1):  # DelayedScaling: the second step has real scales
        weight_operands.clear()
        jax_weights = _jax_weight_operands(jax_module, recipe, gemm_weights) if recipe is not None else []
        expected = _torch_step(torch_module, recipe, x, dy, **torch_call)
        got = _jax_step(jax_module, recipe, as_jax(x), as_jax(dy), **jax_call)
    if recipe is not None:
        assert len(weight_operands) == len(gemm_weights), f"{label}: {len(weight_operands)} forward GEMMs"
        for (path, kernel, _), torch_q, jax_q in zip(gemm_weights, weight_operands, jax_weights):
            weight = _submodule(torch_module, path).get_parameter(_torch_name(kernel, 2)).detach()
            assert_same_bytes(torch_q, _as_held(jax_q, torch_q), weight, f"{label}: {path}.{kernel} in fprop")
    expected = {name: as_jax(value.detach()) for name, value in expected.items()}
    assert set(got) == set(expected), f"{label}: gradients {sorted(got)} vs torch's {sorted(expected)}"
    failed = mismatches(got, expected, jnp.float32, recipe, slack=2.0)
    assert not failed, f"{label}: {failed}"
    if recipe_name == "delayed":
        for path, torch_sub in torch_module.named_modules():
            if isinstance(torch_sub, TM.FP8Module) and torch_sub.num_gemms:
                for name in STATE:
                    torch_value = getattr(torch_sub, name).numpy()
                    jax_value = np.asarray(getattr(_submodule(jax_module, path), name)[...])
                    np.testing.assert_allclose(jax_value, torch_value, rtol=2**-16, atol=0, err_msg=f"{label}: {path}")
