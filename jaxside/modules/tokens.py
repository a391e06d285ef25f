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


def _stack(name: str) -> list[int]:
    if not hasattr(_THREAD_STATE, name):
        setattr(_THREAD_STATE, name, [])
    return getattr(_THREAD_STATE, name)


@contextlib.contextmanager
def _pushed(name: str, value: int) -> Iterator[None]:
    stack = _stack(name)
    stack.append(value)
    try:
        yield
    finally:
        stack.pop()


def _innermost(name: str) -> int | None:
    stack = _stack(name)
    return stack[-1] if stack else None


def _checked_int(value: object, minimum: int, call: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{call}({value!r}): pass {what}, an integer >= {minimum}")
    return value


def batch_dim(dim: int) -> contextlib.AbstractContextManager[None]:
    """FP8 GEMMs called inside read dim `dim` of their input as the batch (the innermost context decides)."""
    return _pushed("batch_dims", _checked_int(dim, 0, "batch_dim", "the batch's dim index"))


def current_batch_dim() -> int | None:
    """The innermost `batch_dim` of this thread, or None outside any (the GEMM then casts all tokens together)."""
    return _innermost("batch_dims")


def data_parallel_groups(groups: int) -> contextlib.AbstractContextManager[None]:
    """FP8 GEMMs called inside cast their tokens in `groups` equal groups along the batch dim, as that many
    data-parallel ranks would, whatever mesh they run on: one device reproduces a G-rank run's FP8 numerics."""
    return _pushed("groups", _checked_int(groups, 1, "data_parallel_groups", "the number of data-parallel ranks"))


def forced_data_parallel_groups() -> int | None:
    """The innermost `data_parallel_groups` of this thread, or None (the mesh's data shards decide)."""
    return _innermost("groups")
