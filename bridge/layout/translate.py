"""DTensor placements <-> JAX PartitionSpec: the exact equivalent, or the reason there is none.

"Equivalent" means equal shard maps (bridge.layout): every device holds the same elements.

Both sides name mesh axes alike and build the mesh in rank order. A JAX spec entry lists
the axes splitting a dim, most significant first. DTensor splits left to right over
mesh dims, each `Shard` taking the most significant part still free, so a dim whose
axes appear out of mesh order needs a `_StridedShard` whose split factor is the product
of the sizes of the later mesh axes that JAX puts before it:
`[_StridedShard(0, sf=|tp|), Shard(0)]` on ('dp', 'tp') is `P(('tp', 'dp'))`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from bridge import _torch_compat
from bridge.layout import (
    MeshSpec,
    ShardMap,
    check_placements,
    compare,
    from_placements,
    from_pspec,
    pspec_axes,
    sharded_dim,
)

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec
    from torch.distributed.tensor import Placement


def placements_to_pspec(
    mesh: MeshSpec, placements: Sequence[Placement], global_shape: Sequence[int], *, transpose: bool = False
) -> PartitionSpec:
    """The PartitionSpec putting the same elements on the same devices (`transpose`: for the [in, out] twin).

    The spec read off the placements' form comes first: where its dims divide evenly it gives DTensor's
    map (the tests check this against live DTensors). Where it does not exist, the verdict comes from shard
    maps: every spec of the mesh is tried and the first whose map equals DTensor's wins, since
    `torch.chunk` can make an uneven split JAX reproduces (4 rows, sf=3: chunks of 2, 2 and 0 rows).
    """
    from jax.sharding import PartitionSpec
    from torch.distributed.tensor import Partial

    shape = tuple(int(n) for n in global_shape)
    if transpose:
        _require_2d(len(shape))
    check_placements(mesh, placements)
    for name, placement in zip(mesh.axis_names, placements):
        if isinstance(placement, Partial):
            raise ValueError(
                f"{placement!r} on mesh axis {name!r} has no PartitionSpec equivalent: a NamedSharding places "
                f"finished values, not summands of a pending reduction; redistribute to Replicate() first"
            )
    try:
        entries = _spec_of_the_form(mesh, placements, shape)
    except ValueError as why_not:
        torch_map = from_placements(mesh, placements, shape)
        entries = next((e for e in _every_spec(mesh, len(shape)) if _gives_map(mesh, e, shape, torch_map)), None)
        if entries is None:
            raise why_not
    return PartitionSpec(*(entries[::-1] if transpose else entries))


def _spec_of_the_form(mesh: MeshSpec, placements: Sequence[Placement], shape: tuple[int, ...]) -> list[Any]:
    """The spec entries read off the placements: each split factor must be a product of later axes' sizes."""
    splits = _splits_per_dim(mesh, placements, shape)
    entries: list[Any] = []
    for dim, splits_of_dim in enumerate(splits):
        order: list[int] = []  # mesh dims splitting `dim`, most significant first
        for mesh_dim, split_factor in reversed(splits_of_dim):
            order.insert(_position_for(mesh, order, mesh_dim, split_factor, dim, placements[mesh_dim]), mesh_dim)
        names, parts = tuple(mesh.axis_names[k] for k in order), math.prod(mesh.shape[k] for k in order)
        if shape[dim] % parts:
            raise ValueError(
                f"no JAX equivalent: dim {dim} has size {shape[dim]}, which mesh axes {names} split into {parts} "
                f"parts; DTensor allows that (torch.chunk leaves trailing shards short or empty) but JAX rejects "
                f"dims that do not divide evenly (pad dim {dim} to {-(-shape[dim] // parts) * parts})"
            )
        entries.append(None if not names else names[0] if len(names) == 1 else names)
    return entries


