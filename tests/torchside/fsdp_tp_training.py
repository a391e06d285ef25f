"""The FSDP x TP training loop of test_fsdp_tp and test_tp_transformer: meshes, shard loading, SGD steps.

Every rank's loss is its tokens' squared error over the global token count, so dy has the
one-process magnitude; the FSDP2 gradient average over the DP ranks is undone by a power-of-2
factor (exact) before SGD with momentum. FP8 weights train on fp32 master shards and are re-cast in
place after each step (`quantize_weight_`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from bridge.layout import from_dtensor
from tests.torchside.tp_stack import H, S
from torchside.autocast import fp8_autocast
from torchside.quantization import QuantizedTensor

STEPS, LR, MOMENTUM = 5, 0.1, 0.9
B = 8  # global batch: 2 columns per rank of 4 DP ranks, so every rank's GEMMs see 32 tokens (MXFP8 tiles)


def build_meshes(shape, names):
    """(world, data-parallel mesh, tp mesh or None, weight mesh: every rank that shards a weight)."""
    world = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_names = tuple(n for n in names if n != "tp")
    tp = world["tp"] if "tp" in names else None
    sharding = (dp_names[-1], "tp") if tp is not None else (dp_names[-1],)
    weight_mesh = world[sharding]._flatten("_".join(sharding)) if len(sharding) > 1 else world[sharding[0]]
    return world, world[dp_names], tp, weight_mesh


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full_value(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The global tensor whose local shard (laid out like `param`) is `values`."""
    if not isinstance(param, DTensor):
        return values
    spec = (param.device_mesh, param.placements)
    return DTensor.from_local(values, *spec, run_check=False, shape=param.shape, stride=param.stride()).full_tensor()


def train(model: nn.Module, batch, recipe, amax_group, dp_size: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """STEPS of SGD with momentum; (global losses, final values: fp32 masters for FP8 weights)."""
    fp8 = {n for n, p in model.named_parameters() if isinstance(local(p), QuantizedTensor)}
    masters = {n: local(p).dequantize(torch.float32) for n, p in model.named_parameters() if n in fp8}
    momenta, losses = {}, []
    for step in range(STEPS):
        x, target = batch(step)
        with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=amax_group):
            y = model(x)
        squared = (y - target).square().sum()
        (squared / (S * B * H)).backward()
        if amax_group is not None:
            dist.all_reduce(squared, group=amax_group)
        losses.append(squared.item())
        with torch.no_grad():
            for name, param in model.named_parameters():
                grad = local(param.grad) * dp_size  # FSDP2 averaged over DP: sum instead (exact)
                momenta[name] = grad if name not in momenta else momenta[name].mul_(MOMENTUM).add_(grad)
                if name in fp8:
                    masters[name].add_(momenta[name], alpha=-LR)
                    module, attribute = name.rsplit(".", 1)
                    model.get_submodule(module).quantize_weight_(attribute, masters[name])
                else:
                    local(param).add_(momenta[name], alpha=-LR)
                param.grad = None
    final = {n: full_value(p, masters[n] if n in fp8 else local(p).detach()) for n, p in model.named_parameters()}
    return losses, final

def load_values(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Give every parameter its shard of the global value (shard map of its placements); FP8 weights are cast."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            selected = values[name]
            if isinstance(param, DTensor):
                selected = selected[from_dtensor(param).selectors(tuple(param.device_mesh.get_coordinate()))]
            if isinstance(local(param), QuantizedTensor):
                module, attribute = name.rsplit(".", 1)
                model.get_submodule(module).quantize_weight_(attribute, selected)
            else:
                local(param).copy_(selected)


def dp_coordinate(world, names) -> tuple[int, int]:
    """(this rank's index among the data-parallel ranks, their count): row-major over the DP dims."""
    dp_dims = [i for i, n in enumerate(names) if n != "tp"]
    coordinate = world.get_coordinate()
    sizes = [world.size(i) for i in dp_dims]
    index = 0
    for dim, size in zip(dp_dims, sizes, strict=True):
        index = index * size + coordinate[dim]
    return index, math.prod(sizes)
