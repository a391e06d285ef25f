"""FusedAdam on FP8/FP4 weights of every recipe, one process and sharded: the runs that test_fused_adam_fp8
and test_fused_adam_distributed compare (the module docstring of test_fused_adam_fp8 says why they must agree).

Sharded runs (FSDP(2) and FSDP(2) x TP(2)) step on shards of the same global grads as one process.
"""

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bridge.layout import from_dtensor
from fp8kernels._backend import Backend
from tests.torchside.fsdp_tp_training import build_meshes
from torchside.autocast import quantized_model_init
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


def train(rank, world_size, mesh_shape):
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


def train_sharded(rank, world_size):
    """`train` on FSDP(world_size) (2 ranks) or FSDP(2) x TP(2) (4 ranks)."""
    return train(rank, world_size, (2,) if world_size == 2 else (2, 2))


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
