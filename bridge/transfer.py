"""Zero-copy exchange of sharded tensors between torch and JAX on the same devices.

torch -> JAX: each process's local shard of a DTensor crosses by DLPack (the JAX buffer is the
torch storage) and `jax.make_array_from_single_device_arrays` assembles the global `jax.Array`
with the NamedSharding that puts the same elements on the same devices. bridge.layout decides
that sharding (`placements_to_pspec`) and checks it rank by rank; a layout JAX cannot express (a
`Partial`, a dim torch.chunk splits unevenly, a DTensor spanning only some of the mesh's devices)
is refused with the reason. JAX -> torch is the reverse: each addressable shard crosses by DLPack
and becomes the local tensor of a DTensor with the equivalent placements. No full tensor is
gathered anywhere, and the tensor keeps the framework's own layout: a torch Linear weight
[out, in] crosses as [out, in] (bridge.params turns it into a Flax kernel, in JAX).

Aliasing: the two sides share memory. A JAX array made here sees later in-place writes to the
torch shard (an optimizer step, an FSDP2 copy-in); copy it in JAX (`jnp.copy`) to keep a
snapshot. Streams: the producer's work is finished first (the torch stream is synchronized
before export, JAX arrays are waited for), so the consumer never reads a buffer being written.

FP8: float8 tensors cross as they are (DLPack knows e4m3/e5m2), or as uint8 with `as_bytes`;
a QuantizedTensor shard crosses as its rowwise bytes and `scale_inv` (`QuantizedArrays`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from bridge import layout
from bridge.layout.translate import placements_to_pspec

if TYPE_CHECKING:
    import jax
    import torch
    from jax.sharding import Mesh, NamedSharding
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Placement


@dataclass(frozen=True)
class QuantizedArrays:
    """An FP8/FP4 parameter in JAX: its rowwise bytes (sharded as the parameter) and their scales."""

    data: jax.Array  # [rows, cols / elements per byte]
    scale_inv: jax.Array  # per tensor: (1,) replicated; per block: the scale grid, sharded as the data
    scheme: str
    fmt: str
    amax: jax.Array | None = None  # NVFP4's global amax (1,), replicated; None for the FP8 schemes


def torch_mesh_spec(device_mesh: DeviceMesh) -> layout.MeshSpec:
    """A torch DeviceMesh as bridge.layout sees it: shape, dim names and the rank at every coordinate."""
    names = device_mesh.mesh_dim_names
    if not names:
        raise ValueError("the DeviceMesh has unnamed dims: build it with init_device_mesh(..., mesh_dim_names=...)")
    return layout.MeshSpec(tuple(device_mesh.mesh.shape), tuple(names), tuple(device_mesh.mesh.flatten().tolist()))


def equivalent_sharding(
    device_mesh: DeviceMesh, placements: Sequence[Placement], global_shape: Sequence[int], mesh: Mesh
) -> NamedSharding:
    """The NamedSharding on `mesh` holding on every rank what these placements hold there, or ValueError why none."""
    return sharding_for(torch_mesh_spec(device_mesh), tuple(placements), tuple(global_shape), mesh)


@functools.lru_cache(maxsize=4096)  # a model has few distinct (mesh, placements, shape) triples
def sharding_for(
    torch_mesh: layout.MeshSpec, placements: tuple[Placement, ...], shape: tuple[int, ...], mesh: Mesh
) -> NamedSharding:
    """`equivalent_sharding` for a torch mesh described by a MeshSpec (ranks = JAX device positions)."""
    from jax.sharding import NamedSharding

    missing = [name for name in torch_mesh.axis_names if name not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"torch mesh axes {missing} are not axes of the JAX mesh {tuple(mesh.axis_names)}: build the JAX mesh "
            "with bridge.runtime.jax_mesh, or name the torch mesh dims after the JAX axes"
        )
    torch_map = layout.from_placements(torch_mesh, placements, shape)
    sharding = NamedSharding(mesh, placements_to_pspec(torch_mesh, placements, shape))  # ValueError: no equivalent
    jax_map = layout.from_named_sharding(sharding, shape)
    _check_same_by_rank(torch_map, jax_map)
    return sharding


def _check_same_by_rank(torch_map: layout.ShardMap, jax_map: layout.ShardMap) -> None:
    """Every rank holds the same indices on both sides (the meshes may differ by axes of size 1)."""
    torch_ranks = {torch_map.mesh.rank_of(c): c for c in torch_map.mesh.coordinates()}
    jax_ranks = {jax_map.mesh.rank_of(c): c for c in jax_map.mesh.coordinates()}
    if set(torch_ranks) != set(jax_ranks):
        raise ValueError(
            f"the DTensor spans ranks {sorted(torch_ranks)} but the JAX mesh spans {sorted(jax_ranks)}: a jax.Array "
            "lives on its whole mesh, so give the DTensor a mesh over all of them (or build a JAX mesh of its ranks)"
        )
    for rank, coordinate in sorted(torch_ranks.items()):
        held, expected = jax_map.indices[jax_ranks[rank]], torch_map.indices[coordinate]
        for dim, (a, b) in enumerate(zip(held, expected)):
            if a.shape != b.shape or (a != b).any():
                raise ValueError(f"rank {rank} holds other indices of dim {dim} in JAX than in torch")


def to_jax(tensor: DTensor, mesh: Mesh, *, as_bytes: bool = False) -> jax.Array:
    """This DTensor as a global jax.Array on `mesh` (same layout), its shards aliasing torch's local storage."""
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        raise TypeError(f"to_jax takes a DTensor, got {type(tensor).__name__}; wrap a local shard with from_local")
    local = tensor._local_tensor  # the storage itself, outside autograd (to_local() would add a view node)
    if hasattr(local, "quantized_storage"):
        raise TypeError("this DTensor holds FP8/FP4 bytes: move it with quantized_to_jax")
    return local_to_jax(local, tensor.device_mesh, tensor.placements, tuple(tensor.shape), mesh, as_bytes=as_bytes)


