"""The host time OUR code spends per FP8 module step, with every kernel launch stubbed out (CPU, no GPU).

The GPU path is taken (fp8kernels._backend says TRITON for every device), but no Triton kernel,
torch._scaled_mm or reference kernel runs: launches are no-ops and _scaled_mm returns an empty
output. What is left is our Python plus the small torch ops we issue (allocations, views,
scale math), each of which on a GPU costs a dispatch and often a launch. For each module and
recipe, per fwd+bwd: microseconds of this process's CPU time (the best of 5 rounds: noisy where
other processes share the cores), Python and C function calls (sys.setprofile: deterministic),
eager torch ops (a TorchDispatchMode counter: the ops aten sees, views and allocations included)
and kernel launches (Triton and _scaled_mm; on an H200 a Triton launch costs the host ~100 us,
an eager op ~5-10 us).

Run:  PYTHONPATH=. python3 benchmarks/profile/host_overhead.py [--iters 200]
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # importable kernels without a GPU driver; nothing is interpreted

import torch
import triton.runtime.jit
from torch.utils._python_dispatch import TorchDispatchMode

import fp8kernels._backend as backend_module
from benchmarks.harness import environment_line
from fp8kernels._backend import Backend
from torchside.autocast import fp8_autocast
from torchside.modules import GroupedLinear, LayerNormMLP, Linear
from torchside.recipe import recipe_from_name


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def stub_kernels() -> collections.Counter:
    """Make every Triton launch and torch._scaled_mm a no-op on the TRITON backend; returns the launch counter."""
    launches = collections.Counter()

    def launch(self, grid):
        def run(*args, **kwargs):
            launches[getattr(self, "fn", self).__name__] += 1

        return run

    triton.runtime.jit.KernelInterface.__getitem__ = launch

    def scaled_mm(a, b, *, out_dtype, **kwargs):
        launches["torch._scaled_mm"] += 1
        return torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)

    torch._scaled_mm = scaled_mm
    original = backend_module.backend_for
    for module in list(sys.modules.values()):  # every `from fp8kernels._backend import backend_for`
        if getattr(module, "backend_for", None) is original:
            module.backend_for = lambda device: Backend.TRITON
    return launches


def step(module, x, recipe) -> None:
    with fp8_autocast(recipe=recipe):
        y = module(x)
    y.backward(torch.ones_like(y))


def measure(name: str, module, x, recipe, iters: int, launches: collections.Counter) -> None:
    for _ in range(3):
        step(module, x, recipe)
    counter = OpCounter()
    launches.clear()
    with counter:
        step(module, x, recipe)
    kernel_launches = sum(launches.values())
    calls = collections.Counter()
    sys.setprofile(lambda frame, event, arg: calls.update((event,)))  # Python and C function calls made
    step(module, x, recipe)
    sys.setprofile(None)
    best = float("inf")
    for _ in range(5):  # the best of 5 rounds of this process's CPU time: other processes share these cores
        started = time.process_time()
        for _ in range(iters):
            step(module, x, recipe)
        best = min(best, time.process_time() - started)
    us = best / iters * 1e6
    top = ", ".join(f"{op.split('.')[-1]} {n}" for op, n in counter.counts.most_common(6))
    python_calls = calls["call"] + calls["c_call"]
    print(
        f"{name:28s} {us:8.0f} us {python_calls:6d} calls {sum(counter.counts.values()):5d} ops "
        f"{kernel_launches:4d} launches  ({top})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--recipes", default="delayed,current,block")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # intra-op threads would only wait on each other for these tiny ops
    launches = stub_kernels()
    x = torch.randn(16, 128, dtype=torch.bfloat16, requires_grad=True)  # tiny: the eager ops cost little arithmetic
    modules = {
        "Linear": Linear(128, 128, params_dtype=torch.bfloat16),
        "LayerNormMLP": LayerNormMLP(128, 256, params_dtype=torch.bfloat16),
        # DelayedScaling updates a region's modules together: what that costs per module shows with several
        "4 x LayerNormMLP": torch.nn.Sequential(
            *(LayerNormMLP(128, 256, params_dtype=torch.bfloat16) for _ in range(4))
        ),
        # 8 experts over the 16 rows, unevenly (one without tokens), as an MoE router leaves them
        "GroupedLinear x8": functools.partial(
            GroupedLinear(8, 128, 128, params_dtype=torch.bfloat16), m_splits=[1, 3, 0, 2, 4, 1, 2, 3]
        ),
    }
    print(f"# host_overhead, {environment_line()}")
    print(f"host time per fwd+bwd, kernels stubbed (best of 5 x {args.iters} iterations)")
    for recipe_name in args.recipes.split(","):
        for module_name, module in modules.items():
            measure(f"{module_name} {recipe_name}", module, x, recipe_from_name(recipe_name), args.iters, launches)


if __name__ == "__main__":
    main()
