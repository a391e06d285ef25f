"""What differs between torch 2.11 (the GPU machine) and 2.13 (CI), in one place for the whole project.

- `_StridedShard` (private): both keep it in `torch.distributed.tensor.placement_types` and build it
  with the keyword `split_factor` (2.13 also accepts `sf`, 2.11 does not); they print it differently,
  and it is not a `Shard` subclass there (it was one in older releases), so test for it
  (`is_strided_shard`) before testing for `Shard`.
- Under torch.compile, 2.11's Dynamo mis-traces in-place collectives inside an autograd.Function (the
  parameters behind them get zero gradients): `tp_comm` uses the functional collectives, on both.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard


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
    "is_strided_shard",
    "make_strided_shard",
    "placement_text",
    "split_factor_of",
    "strided_shard_type",
]