def local_to_jax(
    local: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    global_shape: Sequence[int],
    mesh: Mesh,
    *,
    as_bytes: bool = False,
) -> jax.Array:
    """A local shard laid out by `placements` on `device_mesh` as the global jax.Array it is a part of."""
    import jax

    sharding = equivalent_sharding(device_mesh, placements, global_shape, mesh)
    shard = _export_torch(local, as_bytes)
    shape = tuple(global_shape)
    if as_bytes and local.element_size() != 1:
        raise ValueError(f"as_bytes views 1-byte elements only (FP8 bytes); this shard is {local.dtype}")
    expected = sharding.shard_shape(shape)
    if tuple(shard.shape) != expected:
        raise ValueError(f"the local shard is {tuple(shard.shape)} but {sharding.spec} gives {expected} for {shape}")
    return jax.make_array_from_single_device_arrays(shape, sharding, [shard])


def _export_torch(local: torch.Tensor, as_bytes: bool) -> jax.Array:
    import jax
    import torch

    if not local.is_contiguous():
        raise ValueError(
            f"a shard of shape {tuple(local.shape)} with strides {local.stride()} is not contiguous; DLPack would "
            "copy it: pass a contiguous shard (.contiguous() copies it once)"
        )
    if as_bytes:
        local = local.view(torch.uint8)
    if local.is_cuda:
        torch.cuda.current_stream(local.device).synchronize()  # JAX reads on its own stream
    return jax.dlpack.from_dlpack(local)


def quantized_to_jax(tensor: DTensor, mesh: Mesh, *, as_bytes: bool = False) -> QuantizedArrays:
    """A DTensor of FP8/FP4 weight shards as its rowwise bytes (sharded as the weight) and scale_inv."""
    from torchside.quantization.storage import buffer_shapes

    local = tensor._local_tensor
    storage = getattr(local, "quantized_storage", None)
    if storage is None:
        raise TypeError("this DTensor holds high-precision values: move it with to_jax")
    if tensor.ndim != 2 or storage.rowwise_data is None:
        raise ValueError(
            f"quantized_to_jax moves 2-D weights with a rowwise copy; this one is {tuple(tensor.shape)} "
            f"{storage.describe()}"
        )
    rows, cols = tensor.shape
    global_shapes = buffer_shapes(storage, rows, cols)
    data = local_to_jax(
        storage.rowwise_data, tensor.device_mesh, tensor.placements, global_shapes["rowwise_data"], mesh,
        as_bytes=as_bytes,
    )  # fmt: skip
    if storage.block is None:  # one scale for the whole weight: every rank holds the same (1,) buffer
        scale_inv = _replicated(storage.rowwise_scale_inv, mesh)
    else:
        scale_inv = local_to_jax(
            storage.rowwise_scale_inv, tensor.device_mesh, tensor.placements, global_shapes["rowwise_scale_inv"], mesh
        )
    amax = None if storage.tensor_amax is None else _replicated(storage.tensor_amax, mesh)
    return QuantizedArrays(data, scale_inv, storage.scheme, storage.fmt, amax)


def _replicated(local: torch.Tensor, mesh: Mesh) -> jax.Array:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.make_array_from_single_device_arrays(
        tuple(local.shape), NamedSharding(mesh, PartitionSpec()), [_export_torch(local, False)]
    )


def to_torch(array: jax.Array, device_mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A jax.Array as a DTensor with these placements, its local shard aliasing JAX's buffer.

    The array must already be laid out as the placements say (`equivalent_sharding`; reshard it
    in JAX first, e.g. `jax.device_put(array, sharding)`), else ValueError.
    """
    from torch.distributed.tensor import DTensor

    shape = tuple(array.shape)
    expected = equivalent_sharding(device_mesh, placements, shape, array.sharding.mesh)
    if not array.sharding.is_equivalent_to(expected, array.ndim):
        raise ValueError(
            f"the array is laid out as {array.sharding.spec}, not as {expected.spec} (the equivalent of "
            f"{tuple(placements)}): reshard it in JAX first, jax.device_put(array, bridge.transfer.equivalent_sharding(...))"
        )
    local = local_from_jax(array)
    return DTensor.from_local(local, device_mesh, tuple(placements), run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))  # fmt: skip


def local_from_jax(array: jax.Array) -> torch.Tensor:
    """This process's one shard of a jax.Array as a torch tensor on the same buffer."""
    import torch

    shards = array.addressable_shards
    if len(shards) != 1:
        raise ValueError(
            f"this process holds {len(shards)} shards of the array; the co-located runtime gives each one device"
        )
    data = shards[0].data.block_until_ready()  # the JAX program that writes it has finished
    return torch.from_dlpack(data)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, strides = 1, []
    for size in reversed(shape):
        strides.append(stride)
        stride *= size
    return tuple(reversed(strides))


__all__ = [
    "QuantizedArrays",
    "equivalent_sharding",
    "local_from_jax",
    "local_to_jax",
    "quantized_to_jax",
    "sharding_for",
    "to_jax",
    "to_torch",
    "torch_mesh_spec",
]