def _every_spec(mesh: MeshSpec, ndim: int) -> Iterator[list[Any]]:
    """Spec entries of every PartitionSpec: each mesh axis of size > 1 unused or on one dim, in every order."""
    axes = [name for name, size in zip(mesh.axis_names, mesh.shape) if size > 1]
    for assignment in itertools.product(range(-1, ndim), repeat=len(axes)):
        per_dim = [[name for name, d in zip(axes, assignment) if d == dim] for dim in range(ndim)]
        for orders in itertools.product(*(itertools.permutations(names) for names in per_dim)):
            yield [None if not names else names[0] if len(names) == 1 else names for names in orders]


def _gives_map(mesh: MeshSpec, entries: list[Any], shape: tuple[int, ...], expected: ShardMap) -> bool:
    try:
        return compare(from_pspec(mesh, entries, shape), expected).equal
    except ValueError:  # JAX rejects this spec for this shape (a dim does not divide)
        return False


def pspec_to_placements(
    mesh: MeshSpec, pspec: PartitionSpec | Sequence[Any], ndim: int, *, transpose: bool = False
) -> tuple[Placement, ...]:
    """The DTensor placements matching a spec (`transpose`: the spec is for the [in, out] twin)."""
    from torch.distributed.tensor import Replicate, Shard

    axes_per_dim = pspec_axes(mesh, pspec, ndim)
    if transpose:
        _require_2d(ndim)
        axes_per_dim.reverse()
    placements: list[Placement] = [Replicate() for _ in range(mesh.ndim)]
    for dim, axes in enumerate(axes_per_dim):
        for position, name in enumerate(axes):
            mesh_dim = mesh.axis_index(name)
            # Axes JAX puts before this one but DTensor applies after it: their parts are the split factor.
            split_factor = math.prod(
                mesh.shape[mesh.axis_index(before)] for before in axes[:position] if mesh.axis_index(before) > mesh_dim
            )
            if split_factor == 1:
                placements[mesh_dim] = Shard(dim)
            else:
                placements[mesh_dim] = _torch_compat.make_strided_shard(dim, split_factor)
    return tuple(placements)


def _splits_per_dim(
    mesh: MeshSpec, placements: Sequence[Placement], shape: tuple[int, ...]
) -> list[list[tuple[int, int]]]:
    """Per tensor dim, (mesh dim, split factor) of every placement splitting it, in mesh order."""
    from torch.distributed.tensor import Shard

    check_placements(mesh, placements)
    splits: list[list[tuple[int, int]]] = [[] for _ in shape]
    for mesh_dim, placement in enumerate(placements):
        if mesh.shape[mesh_dim] == 1:  # a split into one part changes nothing; JAX needs no axis for it
            continue
        if _torch_compat.is_strided_shard(placement):
            splits[sharded_dim(placement, shape)].append((mesh_dim, _torch_compat.split_factor_of(placement)))
        elif isinstance(placement, Shard):
            splits[sharded_dim(placement, shape)].append((mesh_dim, 1))
    return splits


def _position_for(
    mesh: MeshSpec, order: list[int], mesh_dim: int, split_factor: int, dim: int, placement: Placement
) -> int:
    """Where `mesh_dim` goes among the later mesh dims: after those whose parts make its split factor."""
    prefix_products = [math.prod(mesh.shape[k] for k in order[:i]) for i in range(len(order) + 1)]
    if split_factor in prefix_products:
        return prefix_products.index(split_factor)
    raise ValueError(
        f"no JAX equivalent: {placement!r} on mesh axis {mesh.axis_names[mesh_dim]!r} cuts dim {dim} into "
        f"{split_factor} pieces first, but a PartitionSpec can only order whole mesh axes, so the split factor "
        f"must be one of {sorted(set(prefix_products))} (products of the later axes splitting dim {dim})"
    )


def _require_2d(ndim: int) -> None:
    if ndim != 2:
        raise ValueError(f"transpose swaps the dims of a 2-D weight ([out, in] <-> [in, out]); this tensor has {ndim}")
