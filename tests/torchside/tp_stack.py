"""The 2-block stack that the tensor-parallel, FSDP x TP and checkpoint tests shard, and its one-process step.

Each block is x + Linear_row(LayerNormLinear_column(x)) (the attention's column/row pair), then
x + LayerNormMLP(x): a stand-in for TransformerLayer. Weights come from one seeded global tensor per
parameter, cut by the placement table (so a wrong table entry shows up as a wrong result). Threads
share torch's global RNG: every random value here comes from an explicit Generator. The tolerances
(FP32_ORDER, HELD_TO_OWN_ERROR) are explained in tests/torchside/test_tensor_parallel.py's docstring.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from bridge.layout import from_dtensor
from torchside.autocast import fp8_autocast
from torchside.modules import LayerNormLinear, LayerNormMLP, Linear, ModuleConfig
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)

H, F, S, B, TP = 64, 128, 16, 2, 2
HISTORY = 4
RECIPES = {
    "off": None,
    "delayed": DelayedScaling(amax_history_len=HISTORY),
    "current": Float8CurrentScaling(),
    "block": Float8BlockScaling(),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}
FP32_ORDER = 1e-6  # relative error from reordered fp32 sums alone
HELD_TO_OWN_ERROR = ("current", "nvfp4")  # see the module docstring



class Block(nn.Module):
    """x + proj(qkv(x)), then x + mlp(x): a column, a row and a fc1/fc2 pair, (hidden, ffn) wide."""

    def __init__(self, config: ModuleConfig, tp_mesh=None, hidden: int = H, ffn: int = F) -> None:
        super().__init__()
        column, row = (dataclasses.replace(config, parallel_mode=mode) for mode in ("column", "row"))
        self.qkv = LayerNormLinear(hidden, ffn, config=column, tp_mesh=tp_mesh)
        self.proj = Linear(ffn, hidden, config=row, tp_mesh=tp_mesh)
        self.mlp = LayerNormMLP(hidden, ffn, config=config, tp_mesh=tp_mesh)

    def forward(self, x):
        x = x + self.proj(self.qkv(x))
        return x + self.mlp(x)


def make_stack(config: ModuleConfig, tp_mesh=None) -> nn.Module:
    return nn.Sequential(Block(config, tp_mesh), Block(config, tp_mesh))


def global_values(model: nn.Module) -> dict[str, torch.Tensor]:
    """Seeded values for every parameter of the single-process model (norm weights near 1)."""
    generator = torch.Generator().manual_seed(5)
    values = {}
    for name, param in model.named_parameters():
        scale = 0.05 if param.dim() == 2 else 0.1
        values[name] = torch.randn(param.shape, generator=generator) * scale + name.endswith("norm_weight")
    return values


def load_shards(model: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Copy into every local shard its part of the global value, as the shard map of its placements says."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if isinstance(param, DTensor):
                shard_map = from_dtensor(param)
                param.to_local().copy_(values[name][shard_map.selectors(tuple(param.device_mesh.get_coordinate()))])
            else:
                param.copy_(values[name])


def seeded(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def one_step(model, x, dy, recipe, group=None) -> dict[str, torch.Tensor]:
    """Output, input grad and every parameter grad (full tensors) of one forward/backward."""
    x = x.clone().requires_grad_()
    with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=group):
        y = model(x)
    y.backward(dy)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in model.named_parameters()}
    return {"y": y.detach(), "dx": x.grad} | grads
