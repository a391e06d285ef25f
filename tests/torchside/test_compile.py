"""torch.compile of every module (Linear, LayerNormLinear, LayerNormMLP, GroupedLinear, DotProductAttention,
MultiheadAttention, TransformerLayer, the Llama): no graph breaks, the eager bytes, no recompiles (docs/compile.md).
The module x recipe grid is under `-m grid`; the default selection runs one case per module.

The compiled runs use the "aot_eager" backend: Dynamo and AOTAutograd trace forward and backward into graphs
of aten ops and our custom ops (fp8kernels.ops), as for Inductor, and run those ops eagerly, so the compiled
result must equal the eager one bit for bit, the bias gradients' fp32 sums included. One test runs Inductor,
which also asserts that every op output has the shape and strides its fake implementation promised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import torchside
from fp8kernels._backend import Backend, backend_for
from torchside.models.llama import LLAMA_CONFIGS, Llama
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = {
    "off": None,
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "delayed": DelayedScaling(),
}
# x [2, 16, IN]: 32 tokens; multiples of 32 (MXFP8's blocks), two 128-blocks along IN, a partial one along OUT
BATCH, SEQUENCE, IN, OUT = 2, 16, 256, 160
TOKENS = BATCH * SEQUENCE
MODULES = {  # name -> a function of params_dtype
    "Linear": lambda dtype: torchside.Linear(IN, OUT, params_dtype=dtype),
    "LayerNormLinear": lambda dtype: torchside.LayerNormLinear(IN, OUT, params_dtype=dtype),
    "LayerNormMLP": lambda dtype: torchside.LayerNormMLP(IN, OUT, params_dtype=dtype),  # [.., IN] -> OUT -> IN
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles from nothing and counts its own compiles."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _module(name: str = "Linear", fp8_weight_recipe=None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The module in `dtype`; with a recipe, built under quantized_model_init (its GEMM weights FP8)."""
    torch.manual_seed(0)
    with torchside.quantized_model_init(enabled=fp8_weight_recipe is not None, recipe=fp8_weight_recipe):
        return MODULES[name](dtype)


def _inputs(seed: int, out_features: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, dy) of step `seed`."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, SEQUENCE, IN, generator=generator)
    return x.to(dtype), torch.randn(BATCH, SEQUENCE, out_features, generator=generator).to(dtype)


def _step(module: torch.nn.Module, forward, recipe, seed: int) -> dict[str, torch.Tensor]:
    """y, dx and every parameter's gradient of one forward and backward of `forward` (the module or its
    compiled twin), in the module's dtype."""
    dtype = next(module.parameters()).dtype
    x, dy = _inputs(seed, IN if isinstance(module, torchside.LayerNormMLP) else OUT, dtype)
    x.requires_grad_()
    module.zero_grad(set_to_none=True)
    with torchside.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = forward(x)
    y.backward(dy)
    return {"y": y.detach(), "dx": x.grad} | {f"d{name}": p.grad for name, p in module.named_parameters()}


def _eager_and_compiled(name: str = "Linear", **options) -> tuple[torch.nn.Module, torch.nn.Module, object]:
    """(eager module, its twin, the twin compiled): two modules, as a stateful recipe changes its module."""
    twin = _module(name, **options)
    return _module(name, **options), twin, torch.compile(twin, fullgraph=True, backend="aot_eager")


def _assert_equal(eager: dict[str, torch.Tensor], compiled: dict[str, torch.Tensor], skip: tuple[str, ...] = ()):
    compiled = {name.replace("_orig_mod.", ""): t for name, t in compiled.items()}  # a compiled submodule's names
    assert list(eager) == list(compiled)
    for what in eager:
        if what not in skip:
            assert torch.equal(eager[what], compiled[what]), f"{what} differs"


def _compiles() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", list(MODULES))
def test_explain_finds_no_graph_break(module, recipe):
    layer, recipe = _module(module), RECIPES[recipe]
    x, _ = _inputs(0, OUT)
    with torchside.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        explained = torch._dynamo.explain(layer)(x.requires_grad_())
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


