"""Two clocks for a GPU call: the device's time, free of the host's, and the host's time per call.

A Python call that launches kernels costs the host tens to hundreds of microseconds (argument
checks, allocations, Triton's launch path). Timed with triton.testing.do_bench alone, a call whose
host time exceeds its device time measures the host: the H200 runs of 2026-12-01 read 0.35 ms
for a current-scaling quantize whose kernels take 0.21 ms. `device_ms` captures the call in a CUDA
graph and times the graph's replays (do_bench still clears L2 before each), so the GPU never waits
for Python; `host_us` is what the same call costs the CPU, back to back, as in a training step.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from triton.testing import do_bench


def device_ms(fn: Callable[[], object], rep: int = 100) -> float:
    """Median device milliseconds of fn(): one warm call (compile, autotune), then CUDA graph replays.

    fn must be capturable: no host synchronization, no CPU reads of device values.
    """
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    try:
        return do_bench(graph.replay, warmup=10, rep=rep, return_mode="median")
    finally:
        del graph
        torch.cuda.empty_cache()


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Host microseconds per call of fn(), calls issued back to back (the GPU catches up afterwards)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6
