"""Which dim of an activation is the batch, for the FP8 GEMMs called inside: `batch_dim(dim)`; and
`data_parallel_groups(g)`: cast as g data-parallel ranks would, without their mesh.

On a make_mesh mesh data parallelism splits the batch, and each torch rank casts the tokens it
holds, with its own amax and its own token blocks. An FP8 GEMM can only cast per data-parallel
shard as torch does if it knows which dim that split is on; the modules that know the layout
(TransformerLayer, MultiheadAttention: `qkv_format`) open this context around their calls.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_THREAD_STATE = threading.local()  # .batch_dims, .groups: the stacks of open contexts, made on first use


def _stack(name: str = "batch_dims") -> list[int]:
    if not hasattr(_THREAD_STATE, name):
        setattr(_THREAD_STATE, name, [])
    return getattr(_THREAD_STATE, name)


@contextlib.contextmanager
def batch_dim(dim: int) -> Iterator[None]:
    """FP8 GEMMs called inside read dim `dim` of their input as the batch (the innermost context decides)."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise ValueError(f"batch_dim({dim!r}): pass the batch's dim index, an integer >= 0")
    stack = _stack()
    stack.append(dim)
    try:
        yield
    finally:
        stack.pop()


def current_batch_dim() -> int | None:
    """The innermost `batch_dim` of this thread, or None outside any (the GEMM then casts all tokens together)."""
    stack = _stack()
    return stack[-1] if stack else None


@contextlib.contextmanager
def data_parallel_groups(groups: int) -> Iterator[None]:
    """FP8 GEMMs called inside cast their tokens in `groups` equal groups along the batch dim, as that many
    data-parallel ranks would, whatever mesh they run on: one device reproduces a G-rank run's FP8 numerics."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise ValueError(f"data_parallel_groups({groups!r}): pass the number of data-parallel ranks, an integer >= 1")
    stack = _stack("groups")
    stack.append(groups)
    try:
        yield
    finally:
        stack.pop()


def forced_data_parallel_groups() -> int | None:
    """The innermost `data_parallel_groups` of this thread, or None (the mesh's data shards decide)."""
    stack = _stack("groups")
    return stack[-1] if stack else None
