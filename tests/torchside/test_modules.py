"""Modules with FP8 off match torch.nn; construction, meta init, FP8 parameters, state dicts, argument checks.

The norms run through fp8kernels.norm (the Triton interpreter on CPU, as in CI).
"""

from __future__ import annotations

import gc
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bridge.numerics import relative_error
from torchside.autocast import fp8_autocast, fp8_model_init, quantized_model_init
from torchside.modules import (
    ACTIVATIONS,
    GroupedLinear,
    LayerNorm,
    LayerNormLinear,
    LayerNormMLP,
    Linear,
    ModuleConfig,
    RMSNorm,
    clear_high_precision_init_val,
    high_precision_init_val,
)
from torchside.modules.base import resized_amax_history
from torchside.quantization import FALLBACK_CALLS, QuantizedTensor
from torchside.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling

HIDDEN, FFN = 64, 96


# FP8 off, fp32: the norm kernel and torch both reduce H = 64 terms in fp32 in different orders,
# so results differ by at most ~H * 2^-24 = 2^-18 relative; the GEMMs are the same torch call.
FP32_ROUNDING = 2**-18


def _torch_norm(normalization: str, hidden: int) -> nn.Module:
    return nn.LayerNorm(hidden, eps=1e-5) if normalization == "LayerNorm" else nn.RMSNorm(hidden, eps=1e-5)


def _copy_norm(ours: nn.Module, theirs: nn.Module, prefix: str, zero_centered: bool = False) -> None:
    with torch.no_grad():
        getattr(ours, f"{prefix}weight").normal_(0.0 if zero_centered else 1.0, 0.1)
        theirs.weight.copy_(getattr(ours, f"{prefix}weight") + (1.0 if zero_centered else 0.0))
        if getattr(ours, f"{prefix}bias", None) is not None:
            getattr(ours, f"{prefix}bias").normal_(0.0, 0.1)
            theirs.bias.copy_(getattr(ours, f"{prefix}bias"))


def _copy_linear(weight, bias, theirs: nn.Linear) -> None:
    with torch.no_grad():
        if bias is not None:
            bias.normal_(0.0, 0.1)
            theirs.bias.copy_(bias)
        theirs.weight.copy_(weight)


def _compare(ours: nn.Module, theirs: nn.Module, pairs: dict[str, str], tolerance: float) -> None:
    """Same input and output gradient through both; outputs, dx and the paired parameter grads agree."""
    x = torch.randn(2, 16, HIDDEN)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ours, y_theirs = ours(x_ours), theirs(x_theirs)
    dy = torch.randn_like(y_theirs)
    y_ours.backward(dy)
    y_theirs.backward(dy)
    assert relative_error(y_ours, y_theirs) <= tolerance
    assert relative_error(x_ours.grad, x_theirs.grad) <= tolerance
    for our_name, their_name in pairs.items():
        ours_grad, theirs_grad = ours.get_parameter(our_name).grad, theirs.get_parameter(their_name).grad
        assert relative_error(ours_grad, theirs_grad) <= tolerance, our_name


def test_linear_without_fp8_is_torch_linear():
    ours, theirs = Linear(HIDDEN, FFN), nn.Linear(HIDDEN, FFN)
    _copy_linear(ours.weight, ours.bias, theirs)
    _compare(ours, theirs, {"weight": "weight", "bias": "bias"}, tolerance=0.0)  # the same F.linear call


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("zero_centered_gamma", [False, True])
def test_norm_without_fp8_matches_torch(normalization, zero_centered_gamma):
    module = {"LayerNorm": LayerNorm, "RMSNorm": RMSNorm}[normalization]
    ours, theirs = module(HIDDEN, zero_centered_gamma=zero_centered_gamma), _torch_norm(normalization, HIDDEN)
    _copy_norm(ours, theirs, "", zero_centered_gamma)
    pairs = {"weight": "weight"} | ({"bias": "bias"} if normalization == "LayerNorm" else {})
    _compare(ours, theirs, pairs, FP32_ROUNDING)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_without_fp8_matches_torch(normalization):
    ours = LayerNormLinear(HIDDEN, FFN, normalization=normalization)
    theirs = nn.Sequential(_torch_norm(normalization, HIDDEN), nn.Linear(HIDDEN, FFN))
    _copy_norm(ours, theirs[0], "layer_norm_")
    _copy_linear(ours.weight, ours.bias, theirs[1])
    pairs = {"layer_norm_weight": "0.weight", "weight": "1.weight", "bias": "1.bias"}
    pairs |= {"layer_norm_bias": "0.bias"} if normalization == "LayerNorm" else {}
    _compare(ours, theirs, pairs, FP32_ROUNDING)