@pytest.mark.parametrize("backend", ["interpreter", "reference"])
@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("module", list(MODULES))
def test_compiled_forward_and_gradients_equal_eager_bitwise(module, recipe, backend, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1" if backend == "interpreter" else "0")
    assert backend_for("cpu") is Backend(backend)
    eager_layer, layer, compiled = _eager_and_compiled(module)
    recipe = RECIPES[recipe]
    _assert_equal(_step(eager_layer, eager_layer, recipe, 0), _step(layer, compiled, recipe, 0))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compiled_bf16_layer_equals_eager_bitwise(recipe, reference_kernels):
    eager_layer, layer, compiled = _eager_and_compiled(dtype=torch.bfloat16)
    recipe = RECIPES[recipe]
    _assert_equal(_step(eager_layer, eager_layer, recipe, 0), _step(layer, compiled, recipe, 0))


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_compiled_layer_with_an_fp8_weight_equals_eager_bitwise(recipe, reference_kernels):
    """The QuantizedTensor parameter enters the graph through __tensor_flatten__ (off: dequantized)."""
    recipe = RECIPES[recipe]
    eager_layer, layer, compiled = _eager_and_compiled(fp8_weight_recipe=recipe or Float8CurrentScaling())
    _assert_equal(_step(eager_layer, eager_layer, recipe, 0), _step(layer, compiled, recipe, 0))


def test_an_fp8_weight_compiles_with_torch_2_11s_compile_flag(monkeypatch, reference_kernels):
    """torch 2.11 holds torch.compiler.is_compiling() False while Dynamo fakifies the parameters (torch 2.13 sets
    it for the whole compile session): that behaviour, on any torch, still compiles an FP8 weight like eager."""
    monkeypatch.setattr(torch.compiler, "_compile_session_context", contextlib.nullcontext, raising=False)
    recipe = RECIPES["current"]
    eager_layer, layer, compiled = _eager_and_compiled(fp8_weight_recipe=recipe)
    _assert_equal(_step(eager_layer, eager_layer, recipe, 0), _step(layer, compiled, recipe, 0))


def test_inductor_runs_the_ops_with_the_layouts_their_fakes_promise(monkeypatch):
    """Float8BlockScaling under the interpreter (1x128 scales rows-contiguous, as on the GPU). Inductor asserts
    every op output's size and stride; y, dx and dweight come from our ops: bitwise. Inductor sums the bias
    gradient in its own order: within the fp32 bound of reordering that sum."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    layer, recipe = _module(), RECIPES["block"]
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    eager, traced = _step(layer, layer, recipe, 0), _step(layer, compiled, recipe, 0)
    _assert_equal(eager, traced, skip=("dbias",))
    _, dy = _inputs(0, OUT)
    # Any two orders of summing T fp32 terms differ by at most 2 (T - 1) u sum|dy| (u = 2^-24).
    bound = 2 * (TOKENS - 1) * 2.0**-24 * dy.abs().reshape(TOKENS, OUT).sum(dim=0)
    assert torch.all((eager["dbias"] - traced["dbias"]).abs() <= bound)


def test_no_recompile_over_steps_of_one_shape(reference_kernels):
    layer = _module()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    for seed in range(3):
        _step(layer, compiled, Float8CurrentScaling(), seed)  # a new but equal recipe object each step
    assert _compiles() == 1


def test_a_changed_recipe_recompiles_once(reference_kernels):
    layer = _module()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    current, block = Float8CurrentScaling(), Float8BlockScaling()
    compiles = []
    for recipe in (current, current, block, block, current, None, None):
        _step(layer, compiled, recipe, 0)
        compiles.append(_compiles())
    assert compiles == [1, 1, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("module", list(MODULES))
def test_delayed_scaling_state_equals_eager_step_after_step(module, reference_kernels):
    """The amax histories and scales (forward ones updated at the fp8_autocast exit, backward ones in the
    backward graph) and every result equal eager's over three steps, in one compile."""
    eager_layer, compiled_layer, compiled = _eager_and_compiled(module)
    recipe = DelayedScaling()
    for seed in range(3):
        eager, traced = _step(eager_layer, eager_layer, recipe, seed), _step(compiled_layer, compiled, recipe, seed)
        _assert_equal(eager | dict(eager_layer.named_buffers()), traced | dict(compiled_layer.named_buffers()))
    assert eager_layer.fp8_backward_scale.ne(1).all(), "the grad scales were updated"
    assert _compiles() == 1


def test_delayed_scaling_inference_compiles_and_equals_eager_bitwise(reference_kernels):
    """Without gradients the forward records the amaxes and the fp8_autocast exit updates the scales."""
    eager_layer, compiled_layer, compiled = _eager_and_compiled()
    recipe = DelayedScaling()
    for seed in range(3):
        x, _ = _inputs(seed, OUT)
        results = []
        for layer, forward in ((eager_layer, eager_layer), (compiled_layer, compiled)):
            with torch.no_grad(), torchside.fp8_autocast(recipe=recipe):
                results.append({"y": forward(x)} | dict(layer.named_buffers()))
        _assert_equal(*results)
    assert _compiles() == 1


def test_compiled_and_eager_modules_share_a_delayed_scaling_region(reference_kernels):
    """A compiled Linear feeding an eager LayerNormMLP in one fp8_autocast: the region's forward sync updates
    both, the eager module's backward sync its own state, the compiled one's backward graph its own."""

    def model() -> torch.nn.Sequential:
        torch.manual_seed(0)
        return torch.nn.Sequential(torchside.Linear(IN, OUT), torchside.LayerNormMLP(OUT, IN))

    eager, mixed = model(), model()
    mixed[0] = torch.compile(mixed[0], fullgraph=True, backend="aot_eager")
    for seed in range(3):
        _assert_equal(
            _step(eager, eager, DelayedScaling(), seed) | dict(eager.named_buffers()),
            _step(mixed, mixed, DelayedScaling(), seed) | dict(mixed.named_buffers()),
        )


# ----------------------------------------------------------------------------- every module, every recipe

ALL_RECIPES = RECIPES | {"nvfp4": NVFP4BlockScaling()}
# TransformerLayer and MultiheadAttention: hidden 64, 2 heads of 32, FFN 128, [S=16, B=2]: 32 tokens, every GEMM
# dim a multiple of 32 (MXFP8) and 16 (NVFP4). GroupedLinear: 3 groups of 32, 0 (empty) and 32 rows.
HIDDEN, HEADS, FFN, SPLITS = 64, 2, 128, [32, 0, 32]


@dataclass(frozen=True)
class Case:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[torch.Generator], tuple]  # the forward's arguments; its float tensors get gradients


