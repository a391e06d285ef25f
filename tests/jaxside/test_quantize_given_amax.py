"""The JAX twin takes every argument the torch spec does, and gives its bytes: given amaxes, recipe calls.

Issue 29, finding 4: `shardbridge quantize --compare --recipe current` failed because
jaxside.quantize_tensorwise had no `amax` (and quantize_nvfp4 no `global_amax`), which
torchside's quantizers pass. This checks the twin without the CLI: the signatures against
fp8kernels.reference (the torch spec, the independent side here), the given-amax paths byte for
byte, and each recipe and role's call as torchside's Quantizer builds it (the CLI's call).
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import jaxside.quantize as JQ
from fp8kernels import reference as R
from torchside.quantization.quantizer import Quantizer
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

SHAPE = (64, 160)  # test_quantize.py's and the bridge test's: the jit compiles of one session serve all three


def _input(seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=generator) * torch.exp2(torch.randint(-4, 5, SHAPE, generator=generator).float())
    x[3, :3] = torch.tensor([float("inf"), -float("inf"), float("nan")])  # one row with non-finite values
    x[5, 32:] = 0  # all-zero blocks
    return x


def _assert_reference_bytes(got: dict, expected: R.Quantized, label: str) -> None:
    assert sorted(got) == sorted(name for name in JQ.BUFFERS if getattr(expected, name) is not None), label
    for name, array in got.items():
        want = getattr(expected, name).contiguous().numpy()
        np.testing.assert_array_equal(array.view(np.uint8), want.view(np.uint8), err_msg=f"{label}: {name}")


@pytest.mark.parametrize("function", sorted(JQ.QUANTIZERS))
def test_signatures_match_the_torch_spec(function):
    def parameters(f):
        return [(p.name, p.kind, p.default) for p in inspect.signature(f).parameters.values()]

    assert parameters(JQ.QUANTIZERS[function]) == parameters(getattr(R, function))


@pytest.mark.parametrize(
    "kwargs",
    [
        {"fmt": "e4m3", "amax": 3.0},  # below most of x: values past max saturate
        {"fmt": "e5m2", "amax": 1e6, "power_2_scale": True, "amax_epsilon": 0.5},
        {"fmt": "e4m3", "amax": float("inf")},  # another shard's inf: scale 1 here
    ],
    ids=["below", "above_pow2_eps", "inf"],
)
def test_tensorwise_with_a_given_amax_gives_the_reference_bytes(kwargs):
    x = _input()
    kwargs = dict(kwargs)
    amax = np.array([kwargs.pop("amax")], np.float32)
    expected = R.quantize_tensorwise(x, **kwargs, amax=torch.from_numpy(amax), columnwise=True)
    got = JQ.quantize_numpy(x.numpy(), "quantize_tensorwise", **kwargs, amax=amax, columnwise=True)
    _assert_reference_bytes(got, expected, f"{kwargs} amax {amax}")  # amax included: x's own, not the given one


@pytest.mark.parametrize("block", [(1, 16), (16, 16)], ids=["1x16", "16x16"])
def test_nvfp4_with_a_given_global_amax_gives_the_reference_bytes(block):
    x = _input(1)
    global_amax = torch.tensor([1e3])
    expected = R.quantize_nvfp4(x, block=block, columnwise=True, global_amax=global_amax)
    got = JQ.quantize_numpy(x.numpy(), "quantize_nvfp4", block=block, columnwise=True, global_amax=global_amax.numpy())
    _assert_reference_bytes(got, expected, f"nvfp4 {block}")


def test_given_amaxes_are_checked_as_the_torch_spec_checks_them():
    x = _input().numpy()
    with pytest.raises(ValueError, match="not both"):
        JQ.quantize_tensorwise(x, scale=np.ones(1, np.float32), amax=np.ones(1, np.float32))
    with pytest.raises(TypeError, match="amax must be an fp32 array of one element"):
        JQ.quantize_tensorwise(x, amax=np.ones(2, np.float32))
    with pytest.raises(ValueError, match="Hadamard-rotated"):
        JQ.quantize_nvfp4(x, hadamard=True, columnwise=True, global_amax=np.ones(1, np.float32))


RECIPES = {
    "current": Float8CurrentScaling,
    "delayed": DelayedScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}


# NVFP4's input and grad calls (Hadamard, stochastic rounding: the costliest jit compiles) pass no amax;
# tests/bridge/test_quantize_cross.py compares them.
ROLES = {"nvfp4": ("weight",)}


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_each_recipe_and_role_call_gives_the_reference_bytes(recipe):
    """The call torchside's Quantizer makes (`shardbridge quantize` passes it on to both sides)."""
    x = _input(2)
    for role in ROLES.get(recipe, ("input", "weight", "grad")):
        name, kwargs = Quantizer(RECIPES[recipe](), role).kernel_call(x)
        expected = getattr(R, name)(x, **kwargs)
        as_numpy = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        _assert_reference_bytes(JQ.quantize_numpy(x.numpy(), name, **as_numpy), expected, f"{recipe} {role} {name}")
