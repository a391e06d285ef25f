"""`ModuleConfig`: the knobs a model's modules share (the twin of torchside.modules.config), and argument checks.

Tensor parallelism needs no process group here: a module only names the parallel mode its
parameters follow (jaxside.sharding's rules), and a mesh from `make_mesh` decides the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from twinspec.placement import PARALLEL_MODES
from twinspec.recipe import check_amax_history_len

PARAMS_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))  # what the FP8 GEMM and the norms write

# The Flax kernel [in, out] of a linear layer, by parallel mode: the axis TP splits must be one whose
# activations TP splits too (jaxside.sharding checks it), so a row layer reads "mlp" and writes "embed".
KERNEL_AXES = {"column": ("embed", "mlp"), "row": ("mlp", "embed"), None: ("embed", "mlp")}


@dataclass(frozen=True)
class ModuleConfig:
    """Shared module settings: DelayedScaling state size and the parallel mode of a linear layer's parameters."""

    # Rows of the DelayedScaling amax histories (as torchside): None (the default) takes the
    # DelayedScaling recipe's amax_history_len at the first call under it; a length here fixes them.
    amax_history_len: int | None = None
    parallel_mode: str | None = None  # None, "column" or "row" (torchside's parallel_mode)

    def __post_init__(self) -> None:
        if self.amax_history_len is not None:
            check_amax_history_len("ModuleConfig", self.amax_history_len)
        if self.parallel_mode not in PARALLEL_MODES:
            raise ValueError(f"ModuleConfig(parallel_mode={self.parallel_mode!r}): use None, 'column' or 'row'")


def check_config(owner: str, config: ModuleConfig | None) -> ModuleConfig:
    """config, or the default ModuleConfig when None; TypeError for anything else."""
    if config is None:
        return ModuleConfig()
    if not isinstance(config, ModuleConfig):
        raise TypeError(f"{owner}(config={config!r}): pass a jaxside.modules.ModuleConfig or None")
    return config


def check_params_dtype(owner: str, params_dtype) -> np.dtype:
    """params_dtype as a numpy dtype; TypeError unless fp32 or bf16."""
    try:
        dtype = np.dtype(params_dtype)
    except TypeError:
        dtype = None
    if dtype not in PARAMS_DTYPES:
        raise TypeError(f"{owner}(params_dtype={params_dtype!r}): use jnp.float32 or jnp.bfloat16")
    return dtype


def check_size(owner: str, name: str, value: object) -> int:
    """A feature count: an int >= 1, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}({name}={value!r}): pass an integer >= 1")
    return value
