"""The XLA options jaxside's FP8 steps need, in one place: `jit` compiles with them, `compiler_options` lists them.

Jit an FP8 training step with `jaxside.xla_options.jit(step, ...)` (jax.jit's arguments), or pass
`compiler_options=compiler_options()` to your own `jax.jit`. Each option and why:

- `xla_gpu_enable_triton_gemm=False`: with XLA's Triton GEMM fusions on, XLA fuses the FP8 casts and
  scales into the GEMMs and autotunes Triton tilings for every such fusion; on an H200 the Llama-3-8B
  TransformerLayer step under current scaling had not finished compiling after 260 s
  (benchmarks/bench/bench_jax_layer.py). Off, the GEMMs go to cuBLAS / cuBLASLt and it compiles in 6 to 8 s.

Per compile, not `XLA_FLAGS`: XLA reads `XLA_FLAGS` once, when JAX's backend starts, which a library
cannot order reliably (and jaxside reads nothing at import); a compile's options change that program
only. A flag the user sets in `XLA_FLAGS` wins: its option is left out. A CPU compile accepts the
GPU options and ignores them.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import jax

FP8_STEP_OPTIONS: dict[str, bool] = {"xla_gpu_enable_triton_gemm": False}


def compiler_options(xla_flags: str | None = None) -> dict[str, bool]:
    """FP8_STEP_OPTIONS without the ones `xla_flags` (None: the environment's XLA_FLAGS) sets."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    set_by_user = set(re.findall(r"--(\w+)", flags))
    return {name: value for name, value in FP8_STEP_OPTIONS.items() if name not in set_by_user}


def jit(fun: Callable, **jit_kwargs: Any) -> Callable:
    """`jax.jit(fun, **jit_kwargs)` compiled with `compiler_options()`; a `compiler_options` passed here wins."""
    options = compiler_options() | (jit_kwargs.pop("compiler_options", None) or {})
    return jax.jit(fun, compiler_options=options, **jit_kwargs)


__all__ = ["FP8_STEP_OPTIONS", "compiler_options", "jit"]
