"""`CapturedCall`: a function of static device buffers run eagerly a few times, then captured once in a CUDA
graph and replayed, so that its launches cost the host nothing (torchside.train's `--cuda-graphs`).

What a captured function must be (the graph replays the kernels recorded at capture, nothing else):

- fixed shapes, dtypes and tensor addresses: it reads its inputs from buffers the caller refills
  in place between calls (`copy_`, `fill_`), and writes results that the next replay overwrites;
- no host synchronization: no `.item()`, `int(tensor)`, `.tolist()`, `.cpu()` and no Python branch on a
  tensor's value (the branch taken at capture would be replayed forever); values that change per call
  (learning rate, step counts, FP8 scales and amax histories) live on the device and are read there;
- no CPU tensors and no copies from pageable host memory;
- one-time work (Triton compilation and autotuning, optimizer state, launch tables, FP8 quantizer
  caches) done before the capture: the warm-up calls run it eagerly, on a side stream as
  torch.cuda.graph requires.

A function that breaks a rule fails at capture with torch's error, re-raised as `CaptureError` saying what
to look for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")

DEFAULT_WARMUP_CALLS = 3  # TransformerEngine's make_graphed_callables default (num_warmup_iters)


class CaptureError(RuntimeError):
    """A function could not be captured in a CUDA graph."""


class CapturedCall(Generic[T]):
    """fn() eagerly for the first `warmup_calls` calls, then captured once and replayed on every later call.

    Each call does fn's work once: the call that captures also replays (a capture runs nothing). fn's
    result is returned as captured: static tensors that every replay overwrites (copy what must outlive
    the next call). `capture=False` runs every call eagerly with the same buffers and order: the
    eager reference a graphed run must equal bit for bit.
    """

    def __init__(self, fn: Callable[[], T], *, warmup_calls: int = DEFAULT_WARMUP_CALLS, capture: bool = True):
        if isinstance(warmup_calls, bool) or not isinstance(warmup_calls, int) or warmup_calls < 1:
            raise ValueError(f"CapturedCall(warmup_calls={warmup_calls!r}): pass an integer >= 1 (compile, autotune)")
        if capture and not torch.cuda.is_available():
            raise CaptureError("CUDA graphs need a CUDA device: pass capture=False (or run on a GPU)")
        self.fn, self.warmup_calls, self.capture = fn, warmup_calls, capture
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self._result: T | None = None
        self._side_stream = torch.cuda.Stream() if capture else None

    def __call__(self) -> T:
        self.calls += 1
        if not self.capture:
            return self.fn()
        if self.graph is None and self.calls <= self.warmup_calls:
            return self._warm_up()
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self._result

    def _warm_up(self) -> T:
        # torch.cuda.graph's rule: warm up on a side stream, so lazy initializations (autograd's stream
        # bookkeeping, cuBLAS handles and workspaces) do not land on the capture's stream state.
        stream = self._side_stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            result = self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        return result

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA work (an async checkpoint's staging copies) may go on meanwhile
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self._result = self.fn()
        except Exception as error:
            raise CaptureError(
                f"capturing the step in a CUDA graph failed ({type(error).__name__}: {error}). A captured step needs "
                "fixed shapes, device tensors only, and no host synchronization (.item(), int(tensor), .tolist(), "
                "a copy from pageable host memory, a Python branch on a tensor's value): see torchside.cuda_graphs"
            ) from error
        self.graph = graph


__all__ = ["DEFAULT_WARMUP_CALLS", "CaptureError", "CapturedCall"]
