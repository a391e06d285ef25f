"""Train FP8 weights with FusedAdam: step an fp32 master, then re-quantize the weight from it.

A model built under `quantized_model_init` holds its GEMM weights as QuantizedTensor parameters
(DTensors of them once TP or FSDP2 shards them). FusedAdam keeps an fp32 master for each and steps
it; the hook registered here then casts the new master into the weight's own bytes with
`FP8Module.quantize_weight_`, which uses the weight's recipe and scales every shard by the amax of
the whole weight (its `weight_shard_group`). Blockwise recipes scale each block from itself.

Every rank must register the same weights in the same order: a per-tensor cast all-reduces its
amax over the weight's group, so the hooks are collectives.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchside.optim.fused_adam import FusedAdam
from torchside.parallel.module_mesh import local_tensor
from torchside.quantization import QuantizedTensor


def requantize_fp8_weights(optimizer: FusedAdam, model: nn.Module) -> list[RemovableHandle]:
    """Register on `optimizer` one hook per FP8 weight of `model` that re-quantizes it after each step.

    Call it after `fully_shard` (FSDP2 replaces the parameters) and before the first step.
    """
    if not isinstance(optimizer, FusedAdam):
        raise TypeError(f"requantize_fp8_weights takes a torchside.optim.FusedAdam, got {type(optimizer).__name__}")
    if not optimizer.master_weights:
        raise ValueError("FP8 weights train on fp32 masters: build FusedAdam with master_weights=True")
    handles = []
    for module in model.modules():
        if not getattr(module, "builds_fp8_weights", False):
            continue
        for name, param in module.named_parameters(recurse=False):
            if isinstance(local_tensor(param), QuantizedTensor):
                hook = functools.partial(_requantize, optimizer, module, name)
                handles.append(optimizer.register_after_step_hook(param, hook))
    return handles


def _requantize(optimizer: FusedAdam, module: nn.Module, name: str, param: torch.Tensor) -> None:
    module.quantize_weight_(name, local_tensor(optimizer.state[param]["master_param"]))


__all__ = ["requantize_fp8_weights"]
