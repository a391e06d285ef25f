"""bridge.compare on user-written torch / NNX pairs (tests/bridge/compare_models.py), FP8 off: a faithful pair
passes, one planted difference in one block of one framework is named (block and stage) by the teacher-forced
checks, and parameters that do not pair up are a ValueError before anything runs."""

from __future__ import annotations

import json

import pytest
import torch
from flax import nnx

import bridge
from bridge.params import SAME, TRANSPOSE, Rule
from tests.bridge.compare_models import JaxBlock, JaxStack, TorchBlock, TorchStack, inputs

WIDTH, DEPTH = 32, 4


def _compare(planted=None, torch_planted=None, **options):
    torch.manual_seed(0)
    torch_model = TorchStack(WIDTH, DEPTH, planted=torch_planted)
    return bridge.compare(torch_model, JaxStack(WIDTH, DEPTH, planted=planted), inputs(WIDTH, seq=16), **options)


def test_a_faithful_pair_passes_every_check():
    report = _compare()
    assert report.passed, report.first_divergence
    stages = {check.stage for check in report.checks}
    assert stages == {"forward", "input_grad", "weight_grad", "end_to_end_forward", "end_to_end_input_grad",
                      "end_to_end_weight_grad"}  # fmt: skip
    names = {check.name for check in report.checks if check.stage == "forward"}
    assert {"blocks.3", "blocks.3.norm", "blocks.3.fc1", "blocks.3.fc2"} <= names
    assert len([c for c in report.checks if c.stage == "weight_grad"]) == 6 * DEPTH
    assert json.loads(json.dumps(report.to_json()))["passed"] is True
    assert "agree" in report.table()


@pytest.mark.parametrize(
    ("planted", "name", "stage"),
    [
        ((2, "epsilon"), "blocks.2.norm", "forward"),  # 1e-4 instead of 1e-5: 4.5e-5 relative at the norm
        ((1, "tanh_gelu"), "blocks.1.act", "forward"),  # its own bound: 2u, no sums inside
        ((3, "dropped_bias"), "blocks.3", "forward"),
        ((0, "transposed_weight"), "blocks.0", "forward"),
        ((2, "scaled_residual"), "blocks.2", "forward"),  # x * (1 + 2^-10)
    ],
)
def test_a_difference_in_one_jax_block_is_named(planted, name, stage):
    report = _compare(planted=planted)
    first = report.first_divergence
    assert (first.name, first.stage) == (name, stage), first
    other_blocks = [c for c in report.checks if c.stage == "forward" and not c.name.startswith(f"blocks.{planted[0]}")]
    assert all(c.passed for c in other_blocks)  # teacher forcing: nothing compounds into the later blocks


def test_an_epsilon_the_end_to_end_check_misses_is_named():
    """The end-to-end distance alone passes: only the block's own check sees it."""
    report = _compare(planted=(2, "epsilon"))
    assert all(c.passed for c in report.checks if c.stage.startswith("end_to_end"))
    assert report.first_divergence.name == "blocks.2.norm"


def test_a_wrong_weight_gradient_in_one_torch_block_is_named():
    report = _compare(torch_planted=(1, "weight_grad"))  # dW of blocks.1.fc1 is 2^-10 off
    first = report.first_divergence
    assert (first.name, first.stage) == ("blocks.1.fc1.weight", "weight_grad"), first
    assert all(c.passed for c in report.checks if c.stage in ("forward", "input_grad"))


def _never_runs(module, args):
    raise AssertionError("compare ran the model before checking its parameters")


def test_a_parameter_without_counterpart_is_a_value_error_naming_it():
    torch_model = TorchStack(WIDTH, 2)
    torch_model.register_forward_pre_hook(_never_runs)
    jax_model = JaxStack(WIDTH, 2)
    del jax_model.blocks[1].fc2.bias
    message = r"'blocks\.1\.fc2\.bias' \[32\] has no JAX counterpart \(closest: blocks\.1\.fc1\.bias"
    with pytest.raises(ValueError, match=message):
        bridge.compare(torch_model, jax_model, inputs(WIDTH, seq=4))


def test_a_misshapen_parameter_is_a_value_error_naming_it():
    torch_model = TorchStack(WIDTH, 2)
    torch_model.register_forward_pre_hook(_never_runs)
    torch_model.blocks[0].fc2 = torch.nn.Linear(2 * WIDTH, WIDTH + 1)
    with pytest.raises(ValueError, match=r"'blocks\.0\.fc2\.weight' \[33, 64\] \(transpose\) should be \[64, 33\]"):
        bridge.compare(torch_model, JaxStack(WIDTH, 2), inputs(WIDTH, seq=4))


