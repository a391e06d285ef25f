"""Non-finite output gradients reach the parameter grads under every recipe, so GradScaler skips the step.

Issue 29, finding 3: the backward casts saturated +-inf to the format's max, so the grads stayed
finite and the optimizer stepped on garbage. Now a non-finite product casts to the format's NaN
code (docs/quantization.md, "Non-finite values"). One bias-free Linear, tiny shapes, the reference
kernels (the kernels' bytes are checked against the reference in tests/kernels).
"""

from __future__ import annotations

import math

import pytest
import torch

from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import Linear
from torchside.quantization import QuantizedTensor
from torchside.recipe import recipe_from_name, recipe_names

BAD_VALUES = {"+inf": math.inf, "-inf": -math.inf, "nan": math.nan}
TOKENS, FEATURES = 32, 32  # MXFP8 blocks are 32 long, along rows and columns


def _weights(module: torch.nn.Module) -> torch.Tensor:
    weight = module.weight
    return (weight.dequantize() if isinstance(weight, QuantizedTensor) else weight.detach()).clone()


# (recipe, FP8 parameters): every recipe with high-precision and with FP8 parameters (none without FP8)
CASES = [(name, fp8) for name in recipe_names() for fp8 in (False, True) if name != "off" or not fp8]


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize(
    "recipe_name, fp8_parameters", CASES, ids=[f"{name}-{'fp8_params' if fp8 else 'hp_params'}" for name, fp8 in CASES]
)
def test_grad_scaler_skips_the_step_for_a_non_finite_output_gradient(recipe_name, fp8_parameters, bad, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # reference kernels: this checks the semantics, not the kernels
    torch.manual_seed(0)
    recipe = recipe_from_name(recipe_name)
    with quantized_model_init(enabled=fp8_parameters, recipe=recipe):
        module = Linear(FEATURES, FEATURES, bias=False)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    before = _weights(module)

    x = torch.randn(TOKENS, FEATURES, requires_grad=True)
    with fp8_autocast(enabled=recipe is not None, recipe=recipe):
        y = module(x)
    output_grad = torch.randn(TOKENS, FEATURES)
    output_grad[3, 5] = BAD_VALUES[bad]  # one element of dL/dy
    scaler.scale((y * output_grad).sum()).backward()
    scaler.step(optimizer)
    scaler.update()

    assert not torch.isfinite(module.weight.grad).all(), "the non-finite output gradient vanished in the cast"
    assert scaler.get_scale() == 2.0**3, "GradScaler did not see the overflow (found_inf)"
    assert torch.equal(_weights(module), before), "the skipped step changed the weights"


@pytest.mark.parametrize("bad", list(BAD_VALUES))
def test_delayed_scaling_refuses_the_non_finite_step_and_keeps_updating_after_it(bad, monkeypatch):
    """The skipped step's amax is not recorded (a kept inf would freeze the grad scale for the whole
    history); the next finite step scales as if the bad one had not happened."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    torch.manual_seed(1)
    recipe = recipe_from_name("delayed")
    module = Linear(FEATURES, FEATURES, bias=False)
    output_grad = torch.randn(TOKENS, FEATURES)

    def backward(grad: torch.Tensor) -> None:
        with fp8_autocast(recipe=recipe):
            y = module(torch.randn(TOKENS, FEATURES))
        (y * grad).sum().backward()

    backward(output_grad)
    scale_after_first = module.fp8_backward_scale.clone()
    bad_grad = 4 * output_grad
    bad_grad[0, 0] = BAD_VALUES[bad]
    backward(bad_grad)
    assert torch.equal(module.fp8_backward_scale, scale_after_first), "the refused step changed the grad scale"
    assert module.fp8_backward_amax_history.isfinite().all(), "the refused amax stayed in the history"
    backward(4 * output_grad)
    amax = float(4 * output_grad.abs().max())  # the history's max: the two finite steps'
    expected = float(torch.tensor(57344.0 / amax, dtype=torch.float32))  # E5M2 grads (HYBRID)
    assert module.fp8_backward_scale.tolist() == [expected]
