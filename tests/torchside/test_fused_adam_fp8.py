"""FusedAdam on FP8/FP4 weights of every recipe: step an fp32 master, re-quantize the weight from it.

The reference keeps fp32 weights, steps them with torch.optim.AdamW on the same grads, and casts
with the pure-torch reference quantizer. Where the arithmetic is the same the bytes must be the
same: the FP8 weight is exactly the reference cast of the optimizer's master (data, scales, amaxes);
the master follows AdamW within fp32 rounding (1e-6 relative).

Sharded runs (FSDP(2) and FSDP(2) x TP(2), on threads here and on gloo processes in
test_fused_adam_distributed) step on shards of the same global grads,
so their masters equal the one-process masters bit for bit, and their weights, gathered, equal the
reference cast of the whole master: every shard carries the whole weight's scale (per-tensor
recipes, amax over the weight mesh) or global amax (NVFP4); blockwise recipes need no reduction.

DelayedScaling FP8 weights are cast with current scaling from the weight itself (the modules do so:
a weight has no amax history, see torchside/modules/base.py), so that is the reference cast too.
"""

import pytest
import torch
from torch import nn

from bridge.numerics import relative_error
from tests.distributed import run_threads
from tests.torchside.fp8_adam_runs import (
    OPTIMIZER,
    RECIPES,
    STEPS,
    assert_equal_to_one_process,
    reference_cast,
    seeded,
    train_sharded,
)
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import Linear, ModuleConfig
from torchside.optim import FusedAdam, requantize_fp8_weights
from torchside.quantization import QuantizedTensor
from torchside.recipe import Float8CurrentScaling


def same_bytes(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    mine, theirs = a.quantized_storage.buffers(), b.quantized_storage.buffers()
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    return mine.keys() == theirs.keys() and all(torch.equal(as_bytes(mine[n]), as_bytes(theirs[n])) for n in mine)


# ---- one process: grads from a real FP8 forward and backward


@pytest.mark.parametrize("recipe_name", RECIPES)
def test_fp8_weight_is_the_reference_cast_of_an_adamw_master(recipe_name):
    recipe = RECIPES[recipe_name]
    with quantized_model_init(recipe=recipe):
        layer = Linear(64, 32, config=ModuleConfig(amax_history_len=4))  # an FP8 weight, an fp32 bias
    optimizer = FusedAdam(layer.parameters(), master_weights=True, **OPTIMIZER)
    requantize_fp8_weights(optimizer, layer)
    weight = layer.weight
    assert isinstance(weight, QuantizedTensor)
    reference_params = [nn.Parameter(weight.dequantize(torch.float32)), nn.Parameter(layer.bias.detach().clone())]
    reference = torch.optim.AdamW(reference_params, **OPTIMIZER)
    x = seeded((32, 64), 0)
    for step in range(STEPS):
        with fp8_autocast(recipe=recipe):
            (layer(x) - seeded((32, 32), 1 + step)).square().mean().backward()
        for mine, theirs in zip(layer.parameters(), reference_params):
            theirs.grad = mine.grad.float().clone()
        optimizer.step()
        reference.step()
        optimizer.zero_grad()
        master = optimizer.state[weight]["master_param"]
        assert same_bytes(weight, reference_cast(recipe, master)), f"step {step}"
    assert relative_error(master, reference_params[0].detach()) < 1e-6
    assert relative_error(layer.bias.detach(), reference_params[1].detach()) < 1e-6


def test_quantized_parameters_need_a_master_and_a_hook():
    with quantized_model_init(recipe=Float8CurrentScaling()):
        layer = Linear(32, 32, bias=False)
    layer.weight.grad = torch.ones(32, 32)
    with pytest.raises(ValueError, match="master_weights=True"):
        FusedAdam(layer.parameters()).step()
    with pytest.raises(ValueError, match="master_weights=True"):
        requantize_fp8_weights(FusedAdam(layer.parameters()), layer)
    optimizer = FusedAdam(layer.parameters(), master_weights=True)
    with pytest.raises(ValueError, match="requantize_fp8_weights"):
        optimizer.step()
    assert not optimizer.state  # refused before any state was made
    requantize_fp8_weights(optimizer, layer)
    before = layer.weight.dequantize()
    optimizer.step()
    assert not torch.equal(layer.weight.dequantize(), before)


# ---- sharded: the same global grads, shard by shard


@pytest.mark.parametrize("world_size", [2, 4], ids=["fsdp2", "fsdp2xtp2"])
def test_sharded_fp8_weights_equal_one_process_bit_for_bit(world_size, fp8_adam_one_process):
    """On threads; test_fused_adam_distributed runs the same on gloo processes (with its DCP test, to share them)."""
    assert_equal_to_one_process(run_threads(train_sharded, world_size), fp8_adam_one_process)
