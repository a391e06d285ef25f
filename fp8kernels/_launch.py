"""Triton launches that skip the JIT front end once a launch of the same specialization has compiled.

Each `kernel[grid](...)` through Triton's front end binds and specializes every argument, builds a
cache key and checks the kernel's globals before the launch proper: on the H200 machine's host that
adds 4-13 us to a small kernel's launch and ~25 us to our 35-argument cast's (benchmarks/profile/
launch_cost.py, lean_linear.py), and triton.autotune adds its own key and config merge on top. An eager
FP8 step of a small model issues ~200 such launches, and its GPU waits on the host.

`Launcher` keeps the CompiledKernel of the first launch of each specialization and launches it
directly afterwards. Its key holds what Triton specializes a kernel on: each tensor's dtype and
16-byte alignment, each int's value (Triton: 1, divisibility by 16, 32 or 64 bits), each float's type,
every constexpr and launch option, and the current device. With `configs`, the first launch of a key
autotunes (or takes the autotuner's earlier choice for its key) and the rest use the chosen config.

Call sites pass runtime arguments positionally and constexprs and launch options by keyword (checked
on a key's first launch and on every interpreted one: a float passed by keyword would be keyed by value).
Under the interpreter every launch goes through Triton: there is nothing compiled to keep. Exact ints
make one entry per distinct shape: a few per kernel in training.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
import triton
from torch import Tensor
from triton.runtime.autotuner import Heuristics

from fp8kernels._backend import autotune_configs, interpreting

Grid = tuple[int, ...] | Callable[[dict], tuple[int, ...]]
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


def _specialization(value: object) -> object:
    """What Triton compiles a runtime argument for, as a key part (ints exactly: a superset of Triton's)."""
    if isinstance(value, Tensor):
        return value.dtype, value.data_ptr() % 16 == 0
    if isinstance(value, float):
        return float
    return value


class Launcher:
    """`launcher[grid](*runtime_args, **constexprs)`: a @triton.jit kernel launched through its cached
    CompiledKernel; with `configs` (fp8kernels._backend.autotune_configs candidates) and `key`, autotuned once
    per key first. `grid` is a tuple or a function of the launch's meta-parameters (the config's included)."""

    def __init__(self, kernel, configs: list[dict] | None = None, key: list[str] | None = None, **autotune_options):
        self.kernel = kernel
        self.autotuner = None
        if configs is not None:
            self.autotuner = triton.autotune(configs=autotune_configs(configs), key=key, **autotune_options)(kernel)
        self.heuristics: dict[str, Callable[[dict], object]] = {}  # constexprs @triton.heuristics derives
        while isinstance(kernel, Heuristics):
            self.heuristics.update(kernel.values)
            kernel = kernel.fn
        self.jit = kernel  # a JITFunction, or the interpreter's InterpretedFunction
        params = inspect.signature(kernel.fn).parameters.values()
        constexpr = [p.name for p in params if "constexpr" in str(p.annotation)]  # string or class annotation
        self.runtime_names = [p.name for p in params if p.name not in constexpr]
        self.constexpr_names = constexpr
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        if [p.name for p in params] != self.runtime_names + constexpr:
            raise TypeError(f"{self.name}: declare the runtime parameters first, then the constexprs")
        self.compiled: dict[tuple, tuple[object, dict, tuple]] = {}  # key -> (kernel, meta, constexpr values)

    def __getitem__(self, grid: Grid) -> Callable[..., None]:
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Grid, args: tuple, kwargs: dict) -> None:
        if interpreting():  # the CPU tests: each call site's convention checked on every launch
            self._check_call_convention(args, kwargs)
            (self.autotuner or self.kernel)[grid](*args, **kwargs)
            return
        key = (torch.cuda.current_device(), tuple(map(_specialization, args)), tuple(kwargs.items()))
        entry = self.compiled.get(key)
        if entry is None:
            entry = self.compiled[key] = self._first_launch(grid, args, kwargs)
            return
        compiled, meta, constexprs = entry
        blocks = grid(meta) if callable(grid) else grid
        compiled[(*blocks, 1, 1)[:3]](*args, *constexprs)

    def _first_launch(self, grid: Grid, args: tuple, kwargs: dict) -> tuple[object, dict, tuple]:
        """Launch through Triton (autotuning if tuned), then fetch the CompiledKernel that ran."""
        self._check_call_convention(args, kwargs)
        (self.autotuner or self.kernel)[grid](*args, **kwargs)
        config = self.autotuner.best_config.all_kwargs() if self.autotuner is not None else {}
        meta = {**kwargs, **config}
        named = dict(zip(self.runtime_names, args)) | meta
        meta |= {name: derive(named) for name, derive in self.heuristics.items()}
        compiled = self.jit.warmup(*args, grid=grid, **meta)  # compiled already: a cache lookup
        constexprs = tuple(meta[name] if name in meta else self.defaults[name] for name in self.constexpr_names)
        return compiled, meta, constexprs

    @property
    def name(self) -> str:
        return self.jit.fn.__name__

    def _check_call_convention(self, args: tuple, kwargs: dict) -> None:
        if len(args) != len(self.runtime_names):
            raise TypeError(
                f"{self.name} takes its {len(self.runtime_names)} runtime arguments positionally "
                f"({', '.join(self.runtime_names)}); got {len(args)}"
            )
        unknown = set(kwargs) - set(self.constexpr_names) - _LAUNCH_OPTIONS
        if unknown:
            raise TypeError(
                f"{self.name} takes constexprs and launch options by keyword, not {sorted(unknown)}: "
                "pass runtime arguments positionally"
            )