def _tanh_gelu(x):
    return F.gelu(x, approximate="tanh")


# The plain MLP's activations, written from TransformerEngine's definitions (gated: f(first half) * second half).
PLAIN_ACTIVATIONS = {
    "gelu": _tanh_gelu,
    "relu": F.relu,
    "silu": F.silu,
    "qgelu": lambda x: x * torch.sigmoid(1.702 * x),
    "srelu": lambda x: F.relu(x) ** 2,
}
PLAIN_GATED = {"geglu": "gelu", "reglu": "relu", "swiglu": "silu", "qgeglu": "qgelu", "sreglu": "srelu"}


class PlainMLP(nn.Module):
    def __init__(self, normalization: str, activation: str) -> None:
        super().__init__()
        gated = activation in PLAIN_GATED
        self.norm = _torch_norm(normalization, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 2 * FFN if gated else FFN)
        self.fc2 = nn.Linear(FFN, HIDDEN)
        self.activation = activation

    def forward(self, x):
        h = self.fc1(self.norm(x))
        if self.activation in PLAIN_GATED:
            gate, linear = h[..., 0::2], h[..., 1::2]  # fc1's rows alternate gate, up
            return self.fc2(PLAIN_ACTIVATIONS[PLAIN_GATED[self.activation]](gate) * linear)
        return self.fc2(PLAIN_ACTIVATIONS[self.activation](h))


def test_every_activation_has_a_plain_counterpart():
    assert set(ACTIVATIONS) == set(PLAIN_ACTIVATIONS) | set(PLAIN_GATED)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_layernorm_mlp_without_fp8_matches_plain_mlp(activation):
    normalization = "RMSNorm" if activation in ("swiglu", "srelu") else "LayerNorm"
    ours = LayerNormMLP(HIDDEN, FFN, activation=activation, normalization=normalization)
    theirs = PlainMLP(normalization, activation)
    _copy_norm(ours, theirs.norm, "layer_norm_")
    _copy_linear(ours.fc1_weight, ours.fc1_bias, theirs.fc1)
    _copy_linear(ours.fc2_weight, ours.fc2_bias, theirs.fc2)
    pairs = {"layer_norm_weight": "norm.weight", "fc1_weight": "fc1.weight", "fc1_bias": "fc1.bias"}
    pairs |= {"fc2_weight": "fc2.weight", "fc2_bias": "fc2.bias"}
    pairs |= {"layer_norm_bias": "norm.bias"} if normalization == "LayerNorm" else {}
    _compare(ours, theirs, pairs, FP32_ROUNDING)


@pytest.mark.parametrize("build", [Linear, LayerNormMLP], ids=lambda cls: cls.__name__)
def test_return_bias_leaves_the_bias_to_the_caller(build):
    module = build(HIDDEN, FFN, return_bias=True)
    x = torch.randn(8, HIDDEN)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_()
        y, bias = module(x)
        module.return_bias = False
        assert torch.allclose(y + bias, module(x), rtol=1e-6, atol=1e-5)


# ---- construction: meta device, FP8 parameters


BUILDERS = {
    "linear": lambda device: Linear(HIDDEN, FFN, device=device),
    "layernorm_linear": lambda device: LayerNormLinear(HIDDEN, FFN, normalization="RMSNorm", device=device),
    "layernorm_mlp": lambda device: LayerNormMLP(HIDDEN, FFN, activation="swiglu", device=device),
    "layernorm": lambda device: LayerNorm(HIDDEN, zero_centered_gamma=True, device=device),
}


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if isinstance(a, QuantizedTensor) or isinstance(b, QuantizedTensor):
        buffers_a, buffers_b = a.quantized_storage.buffers(), b.quantized_storage.buffers()
        return buffers_a.keys() == buffers_b.keys() and all(torch.equal(buffers_a[k], buffers_b[k]) for k in buffers_a)
    return torch.equal(a, b)


