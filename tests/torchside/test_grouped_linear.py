"""GroupedLinear: every recipe against a float64 model of each group's quantized linear (forward and
backward), FP8 off against one torch linear per group, per-group FP8 state, FP8 weights, argument checks.

The float64 model is tests/torchside/test_modules_numerics.py's (fp8kernels.reference quantization of
each operand with that group's scales, float64 products, rounding where the module writes its
dtype), applied group by group; its tolerance table is reused as is. Splits are uneven and include
an empty group, whose weight and bias gradients must be exactly zero.
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fp8kernels import quantize as triton_quantize
from fp8kernels._backend import Backend, backend_for
from tests.distributed import run_threads
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import ModuleConfig
from torchside.modules.grouped_linear import GroupedLinear
from torchside.quantization import FALLBACK_CALLS, QuantizedStorage, QuantizedTensor, Quantizer, quantize_split
from torchside.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, NVFP4BlockScaling
from tests.torchside.quantized_math64 import (
    CONFIG,
    RECIPES,
    TOLERANCE,
    QuantizedMath64,
    relative_error,
)

GROUPS, IN, OUT = 4, 64, 96
SPLITS = (5, 0, 19, 40)
BLOCK_SPLITS = (32, 0, 64, 32)  # MXFP8 / NVFP4: wgrad blocks run along each group's rows


def _splits(recipe) -> tuple[int, ...]:
    return BLOCK_SPLITS if isinstance(recipe, MXFP8BlockScaling | NVFP4BlockScaling) else SPLITS


def _module(dtype: torch.dtype, **kwargs) -> GroupedLinear:
    torch.manual_seed(0)
    module = GroupedLinear(GROUPS, IN, OUT, params_dtype=dtype, init_method=lambda w: w.normal_(0, 0.1), config=CONFIG)
    with torch.no_grad():
        for g in range(GROUPS):
            getattr(module, f"bias{g}").normal_(0, 0.1)
    return module


def check_grouped_against_float64(recipe_name: str, dtype: torch.dtype, device: str = "cpu") -> None:
    """One FP8 step of the module and of the float64 model, group by group; every relative error within tolerance."""
    recipe = RECIPES[recipe_name]
    splits = _splits(recipe)
    module = _module(dtype).to(device)
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(sum(splits), IN, generator=generator).to(dtype)
    dy = torch.randn(sum(splits), OUT, generator=generator).to(dtype)
    if isinstance(recipe, DelayedScaling):  # a first step fills the histories: the checked step has real scales
        with fp8_autocast(recipe=recipe):
            module(x.to(device), splits).float().square().sum().backward()
        module.zero_grad()
    math = QuantizedMath64(recipe, module, dtype)
    params64 = {name: p.detach().cpu().double().requires_grad_() for name, p in module.named_parameters()}
    x_module = x.to(device, copy=True).requires_grad_()
    with fp8_autocast(recipe=recipe):
        y = module(x_module, splits)
    y.backward(dy.to(device))
    x64 = x.double().requires_grad_()
    parts64 = []
    for g, part in enumerate(x64.split(splits)):
        w, b = params64[f"weight{g}"], params64[f"bias{g}"]
        parts64.append(math.linear(part, w, b, g) if len(part) else part @ w.T + b)  # nothing to quantize when empty
    y64 = torch.cat(parts64)
    y64.backward(dy.double())

    errors = {
        "y": relative_error(y.detach().cpu(), y64.detach()),
        "dx": relative_error(x_module.grad.cpu(), x64.grad),
    }
    for name, param in module.named_parameters():
        if splits[int(name.removeprefix("weight").removeprefix("bias"))] == 0:
            assert torch.equal(param.grad, torch.zeros_like(param.grad)), f"{name} of an empty group has a gradient"
        else:
            errors[f"d{name}"] = relative_error(param.grad.cpu(), params64[name].grad)
    tolerance = TOLERANCE[torch.device(device).type, dtype]
    failed = {name: f"{error:.2e}" for name, error in errors.items() if not error <= tolerance}
    assert not failed, f"GroupedLinear/{recipe_name}/{dtype}: relative errors over {tolerance:.1e}: {failed}"


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_fp32_matches_float64_quantized_math(reference_kernels, recipe_name):
    check_grouped_against_float64(recipe_name, torch.float32)


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8"])
def test_bf16_matches_float64_quantized_math(reference_kernels, recipe_name):
    check_grouped_against_float64(recipe_name, torch.bfloat16)


@pytest.mark.parametrize(
    "recipe_name, dtype", [("current", torch.bfloat16), ("delayed", torch.float32), ("block", torch.float32)]
)
def test_grouped_triton_kernel_in_the_interpreter_matches_float64(recipe_name, dtype):
    if backend_for("cpu") is not Backend.INTERPRETER:
        pytest.skip("runs with TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    check_grouped_against_float64(recipe_name, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_cuda_matches_float64_quantized_math(recipe_name):
    fallbacks = sum(FALLBACK_CALLS.values())
    check_grouped_against_float64(recipe_name, torch.bfloat16, device="cuda")
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "a QuantizedTensor op ran on dequantized values"


def _split_quantizers(recipe, group=None) -> list[Quantizer]:
    """One input quantizer per group; DelayedScaling state made different per group (scales, histories)."""
    quantizers = [Quantizer(recipe, "input", amax_reduction_group=group) for _ in SPLITS]
    for g, q in enumerate(quantizers):
        if q.scale is not None:
            q.scale.fill_(2.0 ** (2 * g - 3))
            q.amax_history.copy_(torch.arange(q.amax_history.numel()) * (g + 1.0))
    return quantizers


def _assert_same_storage(got: QuantizedStorage, expected: QuantizedStorage, where: str) -> None:
    assert got.metadata() == expected.metadata() and list(got.buffers()) == list(expected.buffers()), where
    for name, buffer in expected.buffers().items():
        got_buffer = getattr(got, name)
        same_bytes = torch.equal(got_buffer.reshape(-1).view(torch.uint8), buffer.reshape(-1).view(torch.uint8))
        assert got_buffer.shape == buffer.shape and same_bytes, f"{where}: {name}"


def _check_split_matches_each_group(recipe, x: torch.Tensor, group=None, backend=None) -> None:
    """quantize_split == each quantizer's quantize_storage of its group's rows: bytes and DelayedScaling state."""
    quantizers, alone = _split_quantizers(recipe, group), _split_quantizers(recipe, group)
    got = quantize_split(quantizers, x, SPLITS, backend=backend)
    for g, part in enumerate(x.split(SPLITS)):
        _assert_same_storage(got[g], alone[g].quantize_storage(part, backend=backend), f"group {g}")
        if quantizers[g].amax_history is not None:
            assert torch.equal(quantizers[g].amax_history, alone[g].amax_history), f"group {g}: amax_history"


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "block"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_quantize_split_gives_each_groups_quantize_storage(recipe_name, dtype):
    """The Triton split kernel (interpreted) against the per-group path; the block recipe loops over the groups."""
    x = torch.randn(sum(SPLITS), IN, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[: SPLITS[0]] *= 1e3
    x[SPLITS[0] + 3, 7] = float("inf")  # group 2's amax (and history) is inf, its scale 1
    _check_split_matches_each_group(RECIPES[recipe_name], x)


def _split_with_amax_group(rank: int, world_size: int) -> int:
    x = torch.randn(sum(SPLITS), IN, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
    _check_split_matches_each_group(RECIPES["current"], x, dist.group.WORLD, Backend.REFERENCE)
    return rank


def test_quantize_split_all_reduces_every_groups_amax_in_one_collective(monkeypatch):
    """Current scaling with an amax group: the same bytes as reducing group by group, in one all-reduce
    (threads: the Triton interpreter is not thread-safe, so the reference kernels run)."""
    all_reduces, real_all_reduce = [], dist.all_reduce

    def counted_all_reduce(tensor, **kwargs):
        all_reduces.append(tensor.numel())
        return real_all_reduce(tensor, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", counted_all_reduce)
    assert run_threads(_split_with_amax_group, 2) == [0, 1]
    # per rank: quantize_storage's one all-reduce per group, then quantize_split's one for all groups
    assert sorted(all_reduces) == [1] * (2 * len(SPLITS)) + [len(SPLITS)] * 2


def test_quantize_split_refuses_mismatched_quantizers():
    x = torch.randn(sum(SPLITS), IN)
    current = [Quantizer(Float8CurrentScaling(), "input") for _ in SPLITS]
    with pytest.raises(ValueError, match="one quantizer per group"):
        quantize_split(current[:3], x, SPLITS)
    with pytest.raises(ValueError, match="quantizer 2 differs"):
        quantize_split(current[:2] + [Quantizer(Float8CurrentScaling(), "grad")] + current[3:], x, SPLITS)
    with pytest.raises(ValueError, match="sum to x's"):
        quantize_split(current, x, [5, 0, 19, 41])


def test_fp8_step_casts_x_and_dy_in_one_launch_each(monkeypatch):
    """Current scaling, interpreted: x and dy are one cast launch each for all groups; each live group's
    weight is one more (its amax by torch); no separate amax launch."""
    if backend_for("cpu") is not Backend.INTERPRETER:
        pytest.skip("runs with TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)")
    launches, real_launch = collections.Counter(), triton_quantize._launch

    def counted_launch(name, *args, **kwargs):
        launches[name] += 1
        return real_launch(name, *args, **kwargs)

    monkeypatch.setattr(triton_quantize, "_launch", counted_launch)
    module = _module(torch.bfloat16)
    x = torch.randn(sum(SPLITS), IN, dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe=Float8CurrentScaling()):
        y = module(x, SPLITS)
    y.float().sum().backward()
    live = sum(1 for m in SPLITS if m)
    assert dict(launches) == {"tensorwise": 1 + live + 1}


def test_fp8_off_is_one_torch_linear_per_group():
    module = _module(torch.float32)
    x = torch.randn(2, sum(SPLITS) // 2, IN, requires_grad=True)  # leading dims flatten to T rows
    y = module(x, SPLITS)
    parts = x.reshape(-1, IN).split(SPLITS)
    expected = torch.cat(
        [F.linear(part, getattr(module, f"weight{g}"), getattr(module, f"bias{g}")) for g, part in enumerate(parts)]
    )
    assert y.shape == (2, sum(SPLITS) // 2, OUT)
    assert torch.equal(y.reshape(-1, OUT), expected)


def test_delayed_scaling_keeps_one_scale_per_group(reference_kernels):
    """Group 0's inputs are 100x larger: after a step its input scale is ~100x smaller than group 2's."""
    module = _module(torch.float32)
    x = torch.randn(sum(SPLITS), IN)
    x[: SPLITS[0]] *= 100
    with fp8_autocast(recipe=RECIPES["delayed"]):
        module(x, SPLITS).sum().backward()
    input_scales = module.fp8_forward_scale[0::2]  # slot 2g: group g's input
    assert 30 < (input_scales[2] / input_scales[0]).item() < 300
    assert input_scales[1].item() == 1.0  # the empty group saw no amax: its scale stays


def test_fp8_weights_from_quantized_model_init(reference_kernels):
    recipe = Float8CurrentScaling()
    with quantized_model_init(recipe=recipe):
        module = GroupedLinear(GROUPS, IN, OUT, params_dtype=torch.bfloat16)
    assert all(isinstance(getattr(module, f"weight{g}"), QuantizedTensor) for g in range(GROUPS))
    fallbacks = sum(FALLBACK_CALLS.values())
    x = torch.randn(sum(SPLITS), IN, dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        y = module(x, SPLITS)
    y.float().square().sum().backward()
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "a QuantizedTensor op ran on dequantized values"
    assert module.weight3.grad is not None and torch.isfinite(module.weight3.grad.float()).all()
    assert torch.equal(module.weight1.grad, torch.zeros_like(module.weight1.grad))


def test_bad_arguments_raise_with_the_fix(reference_kernels):
    module = _module(torch.float32)
    x = torch.randn(sum(SPLITS), IN)
    for bad in ([5, 0, 19], [5, 0, 19, 41], [5, -1, 20, 40], torch.tensor(SPLITS), [5, False, 19, 40]):
        with pytest.raises(ValueError, match="m_splits"):
            module(x, bad)
    with pytest.raises(ValueError, match=r"x \[\.\.\., 64\]"):
        module(torch.randn(64, 32), SPLITS)
    with pytest.raises(ValueError, match="multiple of 32"), fp8_autocast(recipe=MXFP8BlockScaling()):
        module(x, SPLITS)
    with pytest.raises(ValueError, match="num_gemms"):
        GroupedLinear(0, IN, OUT)
    with pytest.raises(ValueError, match="sequence_parallel=False"):
        GroupedLinear(GROUPS, IN, OUT, config=ModuleConfig(tp_size=2, parallel_mode="column", sequence_parallel=True))
