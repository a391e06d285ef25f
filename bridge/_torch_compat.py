"""The one place that touches torch's private `_StridedShard` placement.

Its home and constructor differ between releases: torch 2.11 and 2.13 both keep it in
`torch.distributed.tensor.placement_types` and accept only the keyword `split_factor`
(2.13 also takes `sf`, 2.11 does not); older releases kept it under
`torch.distributed._tensor`. It is not a `Shard` subclass in 2.11 or 2.13, but was one
before, so callers must test for it before testing for `Shard`.
"""

from __future__ import annotations

from typing import Any


def strided_shard_type() -> type:
    """The `_StridedShard` class of the installed torch."""
    try:
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor.placement_types import _StridedShard
    return _StridedShard


def make_strided_shard(dim: int, split_factor: int) -> Any:
    """A `_StridedShard(dim, split_factor)` placement, built the way every release accepts."""
    return strided_shard_type()(dim, split_factor=split_factor)


def is_strided_shard(placement: object) -> bool:
    """Whether `placement` is a `_StridedShard` (check this before `isinstance(p, Shard)`)."""
    return isinstance(placement, strided_shard_type())


def split_factor_of(placement: Any) -> int:
    """The split factor of a `_StridedShard` as a plain int."""
    return int(placement.split_factor)