def _assert_same_state(a: nn.Module, b: nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    unequal = [k for k in state_a if not _tensors_equal(state_a[k], state_b[k])]
    assert not unequal, f"differ: {unequal}"


@pytest.mark.parametrize("fp8_parameters", [False, True])
@pytest.mark.parametrize("name", BUILDERS)
def test_meta_init_then_reset_parameters_equals_direct_init(name, fp8_parameters):
    def build(device):
        torch.manual_seed(7)
        with quantized_model_init(enabled=fp8_parameters, recipe=Float8CurrentScaling()):
            return BUILDERS[name](device)

    direct, deferred = build("cpu"), build("meta")
    assert all(p.is_meta for p in deferred.parameters())
    with pytest.raises(ValueError, match="to_empty"):
        deferred.reset_parameters()
    deferred.to_empty(device="cpu")
    torch.manual_seed(7)
    deferred.reset_parameters()
    _assert_same_state(direct, deferred)


def _gemm_weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in module.named_parameters() if p.dim() == 2}


@pytest.mark.parametrize(
    "recipe", [DelayedScaling(), Float8CurrentScaling(), Float8BlockScaling(), MXFP8BlockScaling()], ids=type
)
def test_quantized_model_init_holds_only_fp8_weights(recipe):
    with quantized_model_init(recipe=recipe):
        module = LayerNormMLP(HIDDEN, FFN)
    weights = _gemm_weights(module)
    assert set(weights) == {"fc1_weight", "fc2_weight"}
    assert all(isinstance(w, QuantizedTensor) for w in weights.values())
    assert all(high_precision_init_val(w) is None for w in weights.values())
    # No high-precision copy anywhere: every other tensor is a 1-D parameter or the fp32 scaling state.
    others = {n: t for n, t in module.state_dict().items() if n not in weights}
    assert all(t.dim() == 1 or n.startswith("fp8_") for n, t in others.items())
    for name, weight in weights.items():  # rowwise + columnwise FP8 bytes plus the scales: ~2 bytes per value
        stored = sum(b.numel() * b.element_size() for b in weight.quantized_storage.buffers().values())
        assert stored <= 2.1 * weight.numel(), name


def test_delayed_scaling_fp8_weights_take_their_first_scale_from_the_weight():
    with quantized_model_init(recipe=DelayedScaling()):
        module = Linear(HIDDEN, FFN)
    storage = module.weight.quantized_storage
    # scale_inv = 1 / fp32(448 / amax): within two fp32 roundings of amax / 448 (not 1, the empty history's scale)
    assert storage.rowwise_scale_inv.item() == pytest.approx(storage.tensor_amax.item() / 448.0, rel=2**-22)


def test_preserved_high_precision_init_value_is_the_plain_init():
    torch.manual_seed(3)
    plain = Linear(HIDDEN, FFN)
    torch.manual_seed(3)
    with quantized_model_init(recipe=Float8CurrentScaling(), preserve_high_precision_init_val=True):
        quantized = Linear(HIDDEN, FFN)
    kept = high_precision_init_val(quantized.weight)
    assert kept.device.type == "cpu" and torch.equal(kept, plain.weight.detach())
    clear_high_precision_init_val(quantized.weight)
    assert high_precision_init_val(quantized.weight) is None


def test_fp8_model_init_is_quantized_model_init_under_transformer_engines_older_name():
    torch.manual_seed(3)
    plain = Linear(HIDDEN, FFN)
    torch.manual_seed(3)
    with quantized_model_init(recipe=Float8CurrentScaling()):
        quantized = Linear(HIDDEN, FFN)
    torch.manual_seed(3)
    with fp8_model_init(enabled=True, recipe=Float8CurrentScaling(), preserve_high_precision_init_val=True):
        te_spelled = Linear(HIDDEN, FFN)
    with fp8_model_init(enabled=False):
        off = Linear(HIDDEN, FFN)
    assert isinstance(te_spelled.weight, QuantizedTensor) and type(off.weight) is nn.Parameter
    got, want = te_spelled.weight.quantized_storage.buffers(), quantized.weight.quantized_storage.buffers()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert torch.equal(high_precision_init_val(te_spelled.weight), plain.weight.detach())
    with pytest.raises(TypeError, match=r"fp8_model_init\(enabled=1\)"), fp8_model_init(enabled=1):
        pass


