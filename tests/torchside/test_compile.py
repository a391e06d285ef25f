"""torch.compile of torchside.Linear: no graph breaks, the eager bytes, no recompiles (docs/compile.md).

The compiled runs use the "aot_eager" backend: Dynamo and AOTAutograd trace forward and backward into graphs
of aten ops and our custom ops (fp8kernels.ops), as Inductor does, and run those ops eagerly, so the compiled
result must equal the eager one bit for bit, the bias gradient's fp32 sum included. One test runs Inductor,
which also asserts that every op output has the shape and strides its fake implementation promised.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import torchside
from fp8kernels._backend import Backend, backend_for
from torchside.recipe import Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

RECIPES = {
    "off": None,
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
}
# x [2, 16, IN]: 32 tokens; multiples of 32 (MXFP8's blocks), two 128-blocks along IN, a partial one along OUT
BATCH, SEQUENCE, IN, OUT = 2, 16, 256, 160
TOKENS = BATCH * SEQUENCE


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from nothing and counts its own compiles."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _layer(fp8_weight_recipe=None) -> torchside.Linear:
    """The layer; with a recipe, built under quantized_model_init (its weight an FP8 QuantizedTensor)."""
    torch.manual_seed(0)
    with torchside.quantized_model_init(enabled=fp8_weight_recipe is not None, recipe=fp8_weight_recipe):
        return torchside.Linear(IN, OUT)


def _inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dy) of step `seed`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQUENCE, IN, generator=generator)
    return x, torch.randn(BATCH, SEQUENCE, OUT, generator=generator)


def _step(layer: torchside.Linear, forward, recipe, seed: int) -> tuple[torch.Tensor, ...]:
    """(y, dx, dweight, dbias) of one forward and backward of `forward` (the layer or its compiled twin)."""
    x, dy = _inputs(seed)
    x.requires_grad_()
    layer.zero_grad(set_to_none=True)
    with torchside.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = forward(x)
    y.backward(dy)
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _compiles() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("name", list(RECIPES))
def test_explain_finds_no_graph_break(name):
    layer, recipe = _layer(), RECIPES[name]
    x, _ = _inputs(0)
    with torchside.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        explained = torch._dynamo.explain(layer)(x)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("backend", ["interpreter", "reference"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_forward_and_gradients_equal_eager_bitwise(name, backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "interpreter" else "0")
    assert backend_for("cpu") is Backend(backend)
    recipe = RECIPES[name]
    layer = _layer()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager, traced = _step(layer, layer, recipe, 0), _step(layer, compiled, recipe, 0)
    for what, a, b in zip(("y", "dx", "dweight", "dbias"), eager, traced, strict=True):
        assert torch.equal(a, b), f"{what} differs"


@pytest.mark.parametrize("name", list(RECIPES))
def test_compiled_layer_with_an_fp8_weight_equals_eager_bitwise(name, reference_kernels):
    """The QuantizedTensor parameter enters the graph through __tensor_flatten__ (off: dequantized)."""
    recipe = RECIPES[name]
    layer = _layer(fp8_weight_recipe=recipe or Float8CurrentScaling())
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    eager, traced = _step(layer, layer, recipe, 0), _step(layer, compiled, recipe, 0)
    for what, a, b in zip(("y", "dx", "dweight", "dbias"), eager, traced, strict=True):
        assert torch.equal(a, b), f"{what} differs"


def test_inductor_runs_the_ops_with_the_layouts_their_fakes_promise(monkeypatch):
    """Float8BlockScaling under the interpreter (1x128 scales rows-contiguous, as on the GPU). Inductor asserts
    every op output's size and stride; y, dx and dweight come from our ops: bitwise. Inductor sums the bias
    gradient in its own order: within the fp32 bound of reordering that sum."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer, recipe = _layer(), RECIPES["block"]
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    eager, traced = _step(layer, layer, recipe, 0), _step(layer, compiled, recipe, 0)
    for what, a, b in zip(("y", "dx", "dweight"), eager[:3], traced[:3], strict=True):
        assert torch.equal(a, b), f"{what} differs"
    _, dy = _inputs(0)
    # Any two orders of summing T fp32 terms differ by at most 2 (T - 1) u sum|dy| (u = 2^-24).
    bound = 2 * (TOKENS - 1) * 2.0**-24 * dy.abs().reshape(TOKENS, OUT).sum(dim=0)
    assert torch.all((eager[3] - traced[3]).abs() <= bound)


def test_no_recompile_over_steps_of_one_shape(reference_kernels):
    layer = _layer()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for seed in range(3):
        _step(layer, compiled, Float8CurrentScaling(), seed)  # a new but equal recipe object each step
    assert _compiles() == 1


def test_a_changed_recipe_recompiles_once(reference_kernels):
    layer = _layer()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    current, block = Float8CurrentScaling(), Float8BlockScaling()
    compiles = []
    for recipe in (current, current, block, block, current, None, None):
        _step(layer, compiled, recipe, 0)
        compiles.append(_compiles())
    assert compiles == [1, 1, 2, 2, 2, 3, 3]
