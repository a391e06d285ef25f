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

import numpy as np
import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bridge.layout import from_dtensor
from kernels._backend import Backend
from tests.distributed import run_threads
from tests.torchside.test_fsdp_tp import build_meshes
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import Linear, ModuleConfig
from torchside.optim import FusedAdam, requantize_fp8_weights
from torchside.parallel import parallelize
from torchside.quantization import QuantizedTensor, Quantizer
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

RECIPES = {
    "delayed": DelayedScaling(amax_history_len=4),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
OPTIMIZER = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
STEPS = 3


def seeded(shape, seed: int, std: float = 1.0) -> torch.Tensor:
    return std * torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def reference_cast(recipe, master: torch.Tensor) -> QuantizedTensor:
    """The pure-torch cast of a whole fp32 weight, as the modules cast FP8 weights (current scaling for delayed)."""
    if isinstance(recipe, DelayedScaling):
        recipe = Float8CurrentScaling(fp8_format=recipe.fp8_format)
    return Quantizer(recipe, "weight").quantize(master, backend=Backend.REFERENCE)


def same_bytes(a: QuantizedTensor, b: QuantizedTensor) -> bool:
    mine, theirs = a.quantized_storage.buffers(), b.quantized_storage.buffers()
    as_bytes = lambda t: t.contiguous().view(torch.uint8)  # noqa: E731
    return mine.keys() == theirs.keys() and all(torch.equal(as_bytes(mine[n]), as_bytes(theirs[n])) for n in mine)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


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
    assert relative(master, reference_params[0].detach()) < 1e-6
    assert relative(layer.bias.detach(), reference_params[1].detach()) < 1e-6


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


def _model(recipe, tp_size: int, tp_mesh) -> nn.Sequential:
    """A column- and a row-parallel weight, [512, 32] and [256, 256] (they do not chain: no forward runs),
    so that every FSDP(2) x TP(2) shard holds whole 128x128 blocks (Float8BlockScaling) and 32-wide tiles."""
    column, row = (ModuleConfig(tp_size=tp_size, parallel_mode=mode, amax_history_len=4) for mode in ("column", "row"))
    with quantized_model_init(recipe=recipe):
        return nn.Sequential(
            Linear(32, 512, bias=False, config=column, tp_mesh=tp_mesh),
            Linear(256, 256, bias=False, config=row, tp_mesh=tp_mesh),
        )


def _shard(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of `full`, laid out like `param` (a DTensor if it is one)."""
    if not isinstance(param, DTensor):
        return full.clone()
    local = full[from_dtensor(param).selectors(tuple(param.device_mesh.get_coordinate()))].contiguous()
    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _gathered(param: torch.Tensor, local: torch.Tensor) -> np.ndarray:
    if isinstance(param, DTensor):
        spec = dict(shape=param.shape, stride=param.stride(), run_check=False)
        local = DTensor.from_local(local, param.device_mesh, param.placements, **spec).full_tensor()
    return local.numpy(force=True)


def _train(rank, world_size, mesh_shape):
    """{recipe: {weight: (fp32 master, dequantized FP8 weight)}} after STEPS on shards of global grads."""
    dp_mesh = tp_mesh = weight_mesh = None
    if mesh_shape is not None:
        names = ("dp",) if len(mesh_shape) == 1 else ("dp", "tp")
        _, dp_mesh, tp_mesh, weight_mesh = build_meshes(mesh_shape, names)
    results = {}
    for index, (recipe_name, recipe) in enumerate(RECIPES.items()):
        model = _model(recipe, 1 if tp_mesh is None else tp_mesh.size(), tp_mesh)
        if dp_mesh is not None:
            parallelize(model, dp_mesh, weight_mesh=weight_mesh)
        params = dict(model.named_parameters())
        for seed, (name, param) in enumerate(params.items()):  # one initial value for every topology
            module, attribute = name.rsplit(".", 1)
            initial = _shard(param, seeded(param.shape, 10 * index + seed, std=0.05))
            model.get_submodule(module).quantize_weight_(attribute, initial.to_local() if dp_mesh else initial)
        optimizer = FusedAdam(model.parameters(), master_weights=True, **OPTIMIZER)
        requantize_fp8_weights(optimizer, model)
        for step in range(STEPS):
            for seed, param in enumerate(params.values()):
                param.grad = _shard(param, seeded(param.shape, 1000 + 10 * step + seed))
            optimizer.step()
        results[recipe_name] = {}
        for name, param in params.items():
            master = optimizer.state[param]["master_param"]
            if isinstance(param, DTensor):
                assert (master.device_mesh, master.placements) == (param.device_mesh, param.placements), name
            local = param.to_local() if isinstance(param, DTensor) else param
            master_local = master.to_local() if isinstance(master, DTensor) else master
            results[recipe_name][name] = (_gathered(param, master_local), _gathered(param, local.dequantize()))
    return results


@pytest.fixture(scope="module")
def reference_kernels():
    """Here, in rank threads and in spawned processes (they inherit it): the pure-torch kernels, which are
    thread-safe (the Triton interpreter is not) and fast on these shapes."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "0")
        yield


@pytest.fixture(scope="module")
def one_process(reference_kernels):
    return _train(0, 1, None)


def train_sharded(rank, world_size):
    """`_train` on FSDP(world_size) (2 ranks) or FSDP(2) x TP(2) (4 ranks)."""
    return _train(rank, world_size, (2,) if world_size == 2 else (2, 2))


@pytest.mark.parametrize("world_size", [2, 4], ids=["fsdp2", "fsdp2xtp2"])
def test_sharded_fp8_weights_equal_one_process_bit_for_bit(world_size, one_process):
    """On threads; test_fused_adam_distributed runs the same on gloo processes (with its DCP test, to share them)."""
    assert_equal_to_one_process(run_threads(train_sharded, world_size), one_process)


def assert_equal_to_one_process(sharded: list[dict], one_process: dict) -> None:
    """Masters bit for bit; weights, gathered, the reference cast of the whole master."""
    for recipe_name, recipe in RECIPES.items():
        for name, (master, weight) in one_process[recipe_name].items():
            expected = reference_cast(recipe, torch.from_numpy(master)).dequantize(torch.float32).numpy()
            assert np.array_equal(weight, expected), f"{recipe_name} {name}: one process"
            for rank, result in enumerate(sharded):
                sharded_master, sharded_weight = result[recipe_name][name]
                assert np.array_equal(sharded_master, master), f"{recipe_name} {name} master on rank {rank}"
                assert np.array_equal(sharded_weight, expected), f"{recipe_name} {name} weight on rank {rank}"
