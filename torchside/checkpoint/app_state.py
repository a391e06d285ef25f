"""`AppState`: everything a training run resumes from, as tensors only, under fixed keys.

    model         parameters and buffers by FQN (DTensors where sharded); an FP8 parameter as its
                  buffers (`quantized_params`), never as a pickled subclass
    optim         FusedAdam's per-parameter states by parameter FQN (`step`, unscaled fp32
                  `exp_avg`, `exp_avg_sq`, `master_param`; DTensors placed like their parameters).
                  Hyperparameters (`param_groups`) are not tensors: they go into the JSON metadata
    fp8_scaling   every FP8 module's FP8_STATE_BUFFERS (torchside.modules.base): DelayedScaling's
                  scales and amax histories, NVFP4's stochastic-rounding counters
    train         `step` (int64)
    rng           `rank<r>.cpu` (and `.cuda`): each rank's generator states

The FP8 scaling state is one state for the whole model (its amaxes are all-reduced over the
autocast region's group), saved once and loaded by every rank of any topology; `state_dict()`
checks that the ranks agree, since a per-rank state could not be resharded.

Loading never writes into the live model: `empty_state_dict()` gives fresh tensors laid out like
the live ones, DCP fills them, and only then `load_state_dict()` copies them in (the swap).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from torchside.checkpoint import quantized_params
from torchside.modules.base import FP8_STATE_BUFFERS
from torchside.quantization import QuantizedStorage

KEYS = ("model", "optim", "fp8_scaling", "train", "rng")


def _is_scaling_buffer(fqn: str) -> bool:
    return fqn.rsplit(".", 1)[-1] in FP8_STATE_BUFFERS


def _empty_like(t: Tensor) -> Tensor:
    if isinstance(t, DTensor):
        local = torch.empty_like(t.to_local())
        return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride())
    return torch.empty_like(t)


class AppState(Stateful):
    """Model, optimizer, FP8 scaling state, step and RNG of this rank, as one DCP state dict."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        step: int = 0,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.model, self.optimizer, self.step = model, optimizer, step
        self.group = process_group
        self.rank = dist.get_rank(process_group) if dist.is_initialized() else 0
        self.fp8_params = {n: p for n, p in model.named_parameters() if quantized_params.is_quantized(p)}
        self._fresh_fp8: dict[str, QuantizedStorage] = {}  # load targets of the FP8 parameters' buffers

    # ---- what torch's state-dict helpers give, split into our keys

    def _torch_state(self) -> tuple[dict[str, Tensor], dict[str, Any]]:
        options = StateDictOptions(ignore_frozen_params=False)
        model_state = get_model_state_dict(self.model, options=options)
        optim_state = {"state": {}, "param_groups": []}
        if self.optimizer is not None:
            optim_state = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        return model_state, optim_state

    def _split(self, model_state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        model, scaling = {}, {}
        for fqn, value in model_state.items():
            if fqn in self.fp8_params:
                model.update(quantized_params.buffer_tensors(fqn, self.fp8_params[fqn]))
            elif _is_scaling_buffer(fqn):
                scaling[fqn] = value
            else:
                model[fqn] = value
        return model, scaling

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters per group, JSON-ready (parameters by FQN)."""
        return [_jsonable(group) for group in self._torch_state()[1]["param_groups"]]

    def state_dict(self) -> dict[str, Any]:
        """The live tensors to save (views of the model and optimizer, not copies)."""
        state = self._live_state()
        _check_ranks_agree(state["fp8_scaling"], self.group)
        return state

    def _live_state(self) -> dict[str, Any]:
        model_state, optim_state = self._torch_state()
        model, scaling = self._split(model_state)
        return {
            "model": model,
            "optim": optim_state["state"],
            "fp8_scaling": scaling,
            "train": {"step": torch.tensor(self.step, dtype=torch.int64)},
            "rng": {f"rank{self.rank}": rng_states()},
        }

    def empty_state_dict(self, *, with_rng: bool) -> dict[str, Any]:
        """Fresh tensors laid out like `state_dict()`'s, for DCP to load into (FP8 buffers: new storages)."""
        live = {k: v for k, v in self._live_state().items() if with_rng or k != "rng"}
        fresh = {key: _map_tensors(value, _empty_like) for key, value in live.items()}
        self._fresh_fp8 = {fqn: quantized_params.empty_storage_like(p) for fqn, p in self.fp8_params.items()}
        for fqn, storage in self._fresh_fp8.items():
            fresh["model"].update(quantized_params.buffer_tensors(fqn, self.fp8_params[fqn], storage))
        return fresh

    def load_state_dict(self, state_dict: dict[str, Any], param_groups: list[dict] | None = None) -> None:
        """The swap: copy loaded tensors (from `empty_state_dict()`, filled by DCP) into the live state."""
        model = {k: v for k, v in state_dict["model"].items() if not self._is_fp8_buffer(k)}
        model.update(state_dict["fp8_scaling"])
        options = StateDictOptions(strict=False)
        missing, unexpected = set_model_state_dict(self.model, model, options=options)
        missing = [k for k in missing if k not in self.fp8_params]
        if missing or unexpected:  # validated before; this is an internal invariant
            raise RuntimeError(f"model load left missing keys {missing} and unexpected keys {unexpected}")
        for fqn, storage in self._fresh_fp8.items():
            quantized_params.copy_into_param(self.fp8_params[fqn], storage)
        if self.optimizer is not None:
            groups = self._torch_state()[1]["param_groups"]
            if param_groups is not None:
                groups = [_restore_group(live, saved) for live, saved in zip(groups, param_groups, strict=True)]
            optim = {"state": state_dict["optim"], "param_groups": groups}
            set_optimizer_state_dict(self.model, self.optimizer, optim, options=options)
        self.step = int(state_dict["train"]["step"])
        rng = state_dict.get("rng", {}).get(f"rank{self.rank}")
        if rng is not None:
            set_rng_states(rng)

    def _is_fp8_buffer(self, key: str) -> bool:
        return key.rsplit(".", 1)[0] in self.fp8_params


def _map_tensors(tree: Any, fn) -> Any:
    if isinstance(tree, dict):
        return {k: _map_tensors(v, fn) for k, v in tree.items()}
    return fn(tree) if isinstance(tree, Tensor) else tree


def _jsonable(group: dict[str, Any]) -> dict[str, Any]:
    def convert(value):
        if isinstance(value, Tensor):
            return value.item()
        if isinstance(value, tuple | list):
            return [convert(v) for v in value]
        return value

    return {key: convert(value) for key, value in group.items()}


def _restore_group(live: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """A live param group with the saved hyperparameters, in the live value's type (tuple, tensor)."""
    restored = dict(live)
    for key, value in saved.items():
        if key == "params" or key not in live:
            continue
        current = live[key]
        if isinstance(current, Tensor):
            value = torch.tensor(value, dtype=current.dtype, device=current.device)
        elif isinstance(current, tuple):
            value = tuple(value)
        restored[key] = value
    return restored


def rng_states() -> dict[str, Tensor]:
    """This process's generator states (CPU, and CUDA once initialized)."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _check_ranks_agree(scaling: dict[str, Tensor], group: dist.ProcessGroup | None) -> None:
    """The FP8 scaling state is saved once: every rank must hold the same bytes."""
    if not scaling or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([t.detach().reshape(-1).float() for t in scaling.values()]).view(torch.int32)
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    if all(torch.equal(g, gathered[0]) for g in gathered):
        return
    offsets, start = {}, 0
    for fqn, t in scaling.items():
        offsets[fqn] = (start, start + t.numel())
        start += t.numel()
    differing = [f for f, (a, b) in offsets.items() if any(not torch.equal(g[a:b], gathered[0][a:b]) for g in gathered)]
    raise ValueError(
        f"FP8 scaling state differs across ranks ({', '.join(differing)}): it is saved once for any topology, so "
        "reduce amaxes over every rank (fp8_autocast(amax_reduction_group=dist.group.WORLD))"
    )