def test_params_as_a_dict_or_rules_override_auto():
    torch.manual_seed(0)
    torch_model, jax_model = TorchStack(WIDTH, 1), JaxStack(WIDTH, 1)
    mapping = {"blocks.0.norm.weight": "blocks.0.norm.scale"}  # the rest stays "auto"
    assert bridge.compare(torch_model, jax_model, inputs(WIDTH, seq=4), params=mapping, backward=False).passed
    rules = [
        Rule(r"(.*)\.norm\.weight", 1, r"\1.norm.scale", SAME),
        Rule(r"(.*)\.weight", 2, r"\1.kernel", TRANSPOSE),
        Rule(r".*", None, r"\g<0>", SAME),
    ]
    assert bridge.compare(torch_model, jax_model, inputs(WIDTH, seq=4), params=rules, backward=False).passed
    with pytest.raises(ValueError, match="blocks.0.norm.weight"):
        bridge.compare(torch_model, jax_model, inputs(WIDTH, seq=4), params={"blocks.0.norm.weight": "nowhere"})


def test_bad_arguments_are_type_errors():
    with pytest.raises(TypeError, match="inputs"):
        bridge.compare(TorchStack(WIDTH, 1), JaxStack(WIDTH, 1), [inputs(WIDTH)])
    with pytest.raises(TypeError, match="jax_model"):
        bridge.compare(TorchStack(WIDTH, 1), TorchStack(WIDTH, 1), inputs(WIDTH))
    with pytest.raises(ValueError, match="recipe='fp7'"):
        bridge.compare(TorchStack(WIDTH, 1), JaxStack(WIDTH, 1), inputs(WIDTH), recipe="fp7")


def test_a_recipe_object_is_run_as_given_and_named_by_its_class():
    from bridge.model_compare.recipes import mantissa_bits, resolve
    from twinspec.recipe import DelayedScaling, Format, NVFP4BlockScaling

    recipe = DelayedScaling(amax_history_len=16, fp8_format=Format.E4M3)
    assert resolve(recipe) == ("delayed", recipe)
    assert mantissa_bits(recipe) == (3, 3)  # E4M3 gradients too
    assert mantissa_bits(resolve("current")[1]) == (3, 2)  # HYBRID: E5M2 gradients
    assert resolve(NVFP4BlockScaling())[0] == "nvfp4" and mantissa_bits(NVFP4BlockScaling()) == (1, 1)
    assert resolve("off") == ("off", None)


class _TorchTwice(torch.nn.Module):
    """One block applied twice: each call is checked, its weight gradients summed over both."""

    def __init__(self) -> None:
        super().__init__()
        self.block = TorchBlock(WIDTH, fp8=False)

    def forward(self, x):
        return self.block(self.block(x))


class _JaxTwice(nnx.Module):
    def __init__(self) -> None:
        self.block = JaxBlock(WIDTH, fp8=False, planted=None, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.block(self.block(x))


def test_a_submodule_called_twice_is_checked_per_call():
    torch.manual_seed(0)
    report = bridge.compare(_TorchTwice(), _JaxTwice(), inputs(WIDTH, seq=8))
    assert report.passed, report.first_divergence
    forward = [c.name for c in report.checks if c.stage == "forward" and c.name.startswith("block (")]
    assert forward == ["block (call 1)", "block (call 2)"]
    assert "block.fc1.weight" in {c.name for c in report.checks if c.stage == "weight_grad"}


class _TorchEveryBlock(torch.nn.Module):
    """Returns its output and every block's (the last one twice), as verify's stacks do."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = TorchStack(WIDTH, 2)

    def forward(self, x):
        outputs = []
        for block in self.stack.blocks:
            x = block(x)
            outputs.append(x)
        return x, outputs


class _JaxEveryBlock(nnx.Module):
    def __init__(self) -> None:
        self.stack = JaxStack(WIDTH, 2)

    def __call__(self, x):
        outputs = []
        for block in self.stack.blocks:
            x = block(x)
            outputs.append(x)
        return x, outputs


def test_outputs_that_feed_each_other_pass_their_gradients():
    """The model's cotangents are its dy: torch's hook on block 0's output also sees block 1's backward, and on the
    last output both of its positions' dy (the input gradient was 165% off)."""
    torch.manual_seed(0)
    report = bridge.compare(_TorchEveryBlock(), _JaxEveryBlock(), inputs(WIDTH, seq=16))
    assert report.passed, report.first_divergence
    assert {"output 0", "output 1", "output 2", "input"} <= {check.name for check in report.checks}