def test_fp8_weights_compute_what_high_precision_weights_do():
    """Current scaling casts the weight alike whether it is stored in FP8 or cast per forward."""
    torch.manual_seed(5)
    plain = LayerNormMLP(HIDDEN, FFN)
    torch.manual_seed(5)
    with quantized_model_init(recipe=Float8CurrentScaling()):
        quantized = LayerNormMLP(HIDDEN, FFN)
    x = torch.randn(32, HIDDEN)
    x_plain, x_quantized = x.clone().requires_grad_(), x.clone().requires_grad_()
    with fp8_autocast(recipe=Float8CurrentScaling()):
        y_plain, y_quantized = plain(x_plain), quantized(x_quantized)
    torch.testing.assert_close(y_quantized, y_plain, rtol=0, atol=0)
    y_plain.sum().backward()
    y_quantized.sum().backward()
    torch.testing.assert_close(x_quantized.grad, x_plain.grad, rtol=0, atol=0)
    for name, weight in _gemm_weights(quantized).items():
        assert type(weight.grad) is torch.Tensor
        torch.testing.assert_close(weight.grad, plain.get_parameter(name).grad, rtol=0, atol=0)


@pytest.mark.parametrize("recipe", [DelayedScaling(), Float8BlockScaling(), MXFP8BlockScaling()], ids=type)
def test_fp8_weights_train_under_their_recipe(recipe, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # reference kernels: this checks the plumbing, not the kernels
    fallbacks = sum(FALLBACK_CALLS.values())
    with quantized_model_init(recipe=recipe):
        module = LayerNormMLP(HIDDEN, FFN)
    x = torch.randn(32, HIDDEN, requires_grad=True)
    with fp8_autocast(recipe=recipe):
        y = module(x)
    y.square().sum().backward()
    grads = [x.grad] + [p.grad for p in module.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert sum(FALLBACK_CALLS.values()) == fallbacks


def test_frozen_weights_and_inputs_without_grad_still_backpropagate():
    module = LayerNormMLP(HIDDEN, FFN)
    module.fc1_weight.requires_grad_(False)  # its wgrad is skipped, and x's columnwise copy is not kept
    x = torch.randn(32, HIDDEN)  # no dgrad into x
    with fp8_autocast(recipe=Float8CurrentScaling()):
        y = module(x)
    y.square().sum().backward()
    assert module.fc1_weight.grad is None and module.fc2_weight.grad.abs().sum() > 0
    assert module.layer_norm_weight.grad.abs().sum() > 0


def test_nested_quantized_model_init_inherits_or_switches_off():
    with quantized_model_init(recipe=Float8BlockScaling()):
        with quantized_model_init():
            inherited = Linear(HIDDEN, FFN)
        with quantized_model_init(enabled=False):
            plain = Linear(HIDDEN, FFN)
    assert inherited.weight.quantized_storage.scheme == "block128x128"
    assert type(plain.weight) is nn.Parameter


def test_fp8_weights_without_fp8_use_their_dequantized_values():
    with quantized_model_init(recipe=Float8CurrentScaling()):
        module = Linear(HIDDEN, FFN)
    x = torch.randn(8, HIDDEN)
    y = module(x)
    assert torch.equal(y, F.linear(x, module.weight.dequantize(), module.bias))
    y.sum().backward()
    assert torch.equal(module.weight.grad, torch.ones(8, FFN).T @ x)


# ---- state dicts: tensors only, fixed keys and shapes, round trips


def _train_steps(module: nn.Module, recipe, steps: int = 3) -> None:
    for step in range(steps):
        with fp8_autocast(recipe=recipe):
            y = module(torch.randn(32, HIDDEN) * (step + 1))
        y.square().sum().backward()


def test_state_dict_is_plain_tensors_with_the_same_keys_and_shapes_for_every_recipe():
    config = ModuleConfig(amax_history_len=4)
    shapes = {}
    for recipe in (DelayedScaling(amax_history_len=4), Float8CurrentScaling(), Float8BlockScaling()):
        module = LayerNormMLP(HIDDEN, FFN, config=config)
        _train_steps(module, recipe)
        state = module.state_dict()
        assert all(type(v) is torch.Tensor for v in state.values())
        assert not any(k.endswith("_extra_state") for k in state)
        shapes[type(recipe).__name__] = {k: tuple(v.shape) for k, v in state.items()}
    assert len({tuple(s.items()) for s in shapes.values()}) == 1
    assert shapes["DelayedScaling"]["fp8_forward_amax_history"] == (4, 4)
    assert shapes["DelayedScaling"]["fp8_backward_amax_history"] == (4, 2)


def _round_trip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_state_dict_round_trip_restores_delayed_scaling_state_and_outputs():
    recipe = DelayedScaling(amax_history_len=4)
    config = ModuleConfig(amax_history_len=4)
    trained = LayerNormLinear(HIDDEN, FFN, config=config)
    _train_steps(trained, recipe)
    assert (trained.fp8_forward_amax_history > 0).any() and (trained.fp8_backward_scale != 1).any()
    restored = LayerNormLinear(HIDDEN, FFN, config=config)
    restored.load_state_dict(_round_trip(trained.state_dict()))
    _assert_same_state(trained, restored)
    x = torch.randn(32, HIDDEN)
    with fp8_autocast(recipe=recipe):
        assert torch.equal(trained(x), restored(x))


def test_fp8_weights_round_trip_and_load_across_kinds():
    torch.manual_seed(11)
    with quantized_model_init(recipe=Float8CurrentScaling()):
        quantized = Linear(HIDDEN, FFN)
    state = _round_trip(quantized.state_dict())
    assert isinstance(state["weight"], QuantizedTensor)
    with quantized_model_init(recipe=Float8CurrentScaling()):
        restored = Linear(HIDDEN, FFN)
    restored.load_state_dict(state)
    _assert_same_state(quantized, restored)

    plain = Linear(HIDDEN, FFN)  # FP8 checkpoint -> high-precision weight: the dequantized values
    plain.load_state_dict(state)
    assert torch.equal(plain.weight, quantized.weight.dequantize())
    with quantized_model_init(recipe=Float8CurrentScaling()):  # and back: the same codes again
        requantized = Linear(HIDDEN, FFN)
    requantized.load_state_dict(plain.state_dict())
    before, after = quantized.weight.quantized_storage, requantized.weight.quantized_storage
    assert torch.equal(before.rowwise_data, after.rowwise_data)
    # the amax of dequantized values is 448 * scale_inv rounded, so the new scale_inv is within 2 ulps
    torch.testing.assert_close(after.rowwise_scale_inv, before.rowwise_scale_inv, rtol=2**-22, atol=0)


# ---- argument checks


@pytest.mark.parametrize(
    "build, error, match",
    [
        (lambda: Linear(0, 4), ValueError, "in_features=0"),
        (lambda: Linear(4, 4, params_dtype=torch.float16), TypeError, "params_dtype"),
        (lambda: Linear(4, 4, config={"tp_size": 2}), TypeError, "ModuleConfig"),
        (lambda: LayerNormLinear(4, 4, config=ModuleConfig(parallel_mode="row")), ValueError, "'column'"),
        (lambda: LayerNormMLP(4, 4, config=ModuleConfig(parallel_mode="column")), ValueError, "leave it None"),
        (lambda: Linear(4, 6, config=ModuleConfig(tp_size=4, parallel_mode="column")), ValueError, "multiple of 4"),
        (lambda: Linear(4, 4, config=ModuleConfig(tp_size=2, sequence_parallel=True)), ValueError, "must be split"),
        (lambda: LayerNormMLP(4, 6, activation="swiglu", config=ModuleConfig(tp_size=4)), ValueError, "fc2_weight"),
        (lambda: ModuleConfig(parallel_mode="diagonal"), ValueError, "parallel_mode"),
        (lambda: ModuleConfig(tp_size=0), ValueError, "tp_size"),
        (lambda: ModuleConfig(amax_history_len=0), ValueError, "amax_history_len"),
        (lambda: LayerNormLinear(4, 4, normalization="BatchNorm"), ValueError, "normalization"),
        (lambda: LayerNorm(4, eps=-1.0), ValueError, "eps"),
        (lambda: LayerNormMLP(4, 4, activation="tanh"), ValueError, "activation"),
        (lambda: fp8_autocast(recipe="fp8").__enter__(), TypeError, "recipe"),
        (lambda: quantized_model_init(enabled=1).__enter__(), TypeError, "enabled"),
    ],
)
def test_bad_arguments_say_what_to_do(build, error, match):
    with pytest.raises(error, match=match):
        build()


def test_delayed_scaling_history_length_comes_from_the_recipe_unless_the_config_sets_one():
    """TransformerEngine's DelayedScaling(amax_history_len=2) sizes the amax window; a ModuleConfig length wins."""
    from_recipe, fixed = Linear(HIDDEN, FFN), Linear(HIDDEN, FFN, config=ModuleConfig(amax_history_len=8))
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for factor in (8.0, 4.0, 2.0):  # input amaxes 8a, 4a, 2a in three steps
            with fp8_autocast(recipe=DelayedScaling(amax_history_len=2)):
                from_recipe(x * factor), fixed(x * factor)
    amax = x.abs().max()
    assert from_recipe.fp8_forward_amax_history.shape == (2, 2) and from_recipe.fp8_backward_amax_history.shape == (2, 1)
    assert fixed.fp8_forward_amax_history.shape == (8, 2)
    # the input's scale after step 3: E4M3's 448 over the max of the window's amaxes (steps 2 and 3, or all three)
    assert from_recipe.fp8_forward_scale[0] == torch.tensor(448.0) / (4 * amax)
    assert fixed.fp8_forward_scale[0] == torch.tensor(448.0) / (8 * amax)


def test_a_resized_amax_history_keeps_this_step_and_the_newest_past_rows():
    # rows: 0 is this step's, then past steps from the oldest (1) to the newest (3), as the update rolls them
    history = torch.tensor([[10.0], [1.0], [2.0], [3.0]])
    assert resized_amax_history(history, 2).flatten().tolist() == [10.0, 3.0]
    assert resized_amax_history(history, 1).flatten().tolist() == [10.0]
    assert resized_amax_history(history, 6).flatten().tolist() == [10.0, 0.0, 0.0, 1.0, 2.0, 3.0]


def test_fp8_linear_refuses_float16_activations():
    with pytest.raises(TypeError, match="float16"):
        with fp8_autocast(recipe=Float8CurrentScaling()):
            Linear(HIDDEN, FFN)(torch.randn(4, HIDDEN, dtype=torch.float16))


@pytest.mark.parametrize("grouped", [False, True], ids=["Linear", "GroupedLinear"])
def test_fp8_copies_saved_for_backward_are_freed_when_the_backward_ends(grouped):
    """Custom autograd ctx attributes live as long as the graph (the output holds it): the FP8 input and
    weight copies must be dropped by the backward itself, or they stay allocated until `y` is deleted."""
    if grouped:
        layer, m_splits = GroupedLinear(2, HIDDEN, FFN, params_dtype=torch.bfloat16), [16, 16]
    else:
        layer, m_splits = Linear(HIDDEN, FFN, params_dtype=torch.bfloat16), None
    x = torch.randn(32, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    with fp8_autocast(recipe=Float8CurrentScaling()):
        y = layer(x, m_splits) if grouped else layer(x)
    saved = [y.grad_fn.x_columnwise, y.grad_fn.w_columnwise]
    saved = [s for copies in saved for s in (copies.values() if grouped else [copies])]
    storages = [weakref.ref(s.columnwise_data.untyped_storage()) for s in saved]
    del saved
    y.backward(torch.randn_like(y))
    gc.collect()  # the Triton interpreter keeps its launch arguments in reference cycles; CUDA does not
    assert [ref() for ref in storages] == [None] * len(storages)
    assert y.grad_fn is not None  # the graph (and y) are still alive: the backward freed them
