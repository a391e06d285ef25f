"""Undo for a failed load: the live state a load may touch, kept aside so it can be put back bitwise.

A load validates everything it can before it changes anything, but the swap itself (and torch's
`get_optimizer_state_dict`, which gives a fresh optimizer its states by running a step with lr 0)
could still fail halfway: a bad tensor, an out-of-memory error, Ctrl-C. `Rollback` holds:

- copies of this rank's model tensors: every parameter shard (an FP8 parameter's every buffer,
  columnwise copies and amaxes included) and every buffer (FP8 scaling state). Cost: one copy of
  the model's local shards in host memory while the load runs (not on the GPU, where the load
  target already doubles the state); the optimizer states, usually several times larger, are not
  copied;
- the optimizer's own state dicts and param groups, by reference: torch's `load_state_dict`
  replaces them with new objects and never writes into the old tensors;
- the RNG states.

`restore()` copies the tensors back in place (FSDP2 keeps its storage) and puts the rest back.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import Tensor, nn

from torchside.checkpoint import quantized_params
from torchside.checkpoint.app_state import rng_states, set_rng_states
from torchside.quantization import QuantizedStorage


class Rollback:
    """A snapshot of a model and optimizer taken before a load; `restore()` puts it back."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.tensors: list[tuple[Tensor, Tensor]] = []
        self.storages: list[tuple[QuantizedStorage, QuantizedStorage]] = []
        for param in model.parameters():
            local = quantized_params.local_of(param).detach()
            if quantized_params.is_quantized(param):
                storage = local.quantized_storage
                self.storages.append((storage, storage.with_buffers(lambda name, buffer: _host_copy(buffer))))
            else:
                self.tensors.append((local, _host_copy(local)))
        for buffer in model.buffers():
            local = quantized_params.local_of(buffer).detach()
            self.tensors.append((local, _host_copy(local)))
        self.optimizer = optimizer
        if optimizer is not None:
            self.optimizer_state = {param: dict(state) for param, state in optimizer.state.items()}
            self.param_groups = [dict(group) for group in optimizer.param_groups]
        self.rng = rng_states()

    @torch.no_grad()
    def restore(self) -> None:
        for live, saved in self.tensors:
            live.copy_(saved)
        for live, saved in self.storages:
            live.copy_(saved)
        if self.optimizer is not None:
            states = {param: dict(state) for param, state in self.optimizer_state.items()}
            self.optimizer.state = defaultdict(dict, states)
            self.optimizer.param_groups = [dict(group) for group in self.param_groups]
        set_rng_states(self.rng)


def _host_copy(tensor: Tensor) -> Tensor:
    return tensor.to("cpu", copy=True)
