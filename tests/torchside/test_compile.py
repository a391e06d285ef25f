"""torch.compile of Linear, LayerNormLinear and LayerNormMLP: no graph breaks, the eager bytes, no recompiles
(docs/compile.md).

The compiled runs use the "aot_eager" backend: Dynamo and AOTAutograd trace forward and backward into graphs
of aten ops and our custom ops (fp8kernels.ops), as for Inductor, and run those ops eagerly, so the compiled
result must equal the eager one bit for bit, the bias gradients' fp32 sums included. One test runs Inductor,
which also asserts that every op output has the shape and strides its fake implementation promised.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import torchside
from fp8kernels._backend import Backend, backend_for
from torchside.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

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


def test_delayed_scaling_is_refused_by_name_where_a_backward_cannot_update_in_the_graph(reference_kernels):
    layer = torchside.GroupedLinear(2, IN, OUT)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x, _ = _inputs(0, OUT)
    with pytest.raises((NotImplementedError, torch._dynamo.exc.Unsupported), match="GroupedLinear under torch.compile"):
        with torchside.fp8_autocast(recipe=DelayedScaling()):
            compiled(x.reshape(TOKENS, IN).requires_grad_(), [16, 16])


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
