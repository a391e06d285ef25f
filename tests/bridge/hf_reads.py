"""Bytes a process reads from safetensors files, counted where the library hands them out; a gloo rank's HF import.

safetensors maps a file (mmap) and parses only the header with read(): a slice of a tensor is a view
of the mapping (framework "pt") or a copy of the sliced bytes ("numpy", "flax"), so /proc/self/io's
rchar sees the headers and none of the weights, and page counts are too coarse for test-sized tensors
(4 KiB pages, a 64 KiB fault-around window, rows of a few hundred bytes). So every tensor safetensors
returns (`get_slice(name)[...]`, `get_tensor(name)`) is counted by its bytes, whatever the caller does
with it: a loader that read whole tensors and cut its shard out afterwards counts the whole tensors.
Reads that bypass `safetensors.safe_open` (a name bound before `count_reads`, as `safetensors.torch`
binds it) are not seen: the test therefore also requires each rank's count to be positive. Counts are
kept by thread name, so that ranks on threads (tests.distributed.run_threads) count their own reads.

Kept apart from the test modules so that a spawned rank imports torch and the loader only.
"""

from __future__ import annotations

import threading
from typing import Any, Self

import safetensors

_tensor_bytes: dict[str, int] = {}  # by thread name


def _count(nbytes: int) -> None:
    name = threading.current_thread().name
    _tensor_bytes[name] = _tensor_bytes.get(name, 0) + nbytes


class _CountingSlice:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getitem__(self, index):
        values = self._inner[index]
        _count(values.nbytes)
        return values

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


class _CountingFile:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __enter__(self) -> Self:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._inner.__exit__(*exc)

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self._inner.get_slice(name))

    def get_tensor(self, name: str):
        values = self._inner.get_tensor(name)
        _count(values.nbytes)
        return values

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def counting(safe_open):
    """`safe_open` whose files count every tensor byte they hand out (`tensor_bytes`)."""

    def counting_safe_open(*args, **kwargs) -> _CountingFile:
        return _CountingFile(safe_open(*args, **kwargs))

    return counting_safe_open


def count_reads() -> None:
    """From now on, count in this process every tensor byte `safetensors.safe_open` hands out (`tensor_bytes`)."""
    if safetensors.safe_open.__name__ != "counting_safe_open":  # a test patched it already
        safetensors.safe_open = counting(safetensors.safe_open)


def tensor_bytes() -> int:
    """The bytes counted so far on the calling thread."""
    return _tensor_bytes.get(threading.current_thread().name, 0)


def load_on_fsdp_tp_rank(rank: int, world_size: int, directory: str, tokens):
    """One rank (gloo process or thread) of a 2 x 2 FSDP2 x TP `load_hf`: (logits [B, S, V], embedding shape
    and placements, this rank's local parameter elements and bytes, the tensor bytes it read from the checkpoint)."""
    from torch.distributed.tensor import DTensor

    from tests.bridge.hf_cases import torch_logits
    from torchside.models import llama as torch_llama
    from torchside.models.llama_parallel import build_meshes

    count_reads()
    meshes = build_meshes("cpu", dp=2, tp=2)
    before = tensor_bytes()
    model = torch_llama.load_hf(directory, mesh=meshes.data, tp_mesh=meshes.tp)
    read = tensor_bytes() - before
    local = [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]
    embedding = model.embedding.weight
    placements = tuple(type(p).__name__ for p in embedding.placements)
    local_elements, local_bytes = sum(t.numel() for t in local), sum(t.nbytes for t in local)
    return torch_logits(model, tokens), tuple(embedding.shape), placements, local_elements, local_bytes, read
