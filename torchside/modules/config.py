"""`ModuleConfig`: the knobs a model's modules share, frozen and validated once.

The tensor-parallel fields have TransformerEngine's names and meaning: `tp_group` wins over
`tp_size` (a `tp_size` of 1 takes the group's size; another size must match it); `parallel_mode`
None, "column" (weight rows split) or "row" (weight columns split); `sequence_parallel` splits
dim 0 of the activations outside the column/row pair over the TP group (sequence-first [S, B, H]
inputs, as in TransformerEngine). A module may be built with `tp_size` alone (its local shard
shapes) and get its group later from `set_device_mesh(tp_mesh=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from twinspec.placement import PARALLEL_MODES
from twinspec.recipe import check_amax_history_len

PARAMS_DTYPES = (torch.float32, torch.bfloat16)  # what the FP8 GEMM and the norm kernels write


@dataclass(frozen=True)
class ModuleConfig:
    """Shared module settings: DelayedScaling state size and tensor parallelism."""

    # Rows of the DelayedScaling amax history buffers. None (the default): the DelayedScaling recipe's
    # amax_history_len, as in TransformerEngine (the buffers take it at the first forward under it,
    # 1024 rows before); a length here fixes the rows whatever the recipe says. A checkpoint saved with
    # N rows loads into modules of N rows: build them with ModuleConfig(amax_history_len=N) when N != 1024.
    amax_history_len: int | None = None
    tp_group: dist.ProcessGroup | None = None
    tp_size: int = 1
    parallel_mode: str | None = None
    sequence_parallel: bool = False
    # With sequence_parallel and a per-tensor recipe, the activation all-gather sends FP8 bytes
    # (the amax reduced over the TP group first); False gathers high precision, then casts.
    fp8_all_gather: bool = True

    def __post_init__(self) -> None:
        if self.amax_history_len is not None:
            check_amax_history_len("ModuleConfig", self.amax_history_len)
        if isinstance(self.tp_size, bool) or not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"ModuleConfig(tp_size={self.tp_size!r}): pass an integer >= 1")
        if self.tp_group is not None and not isinstance(self.tp_group, dist.ProcessGroup):
            raise TypeError(f"ModuleConfig(tp_group={self.tp_group!r}): pass a ProcessGroup or None")
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"ModuleConfig(parallel_mode={self.parallel_mode!r}): use None, 'column' or 'row'")
        for name in ("sequence_parallel", "fp8_all_gather"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModuleConfig({name}={getattr(self, name)!r}): pass True or False")
        if self.tp_group is not None:
            group_size = dist.get_world_size(self.tp_group)
            if self.tp_size not in (1, group_size):
                raise ValueError(
                    f"ModuleConfig(tp_size={self.tp_size}) differs from the size {group_size} of tp_group: "
                    "leave tp_size at 1 (it then takes the group's size) or pass the group's size"
                )
            object.__setattr__(self, "tp_size", group_size)  # frozen: set once, here


def check_parallel_mode(owner: str, config: ModuleConfig | None, allowed: tuple[str | None, ...]) -> str | None:
    """The config's parallel_mode if `owner` supports it; ValueError otherwise.

    A module that can be split (allowed has "column") must be, to take sequence-parallel input.
    """
    if config is None:
        return None
    if not isinstance(config, ModuleConfig):
        raise TypeError(f"{owner}(config={config!r}): pass a torchside.modules.ModuleConfig or None")
    mode = config.parallel_mode
    if mode not in allowed:
        choices = ", ".join(map(repr, allowed))
        fix = "leave it None (the module's own layout decides)" if allowed == (None,) else f"use one of {choices}"
        raise ValueError(f"{owner} does not support ModuleConfig(parallel_mode={mode!r}): {fix}")
    if "column" in allowed and mode is None and config.sequence_parallel and config.tp_size > 1:
        raise ValueError(
            f"{owner} with sequence_parallel=True and tp_size={config.tp_size} must be split: pass "
            "ModuleConfig(parallel_mode='column' or 'row'), or sequence_parallel=False for a replicated layer"
        )
    return mode


def check_params_dtype(owner: str, params_dtype: torch.dtype | None) -> torch.dtype:
    """params_dtype, or torch's default dtype when None; TypeError unless fp32 or bf16."""
    dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
    if dtype not in PARAMS_DTYPES:
        raise TypeError(f"{owner}(params_dtype={dtype}): use torch.float32 or torch.bfloat16")
    return dtype


def check_size(owner: str, name: str, value: object) -> int:
    """A feature count: an int >= 1, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}={value!r}): pass an integer >= 1")
    return value


__all__ = [
    "PARALLEL_MODES",
    "PARAMS_DTYPES",
    "ModuleConfig",
    "check_parallel_mode",
    "check_params_dtype",
    "check_size",
]
