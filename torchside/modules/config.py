"""`ModuleConfig`: the knobs a model's modules share, frozen and validated once.

The tensor-parallel fields have TransformerEngine's names and meaning (`tp_group` wins over
`tp_size`; `parallel_mode` None, "column" or "row"; `sequence_parallel` only with TP). They are
validated now; only the single-device case (`parallel_mode=None`, no group, size 1) runs until
the tensor-parallel issue adds the rest, and anything else raises NotImplementedError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

PARALLEL_MODES = (None, "column", "row")
PARAMS_DTYPES = (torch.float32, torch.bfloat16)  # what the FP8 GEMM and the norm kernels write


@dataclass(frozen=True)
class ModuleConfig:
    """Shared module settings: DelayedScaling state size and (for a later issue) tensor parallelism."""

    # Rows of the DelayedScaling amax history buffers. Fixed at construction so that every
    # state_dict has the same shapes; a DelayedScaling recipe must use the same length.
    amax_history_len: int = 1024
    tp_group: dist.ProcessGroup | None = None
    tp_size: int = 1
    parallel_mode: str | None = None
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name, value in (("amax_history_len", self.amax_history_len), ("tp_size", self.tp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModuleConfig({name}={value!r}): pass an integer >= 1")
        if self.tp_group is not None and not isinstance(self.tp_group, dist.ProcessGroup):
            raise TypeError(f"ModuleConfig(tp_group={self.tp_group!r}): pass a ProcessGroup or None")
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"ModuleConfig(parallel_mode={self.parallel_mode!r}): use None, 'column' or 'row'")
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"ModuleConfig(sequence_parallel={self.sequence_parallel!r}): pass True or False")

    def check_single_device(self, owner: str) -> None:
        """Raise NotImplementedError if tensor parallelism is asked for (it comes with a later issue)."""
        asked = {
            "parallel_mode": self.parallel_mode is not None,
            "tp_group": self.tp_group is not None,
            "tp_size": self.tp_size != 1,
            "sequence_parallel": self.sequence_parallel,
        }
        wanted = [name for name, on in asked.items() if on]
        if wanted:
            raise NotImplementedError(
                f"{owner}: tensor parallelism ({', '.join(wanted)}) is not implemented yet; build the module "
                "with ModuleConfig(parallel_mode=None, tp_group=None, tp_size=1, sequence_parallel=False)"
            )


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


__all__ = ["PARALLEL_MODES", "PARAMS_DTYPES", "ModuleConfig", "check_params_dtype", "check_size"]
