"""Shard maps: which global indices each mesh coordinate holds, whoever placed them.

A `ShardMap` is the bridge's common ground between DTensor placements and JAX
shardings. Build one from DTensor placements or a live DTensor, from a JAX
`PartitionSpec`/`NamedSharding` or a live `jax.Array`, then `compare` two of them.
Placement <-> PartitionSpec translation lives in `bridge/layout/translate.py`.

Rules, each checked against the real frameworks in tests/bridge/test_layout*.py:
- DTensor applies placements left to right over the mesh dims; each `Shard(d)` splits
  the piece held so far along d with `torch.chunk` (ceil-sized chunks, so trailing
  chunks may be short or empty); `_StridedShard(d, sf)` first cuts the piece into `sf`
  chunks, splits each of those, and keeps the concatenation of its part of every chunk.
- JAX splits a dim over a tuple of mesh axes, the first axis most significant, and
  refuses a dim that the axes do not divide evenly.
- `Replicate` (torch) and an absent axis (JAX) leave the dim whole; along a `Partial`
  axis every coordinate holds the same indices, but as summands of a pending reduction.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from bridge import _torch_compat

if TYPE_CHECKING:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from torch.distributed.tensor import DTensor, Placement

Coordinate = tuple[int, ...]


@dataclass(frozen=True)
class MeshSpec:
    """A device mesh: axis sizes, axis names and the rank (device) at each coordinate.

    `ranks` is flat in row-major coordinate order; left out, the mesh is in rank order
    (coordinate c holds rank `ravel(c)`), which is how the bridge builds JAX meshes.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    ranks: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        if len(self.shape) != len(self.axis_names):
            raise ValueError(f"mesh shape {self.shape} and axis names {self.axis_names} differ in length")
        if len(set(self.axis_names)) != len(self.axis_names):
            raise ValueError(f"mesh axis names {self.axis_names} repeat a name; give every axis its own name")
        if any(size < 1 for size in self.shape):
            raise ValueError(f"mesh shape {self.shape} has an axis of size < 1; every axis needs at least 1 device")
        ranks = tuple(int(r) for r in self.ranks) or tuple(range(self.size))
        if len(ranks) != self.size:
            raise ValueError(f"mesh of shape {self.shape} needs {self.size} ranks, got {len(ranks)}")
        object.__setattr__(self, "ranks", ranks)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def coordinates(self) -> Iterator[Coordinate]:
        """Every mesh coordinate, in row-major order."""
        return iter(np.ndindex(*self.shape))

    def rank_of(self, coordinate: Coordinate) -> int:
        """The rank (device) at a mesh coordinate."""
        return self.ranks[int(np.ravel_multi_index(coordinate, self.shape))]

    def axis_index(self, name: str) -> int:
        """Position of a named axis; a clear error for a name the mesh lacks."""
        if name not in self.axis_names:
            raise ValueError(f"mesh axis {name!r} is not in the mesh; its axes are {self.axis_names}")
        return self.axis_names.index(name)

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in zip(self.axis_names, self.shape))

    def describe(self, coordinate: Coordinate) -> str:
        """`dp=0,tp=1`: a coordinate with its axis names (also the JSON key)."""
        return ",".join(f"{name}={c}" for name, c in zip(self.axis_names, coordinate))


