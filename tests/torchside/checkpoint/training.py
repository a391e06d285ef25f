"""Shared by the checkpoint tests: the model, topologies, a deterministic training loop, gathered state.

The model is test_tensor_parallel's 2-block stack (LayerNormLinear column / Linear row pair and a
LayerNormMLP per block). Training: FusedAdam on the high-precision parameters; FP8 weights (FusedAdam
does not step QuantizedTensors yet) by SGD on their dequantized values, re-cast in place, so their
whole state is their bytes. Every rank's loss is its tokens' squared error over the global token
count times the data-parallel size (a power of 2: FSDP2's gradient average is undone exactly), so
gradients and optimizer states are the same on every topology.

`gathered_state` reads the model and optimizer directly (not through torchside.checkpoint): full
parameters (FP8: rowwise bytes, columnwise bytes, dequantized values), optimizer states by
parameter name, FP8 scaling buffers. numpy arrays, so gloo processes return them by value.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from tests.torchside.test_tensor_parallel import HISTORY, RECIPES, H, S, make_stack, seeded
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import ModuleConfig
from torchside.optim import FusedAdam
from torchside.parallel import parallelize
from torchside.quantization import QuantizedTensor

B = 8  # global batch columns: 2 per rank on 4 data-parallel ranks
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)
FP8_LR = 0.05


class Topology:
    """Meshes of one layout on some ranks; `group` spans them all (amax and loss reductions)."""

    def __init__(self, name: str, world: DeviceMesh | None, dp_mesh, tp_mesh, weight_mesh, dp_size: int, dp_rank: int):
        self.name, self.world, self.dp_mesh, self.tp_mesh, self.weight_mesh = name, world, dp_mesh, tp_mesh, weight_mesh
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.tp_size = 1 if tp_mesh is None else tp_mesh.size()
        self.group = None if world is None else dist.group.WORLD if world.size() == dist.get_world_size() else world.get_group()


def topology(name: str, pair_mesh: DeviceMesh | None = None) -> Topology:
    """`fsdp4`, `fsdp2xtp2`, `hsdp2x2` on 4 ranks; `fsdp2`, `tp2` on `pair_mesh` (2 ranks); `single`."""
    if name == "single":
        return Topology(name, None, None, None, None, 1, 0)
    if name in ("fsdp2", "tp2"):
        fsdp = name == "fsdp2"
        return Topology(name, pair_mesh, pair_mesh if fsdp else None, None if fsdp else pair_mesh, pair_mesh,
                        2 if fsdp else 1, pair_mesh.get_local_rank() if fsdp else 0)  # fmt: skip
    if name == "fsdp4":
        world = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
        return Topology(name, world, world, None, world, 4, world.get_local_rank())
    if name == "fsdp2xtp2":
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        weight_mesh = world["dp", "tp"]._flatten("dp_tp")
        return Topology(name, world, world["dp"], world["tp"], weight_mesh, 2, world["dp"].get_local_rank())
    if name == "hsdp2x2":
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "dp"))
        rep, dp = world.get_coordinate()
        return Topology(name, world, world, None, world["dp"], 4, 2 * rep + dp)
    raise ValueError(name)


def build(topo: Topology, recipe_name: str, fp8_params: bool, seed: int) -> tuple[nn.Module, FusedAdam]:
    """The stack on `topo`, parameters from `seed` (every rank alike, so replicas agree), and its optimizer."""
    torch.manual_seed(seed)
    config = ModuleConfig(amax_history_len=HISTORY, tp_size=topo.tp_size)
    with quantized_model_init(enabled=fp8_params, recipe=RECIPES[recipe_name] or RECIPES["current"]):
        model = make_stack(config, topo.tp_mesh)
    if topo.dp_mesh is not None:
        parallelize(model, topo.dp_mesh, weight_mesh=topo.weight_mesh, blocks=list(model))
    elif topo.tp_mesh is not None:
        parallelize(model, None, weight_mesh=topo.weight_mesh)
    high_precision = [p for p in model.parameters() if not isinstance(local(p), QuantizedTensor)]
    return model, FusedAdam(high_precision, **ADAM)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def train(model, optimizer, topo: Topology, recipe_name: str, first_step: int, steps: int) -> list[float]:
    """`steps` training steps from `first_step` (the data of step i is seeded by i); the global losses."""
    recipe = RECIPES[recipe_name]
    losses = []
    for step in range(first_step, first_step + steps):
        x, target = (t.chunk(topo.dp_size, dim=1)[topo.dp_rank] for t in (seeded((S, B, H), 100 + step),
                                                                          seeded((S, B, H), 200 + step)))  # fmt: skip
        with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=topo.group):
            y = model(x)
        squared = (y - target).square().sum()
        (squared * topo.dp_size / (S * B * H)).backward()
        if topo.group is not None:
            dist.all_reduce(squared, group=topo.group)
        losses.append(squared.item() / topo.tp_size)  # without sequence parallelism TP ranks share tokens
        optimizer.step()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if isinstance(local(param), QuantizedTensor):
                    values = local(param).dequantize(torch.float32) - FP8_LR * local(param.grad)
                    module, attribute = name.rsplit(".", 1)
                    model.get_submodule(module).quantize_weight_(attribute, values)
        optimizer.zero_grad(set_to_none=True)
        for param in model.parameters():
            param.grad = None
    return losses


def _full(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    if not isinstance(param, DTensor):
        return values
    spec = dict(run_check=False, shape=param.shape, stride=param.stride())  # one-byte FP8 data: the param's shape
    return DTensor.from_local(values, param.device_mesh, param.placements, **spec).full_tensor()


def _numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t).numpy().copy()


def gathered_state(model: nn.Module, optimizer: FusedAdam) -> dict[str, np.ndarray]:
    """Every value that must survive a checkpoint, as full tensors (see the module docstring)."""
    state = {}
    for name, param in model.named_parameters():
        shard = local(param)
        if isinstance(shard, QuantizedTensor):
            storage = shard.quantized_storage
            state[f"{name}:values"] = _numpy(_full(param, shard.dequantize(torch.float32)))
            state[f"{name}:rowwise_data"] = _numpy(_full(param, storage.rowwise_data))
            if storage.columnwise:
                state[f"{name}:columnwise_data"] = _numpy(_full(param, storage.columnwise_data.t()))
        else:
            state[name] = _numpy(_full(param, shard))
    names = {id(p): n for n, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, exported in optimizer.state_dict()["state"].items():
        param = params[index]
        for key, value in exported.items():
            state[f"optim:{names[id(param)]}:{key}"] = _numpy(_full(param, local(value)) if key != "step" else value)
    for name, buffer in model.named_buffers():
        if name.rsplit(".", 1)[-1].startswith("fp8_"):
            state[name] = _numpy(buffer)
    return state