def _hidden(generator: torch.Generator) -> tuple[torch.Tensor]:
    return (torch.randn(SEQUENCE, BATCH, HIDDEN, generator=generator),)


CASES = {
    "Linear": Case(lambda: torchside.Linear(IN, OUT), lambda g: (torch.randn(BATCH, SEQUENCE, IN, generator=g),)),
    "LayerNormLinear": Case(
        lambda: torchside.LayerNormLinear(IN, OUT), lambda g: (torch.randn(BATCH, SEQUENCE, IN, generator=g),)
    ),
    "LayerNormMLP": Case(
        lambda: torchside.LayerNormMLP(IN, OUT), lambda g: (torch.randn(BATCH, SEQUENCE, IN, generator=g),)
    ),
    "GroupedLinear": Case(
        lambda: torchside.GroupedLinear(len(SPLITS), IN, OUT),
        lambda g: (torch.randn(sum(SPLITS), IN, generator=g), SPLITS),
    ),
    "DotProductAttention": Case(  # q [S, B, N, H], GQA: k and v one head
        lambda: torchside.DotProductAttention(HEADS, HIDDEN // HEADS, num_gqa_groups=1),
        lambda g: tuple(torch.randn(SEQUENCE, BATCH, heads, HIDDEN // HEADS, generator=g) for heads in (HEADS, 1, 1)),
    ),
    "MultiheadAttention": Case(lambda: torchside.MultiheadAttention(HIDDEN, HEADS, input_layernorm=True), _hidden),
    "TransformerLayer": Case(
        lambda: torchside.TransformerLayer(HIDDEN, FFN, HEADS, normalization="RMSNorm", activation="swiglu"), _hidden
    ),
    "Llama": Case(  # one layer: the second adds compile time, nothing new
        lambda: Llama(replace(LLAMA_CONFIGS["tiny"], num_layers=1)),
        lambda g: (torch.randint(0, 256, (BATCH, SEQUENCE), generator=g),),
    ),
}
# The default selection's case per new module: (recipe, FP8 parameters)
FAST_CASES = {
    "GroupedLinear": ("delayed", False),  # the grad scales of every group, the empty one's included
    "DotProductAttention": ("off", False),  # no GEMM of ours: fp8_autocast changes nothing in it
    "MultiheadAttention": ("nvfp4", False),  # the NVFP4 op, the Hadamard copies, the stochastic-rounding counter
    "TransformerLayer": ("current", True),
    "Llama": ("block", False),
}


def _case_module(name: str, fp8_weight_recipe=None) -> torch.nn.Module:
    torch.manual_seed(0)
    with torchside.quantized_model_init(enabled=fp8_weight_recipe is not None, recipe=fp8_weight_recipe):
        return CASES[name].build()


def _case_step(name: str, module: torch.nn.Module, forward, recipe, seed: int) -> dict[str, torch.Tensor]:
    """The output, the input and parameter gradients and the buffers after one forward and backward."""
    generator = torch.Generator().manual_seed(seed)
    inputs = [t.requires_grad_() if _differentiable(t) else t for t in CASES[name].inputs(generator)]
    module.zero_grad(set_to_none=True)
    with torchside.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = forward(*inputs)
    y.backward(torch.randn(y.shape, generator=generator))
    grads = {f"d_input{i}": t.grad for i, t in enumerate(inputs) if _differentiable(t)}
    parameter_grads = {f"d{n}": p.grad for n, p in module.named_parameters()}
    return {"y": y.detach()} | grads | parameter_grads | dict(module.named_buffers())


def _differentiable(argument: object) -> bool:
    return torch.is_tensor(argument) and argument.is_floating_point()


def _check_compiles_like_eager(name: str, recipe_name: str, fp8_parameters: bool = False) -> None:
    """explain finds one graph; two steps of the compiled module equal eager's bit for bit (outputs, gradients,
    FP8 state) in one compile."""
    recipe = ALL_RECIPES[recipe_name]
    weights = (recipe or Float8CurrentScaling()) if fp8_parameters else None
    probe = _case_module(name, weights)
    with torchside.fp8_autocast(enabled=recipe is not None, recipe=recipe):
        explained = torch._dynamo.explain(probe)(*CASES[name].inputs(torch.Generator().manual_seed(0)))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    counters.clear()
    eager, twin = _case_module(name, weights), _case_module(name, weights)
    compiled = torch.compile(twin, fullgraph=True, backend="aot_eager")
    for seed in range(2):
        _assert_equal(_case_step(name, eager, eager, recipe, seed), _case_step(name, twin, compiled, recipe, seed))
    assert _compiles() == 1


@pytest.mark.parametrize("module", list(FAST_CASES))
def test_module_compiles_without_breaks_and_equals_eager_bitwise(module, reference_kernels):
    _check_compiles_like_eager(module, *FAST_CASES[module])


@pytest.mark.grid
@pytest.mark.parametrize("recipe", list(ALL_RECIPES))
@pytest.mark.parametrize("module", list(CASES))
def test_every_module_and_recipe_compiles_like_eager(module, recipe, reference_kernels):
    _check_compiles_like_eager(module, recipe)


@pytest.mark.grid
@pytest.mark.parametrize("recipe", list(ALL_RECIPES))
def test_transformer_layer_with_fp8_parameters_compiles_like_eager(recipe, reference_kernels):
    _check_compiles_like_eager("TransformerLayer", recipe, fp8_parameters=True)


def test_inductor_runs_grouped_linear_with_the_layouts_its_ops_promise(monkeypatch):
    """The list ops under Inductor, on the interpreter (the Triton split cast's and grouped launch's layouts, as on
    the GPU), DelayedScaling: bitwise but for the bias gradients, which Inductor sums in its own order, each
    within the bound of reordering its group's sum (as for Linear)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    eager, twin = _case_module("GroupedLinear"), _case_module("GroupedLinear")
    compiled = torch.compile(twin, fullgraph=True, backend="inductor")
    recipe = DelayedScaling()
    expected = _case_step("GroupedLinear", eager, eager, recipe, 0)
    traced = _case_step("GroupedLinear", twin, compiled, recipe, 0)
    biases = [f"dbias{g}" for g in range(len(SPLITS))]
    _assert_equal(expected, traced, skip=tuple(biases))
    generator = torch.Generator().manual_seed(0)
    CASES["GroupedLinear"].inputs(generator)  # _case_step's draws: the inputs, then dy
    dy_groups = torch.randn(expected["y"].shape, generator=generator).split(SPLITS)
    for name, dy in zip(biases, dy_groups, strict=True):
        bound = 2 * max(dy.shape[0] - 1, 0) * 2.0**-24 * dy.abs().sum(dim=0)
        assert torch.all((expected[name] - traced[name]).abs() <= bound), name