@dataclass(frozen=True, eq=False)
class ShardMap:
    """For each mesh coordinate, the sorted global indices it holds along every tensor dim."""

    mesh: MeshSpec
    global_shape: tuple[int, ...]
    indices: Mapping[Coordinate, tuple[np.ndarray, ...]]
    partial_axes: tuple[str, ...] = ()

    def selectors(self, coordinate: Coordinate) -> tuple[slice | np.ndarray, ...]:
        """Per dim, a slice where the held indices are contiguous, else the index array."""
        return tuple(_as_slice_if_contiguous(held) for held in self.indices[coordinate])

    def local_shape(self, coordinate: Coordinate) -> tuple[int, ...]:
        """Shape of the local shard at a coordinate."""
        return tuple(len(held) for held in self.indices[coordinate])

    def replica_groups(self) -> list[tuple[Coordinate, ...]]:
        """Coordinates holding the same non-empty elements as copies (Partial summands are not copies)."""
        partial_dims = [self.mesh.axis_index(name) for name in self.partial_axes]
        groups: dict[Any, list[Coordinate]] = {}
        for coordinate, held in self.indices.items():
            if 0 in self.local_shape(coordinate):
                continue
            key = (tuple(coordinate[d] for d in partial_dims), tuple(tuple(h.tolist()) for h in held))
            groups.setdefault(key, []).append(coordinate)
        return [tuple(group) for group in groups.values()]

    def transposed(self) -> ShardMap:
        """The map of the transposed 2-D tensor: torch Linear `[out, in]` <-> Flax kernel `[in, out]`."""
        if len(self.global_shape) != 2:
            raise ValueError(f"only 2-D maps transpose; this one has shape {self.global_shape}")
        swapped = {coordinate: held[::-1] for coordinate, held in self.indices.items()}
        return ShardMap(self.mesh, self.global_shape[::-1], swapped, self.partial_axes)

    def to_json(self) -> dict[str, Any]:
        """A plain dict: mesh, ranks, shape, partial axes and {"dp=0,tp=1": per-dim index lists}."""
        return {
            "mesh": dict(zip(self.mesh.axis_names, self.mesh.shape)),
            "ranks": list(self.mesh.ranks),
            "shape": list(self.global_shape),
            "partial_axes": list(self.partial_axes),
            "shards": {
                self.mesh.describe(coordinate): [held.tolist() for held in self.indices[coordinate]]
                for coordinate in self.mesh.coordinates()
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ShardMap:
        """Read back what `to_json` wrote (golden files in tests/assets/shardmaps)."""
        mesh = MeshSpec(tuple(data["mesh"].values()), tuple(data["mesh"]), tuple(data.get("ranks", ())))
        indices = {
            coordinate: tuple(np.asarray(h, dtype=np.int64) for h in data["shards"][mesh.describe(coordinate)])
            for coordinate in mesh.coordinates()
        }
        return cls(mesh, tuple(data["shape"]), indices, tuple(data.get("partial_axes", ())))


@dataclass(frozen=True)
class Comparison:
    """The verdict of `compare`: equal, or the first difference found and why."""

    equal: bool
    reason: str
    coordinate: Coordinate | None = None
    dim: int | None = None
    left: np.ndarray | None = None
    right: np.ndarray | None = None


def compare(left: ShardMap, right: ShardMap) -> Comparison:
    """Whether two maps put the same elements on the same devices; else the first difference."""
    if (left.mesh.shape, left.mesh.axis_names) != (right.mesh.shape, right.mesh.axis_names):
        return Comparison(False, f"meshes differ: {left.mesh} vs {right.mesh}")
    if left.global_shape != right.global_shape:
        return Comparison(False, f"global shapes differ: {left.global_shape} vs {right.global_shape}")
    for coordinate in left.mesh.coordinates():
        if left.mesh.rank_of(coordinate) != right.mesh.rank_of(coordinate):
            return Comparison(
                False,
                f"mesh coordinate {left.mesh.describe(coordinate)} is rank {left.mesh.rank_of(coordinate)} on the "
                f"left but {right.mesh.rank_of(coordinate)} on the right; build both meshes in the same rank order",
                coordinate,
            )
    if set(left.partial_axes) != set(right.partial_axes):
        return Comparison(False, f"partial axes differ: {left.partial_axes} vs {right.partial_axes}")
    for coordinate in left.mesh.coordinates():
        for dim, (a, b) in enumerate(zip(left.indices[coordinate], right.indices[coordinate])):
            if not np.array_equal(a, b):
                return Comparison(
                    False,
                    f"at {left.mesh.describe(coordinate)} (rank {left.mesh.rank_of(coordinate)}) dim {dim} "
                    f"holds {a.tolist()} on the left but {b.tolist()} on the right",
                    coordinate,
                    dim,
                    a,
                    b,
                )
    return Comparison(True, "same layout: every device holds the same elements")


def check_placements(mesh: MeshSpec, placements: Sequence[Placement]) -> None:
    """One DTensor placement per mesh axis, or a clear error."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if len(placements) != mesh.ndim:
        raise ValueError(f"{len(placements)} placements for a {mesh.ndim}-D mesh {mesh}; give one per mesh axis")
    for placement in placements:
        if not isinstance(placement, Shard | Replicate | Partial) and not _torch_compat.is_strided_shard(placement):
            raise TypeError(f"{placement!r} is not a DTensor placement (Shard, _StridedShard, Replicate, Partial)")


def sharded_dim(placement: Any, shape: tuple[int, ...]) -> int:
    """The tensor dim a Shard/_StridedShard splits (negative dims counted from the end), checked against `shape`."""
    dim = placement.dim + len(shape) if placement.dim < 0 else placement.dim
    if not 0 <= dim < len(shape):
        raise ValueError(f"{placement!r} shards dim {placement.dim}, but the shape {shape} has {len(shape)} dims")
    return dim


def from_placements(mesh: MeshSpec, placements: Sequence[Placement], global_shape: Sequence[int]) -> ShardMap:
    """The layout DTensor gives a tensor of `global_shape` with these placements on `mesh`."""
    from torch.distributed.tensor import Partial, Shard

    shape = _checked_shape(global_shape)
    check_placements(mesh, placements)
    partial_axes = tuple(name for name, p in zip(mesh.axis_names, placements) if isinstance(p, Partial))
    indices = {}
    for coordinate in mesh.coordinates():
        held = [np.arange(n, dtype=np.int64) for n in shape]
        for mesh_dim, placement in enumerate(placements):
            parts, part = mesh.shape[mesh_dim], coordinate[mesh_dim]
            if _torch_compat.is_strided_shard(placement):
                dim = sharded_dim(placement, shape)
                split_factor = _torch_compat.split_factor_of(placement)
                if split_factor < 1:
                    raise ValueError(f"{placement!r} has split factor {split_factor}; it must be >= 1")
                held[dim] = np.concatenate([_chunk(c, parts, part) for c in _chunks(held[dim], split_factor)])
            elif isinstance(placement, Shard):
                dim = sharded_dim(placement, shape)
                held[dim] = _chunk(held[dim], parts, part)
        indices[coordinate] = tuple(held)
    return ShardMap(mesh, shape, indices, partial_axes)


def from_dtensor(dtensor: DTensor) -> ShardMap:
    """The layout of a live DTensor, read from its mesh (ranks included), placements and shape."""
    device_mesh = dtensor.device_mesh
    names = device_mesh.mesh_dim_names or tuple(f"mesh_dim_{i}" for i in range(device_mesh.ndim))
    mesh = MeshSpec(tuple(device_mesh.mesh.shape), tuple(names), tuple(device_mesh.mesh.flatten().tolist()))
    return from_placements(mesh, dtensor.placements, tuple(dtensor.shape))


def pspec_axes(mesh: MeshSpec, pspec: PartitionSpec | Sequence[Any], ndim: int) -> list[tuple[str, ...]]:
    """Per tensor dim, the mesh axes splitting it (most significant first), validated against the mesh."""
    entries = tuple(pspec)
    if len(entries) > ndim:
        raise ValueError(f"partition spec {entries} has {len(entries)} entries but the tensor has {ndim} dims")
    for attribute in ("unreduced", "reduced"):
        if getattr(pspec, attribute, None):
            raise ValueError(f"partition spec {pspec} has {attribute} axes; the bridge maps only placed data")
    axes_per_dim: list[tuple[str, ...]] = []
    for entry in entries + (None,) * (ndim - len(entries)):
        if entry is None:
            axes = ()
        elif isinstance(entry, str):
            axes = (entry,)
        elif isinstance(entry, tuple | list) and all(isinstance(name, str) for name in entry):
            axes = tuple(entry)
        else:
            raise TypeError(f"partition spec entry {entry!r} must be None, an axis name or a tuple of axis names")
        for name in axes:
            mesh.axis_index(name)
        axes_per_dim.append(axes)
    used = [name for axes in axes_per_dim for name in axes]
    if len(set(used)) != len(used):
        raise ValueError(f"partition spec {entries} uses a mesh axis twice; each axis may split one dim once")
    return axes_per_dim


def from_pspec(mesh: MeshSpec, pspec: PartitionSpec | Sequence[Any], global_shape: Sequence[int]) -> ShardMap:
    """The layout JAX gives `NamedSharding(mesh, pspec)` for `global_shape` (closed form, no devices)."""
    shape = _checked_shape(global_shape)
    axes_per_dim = pspec_axes(mesh, pspec, len(shape))
    for dim, (size, axes) in enumerate(zip(shape, axes_per_dim)):
        parts = math.prod(mesh.shape[mesh.axis_index(name)] for name in axes)
        if size % parts:
            raise ValueError(
                f"JAX rejects this layout: dim {dim} has size {size}, which mesh axes {axes} split into {parts} "
                f"parts, and JAX shards only evenly divisible dims (pad dim {dim} to {-(-size // parts) * parts})"
            )
    indices = {}
    for coordinate in mesh.coordinates():
        held = []
        for size, axes in zip(shape, axes_per_dim):
            block, parts = 0, 1
            for name in axes:
                axis = mesh.axis_index(name)
                block, parts = block * mesh.shape[axis] + coordinate[axis], parts * mesh.shape[axis]
            length = size // parts
            held.append(np.arange(block * length, (block + 1) * length, dtype=np.int64))
        indices[coordinate] = tuple(held)
    return ShardMap(mesh, shape, indices)


def from_named_sharding(sharding: NamedSharding, global_shape: Sequence[int]) -> ShardMap:
    """The layout JAX itself reports (`devices_indices_map`) for a `NamedSharding`."""
    shape = _checked_shape(global_shape)
    mesh = _jax_mesh_spec(sharding)
    try:
        device_indices = sharding.devices_indices_map(shape)
    except ValueError as error:  # jax's IndivisibleError: uneven dims
        raise ValueError(f"JAX rejects {sharding.spec} for shape {shape}: {error}") from error
    return _map_from_device_slices(sharding, mesh, shape, device_indices.items())


def from_jax_array(array: jax.Array) -> ShardMap:
    """The layout of a live `jax.Array`, read from the shards its devices hold."""
    from jax.sharding import NamedSharding

    if not isinstance(array.sharding, NamedSharding):
        raise TypeError(f"the array's sharding is {type(array.sharding).__name__}; place it with a NamedSharding")
    if not array.is_fully_addressable:
        raise ValueError("the array spans other processes; use from_named_sharding(array.sharding, array.shape)")
    mesh = _jax_mesh_spec(array.sharding)
    shards = ((shard.device, shard.index) for shard in array.addressable_shards)
    return _map_from_device_slices(array.sharding, mesh, tuple(array.shape), shards)


def _map_from_device_slices(sharding, mesh: MeshSpec, shape: tuple[int, ...], device_slices) -> ShardMap:
    coordinate_of = {device: tuple(int(c) for c in index) for index, device in np.ndenumerate(sharding.mesh.devices)}
    indices = {
        coordinate_of[device]: tuple(np.arange(n, dtype=np.int64)[s] for n, s in zip(shape, slices))
        for device, slices in device_slices
    }
    return ShardMap(mesh, shape, indices)


def _jax_mesh_spec(sharding: NamedSharding) -> MeshSpec:
    import jax

    devices = sharding.mesh.devices
    # Rank = position in jax.devices(): the co-located runtime puts torch rank i on device i.
    rank_of = {device: i for i, device in enumerate(jax.devices(devices.flat[0].platform))}
    return MeshSpec(devices.shape, tuple(sharding.mesh.axis_names), tuple(rank_of[d] for d in devices.flat))


def _checked_shape(global_shape: Sequence[int]) -> tuple[int, ...]:
    shape = tuple(int(n) for n in global_shape)
    if not shape or any(n < 1 for n in shape):
        raise ValueError(f"global shape {tuple(global_shape)} must have at least one dim, every size >= 1")
    return shape


def _chunks(held: np.ndarray, parts: int) -> list[np.ndarray]:
    return [_chunk(held, parts, part) for part in range(parts)]


def _chunk(held: np.ndarray, parts: int, part: int) -> np.ndarray:
    """Chunk `part` of `parts` as torch.chunk cuts it: ceil-sized, so the last ones may be short or empty."""
    size = -(-len(held) // parts)
    return held[min(part * size, len(held)) : min((part + 1) * size, len(held))]


def _as_slice_if_contiguous(held: np.ndarray) -> slice | np.ndarray:
    if len(held) == 0:
        return slice(0, 0)
    if np.array_equal(held, np.arange(held[0], held[0] + len(held))):
        return slice(int(held[0]), int(held[0]) + len(held))
    return held
