"""Shared by the checkpoint tests: the model, topologies, a deterministic training loop, gathered state.

The model is tp_stack's 2-block stack (LayerNormLinear column / Linear row pair and a
LayerNormMLP per block), at its widths (hidden 64, ffn 128) or wider ones: Float8BlockScaling FP8
weights need 128-row shards. Training: FusedAdam on every parameter; an FP8 weight steps an fp32
master that `requantize_fp8_weights` casts back into its bytes (its state: bytes, master, moments).
Every rank's loss is its tokens' squared error over the global token count times the data-parallel
size (a power of 2: FSDP2's gradient average is undone exactly), so
gradients and optimizer states are the same on every topology.

`gathered_state` reads the model and optimizer directly (not through torchside.checkpoint): full
parameters (FP8: rowwise bytes, columnwise bytes, dequantized values), optimizer states by
parameter name, FP8 scaling buffers. numpy arrays, so gloo processes return them by value.
`live_bytes` is the raw counterpart for "nothing changed" checks: every byte as the objects hold it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from tests.torchside.tp_stack import HISTORY, RECIPES, Block, F, H, S, seeded
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import ModuleConfig
from torchside.optim import FusedAdam, requantize_fp8_weights
from torchside.parallel import parallelize
from torchside.quantization import QuantizedTensor

B = 8  # global batch columns: 2 per rank on 4 data-parallel ranks
ADAM = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01)


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


def build(
    topo: Topology, recipe_name: str, fp8_params: bool, seed: int, widths: tuple[int, int] = (H, F)
) -> tuple[nn.Module, FusedAdam]:
    """The stack of (hidden, ffn) `widths` on `topo`, parameters from `seed` (every rank alike, so replicas
    agree), and its optimizer."""
    torch.manual_seed(seed)
    config = ModuleConfig(amax_history_len=HISTORY, tp_size=topo.tp_size)
    with quantized_model_init(enabled=fp8_params, recipe=RECIPES[recipe_name] or RECIPES["current"]):
        model = nn.Sequential(*(Block(config, topo.tp_mesh, *widths) for _ in range(2)))
    if topo.dp_mesh is not None:
        parallelize(model, topo.dp_mesh, weight_mesh=topo.weight_mesh, blocks=list(model))
    elif topo.tp_mesh is not None:
        parallelize(model, None, weight_mesh=topo.weight_mesh)
    optimizer = FusedAdam(model.parameters(), master_weights=True, **ADAM)  # masters: the FP8 weights' only
    requantize_fp8_weights(optimizer, model)
    return model, optimizer


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def train(model, optimizer, topo: Topology, recipe_name: str, first_step: int, steps: int) -> list[float]:
    """`steps` training steps from `first_step` (the data of step i is seeded by i); the global losses."""
    recipe = RECIPES[recipe_name]
    hidden = model[0].qkv.in_features
    losses = []
    for step in range(first_step, first_step + steps):
        x, target = (seeded((S, B, hidden), seed + step).chunk(topo.dp_size, dim=1)[topo.dp_rank] for seed in (100, 200))
        with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=topo.group):
            y = model(x)
        squared = (y - target).square().sum()
        (squared * topo.dp_size / (S * B * hidden)).backward()
        if topo.group is not None:
            dist.all_reduce(squared, group=topo.group)
        losses.append(squared.item() / topo.tp_size)  # without sequence parallelism TP ranks share tokens
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        for param in model.parameters():
            param.grad = None
    return losses


def _full(param: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `values` is this rank's piece, laid out like `param`'s shard.

    `values` may be narrower than the shard along a dim (packed E2M1 bytes: half as many): the whole
    tensor is narrower by the same factor.
    """
    if not isinstance(param, DTensor):
        return values
    shard = param.to_local().shape
    shape = torch.Size(whole * size // part for whole, size, part in zip(param.shape, values.shape, shard, strict=True))
    stride = torch.empty(shape, device="meta").stride()
    spec = dict(run_check=False, shape=shape, stride=stride)
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


def _raw(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    t = local(t).detach().cpu().contiguous()
    return str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes()


def live_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, object]:
    """This rank's every byte a load may change, read straight from the objects (not through
    torchside.checkpoint): parameter shards (an FP8 parameter's every buffer), module buffers, each
    optimizer state tensor as the optimizer holds it, the param groups' hyperparameters, the RNG.
    Compare two with `==`."""
    state: dict[str, object] = {"rng": _raw(torch.get_rng_state())}
    for name, param in model.named_parameters():
        shard = local(param)
        if isinstance(shard, QuantizedTensor):
            for buffer, values in shard.quantized_storage.buffers().items():
                state[f"{name}:{buffer}"] = _raw(values)
        else:
            state[name] = _raw(shard)
    for name, buffer in model.named_buffers():
        state[f"buffer:{name}"] = _raw(buffer)
    if optimizer is not None:
        names = {id(p): n for n, p in model.named_parameters()}
        for param, param_state in optimizer.state.items():
            for key, value in param_state.items():
                state[f"optim:{names[id(param)]}:{key}"] = _raw(value) if isinstance(value, torch.Tensor) else value
        for index, group in enumerate(optimizer.param_groups):
            hyperparameters = {k: _raw(v) if isinstance(v, torch.Tensor) else v for k, v in group.items()}
            hyperparameters["params"] = [names[id(p)] for p in group["params"]]
            state[f"optim:group{index}"] = hyperparameters
    return state
