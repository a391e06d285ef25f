"""What differs between torch 2.11 (the GPU machine) and 2.13 (CI), in one place for the whole project.

- `_StridedShard` (private): both keep it in `torch.distributed.tensor.placement_types` and build it
  with the keyword `split_factor` (2.13 also accepts `sf`, 2.11 does not); they print it differently,
  and it is not a `Shard` subclass there (it was one in older releases), so test for it
  (`is_strided_shard`) before testing for `Shard`.
- 2.13 renames `all_gather_into_tensor` / `reduce_scatter_tensor` to `all_gather_single` /
  `reduce_scatter_single` (the old names warn); 2.11 has only the old ones.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import Partial, Placement, Replicate, Shard


def all_gather_single(output: Tensor, tensor: Tensor, group: dist.ProcessGroup) -> None:
    """Concatenate every rank's `tensor` along dim 0 into `output`."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def reduce_scatter_single(output: Tensor, tensor: Tensor, group: dist.ProcessGroup) -> None:
    """Sum `tensor` over the ranks and write this rank's dim-0 block into `output`."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    scatter(output, tensor, op=dist.ReduceOp.SUM, group=group)


def strided_shard_type() -> type:
    """The `_StridedShard` class of the installed torch."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard


def make_strided_shard(dim: int, split_factor: int) -> Placement:
    """`_StridedShard(dim, split_factor)`, built the way both releases accept."""
    return strided_shard_type()(dim, split_factor=split_factor)


def is_strided_shard(placement: object) -> bool:
    """Whether `placement` is a `_StridedShard` (check this before `isinstance(p, Shard)`)."""
    return isinstance(placement, strided_shard_type())


def split_factor_of(placement: Placement) -> int:
    """The split factor of a `_StridedShard` as a plain int."""
    return int(placement.split_factor)


def placement_text(placement: Placement) -> str:
    """A release-independent name: `S(0)`, `SS(0,sf=2)` (strided), `R`, `P`."""
    if is_strided_shard(placement):
        return f"SS({placement.dim},sf={split_factor_of(placement)})"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    raise TypeError(f"{placement!r} is not a DTensor placement")


__all__ = [
    "all_gather_single",
    "is_strided_shard",
    "make_strided_shard",
    "placement_text",
    "reduce_scatter_single",
    "split_factor_of",
    "strided_shard_type",
]
