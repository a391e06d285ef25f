"""Orbax boxes: read any box of a saved array with TensorStore, write a tree placed on this process's devices.

An Orbax checkpoint (jaxside.checkpoint's step directory) stores each array as a zarr array inside
an OCDBT database, named by its dotted tree path; TensorStore opens that array and reads the byte
ranges of one box, whatever mesh saved it. Keys nest at the dots (`model.layers.0.fc1_kernel` is
tree["model"]["layers"]["0"]["fc1_kernel"]).

Writing: each array is built with `jax.make_array_from_callback` on a sharding over this process's
devices (dim 0 split one block per device when it splits evenly, else replicated), so each device's
shard is read and transposed box by box; Orbax then commits the tree atomically. Orbax writes one
tree per save, so this process holds its shards of every array until the save ends: its share of the
model, not one shard (the DCP and safetensors writers stream instead).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from bridge.convert_plan import Box, TensorInfo


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """The same bytes as a numpy array of the matching (ml_dtypes) dtype."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 and the float8 dtypes with numpy)

    dtype = np.dtype(str(tensor.dtype).removeprefix("torch."))
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().view(dtype).reshape(tensor.shape)


def from_numpy(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor of `dtype` holding the array's bytes."""
    flat = torch.from_numpy(np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    return flat.view(getattr(torch, dtype)).reshape(array.shape)


class OrbaxReader:
    """The arrays of an Orbax checkpoint (a committed step directory), read a box at a time."""

    def __init__(self, path: str | os.PathLike) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.path = Path(path).absolute()
        if not (self.path.is_dir() and ocp.step.is_path_finalized(self.path)):
            raise ValueError(f"{self.path} is not a committed Orbax checkpoint; pass a step directory (step-<N>)")
        with ocp.StandardCheckpointer() as checkpointer:
            tree = checkpointer.metadata(self.path).item_metadata.tree
        self.tensors, self.skipped, self._stores = {}, [], {}
        for _, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = leaf.name
            self.tensors[name] = TensorInfo(name, tuple(leaf.shape), str(np.dtype(leaf.dtype)))

    def _store(self, key: str):
        import tensorstore as ts

        if key not in self._stores:
            kvstore = {"driver": "ocdbt", "base": f"file://{self.path}/", "path": key}
            self._stores[key] = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True).result()
        return self._stores[key]

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of array `key` (TensorStore reads only the chunks that overlap it)."""
        offsets, sizes = box
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        return from_numpy(self._store(key)[index].read().result(), self.tensors[key].dtype)


def nest(flat: dict[str, object]) -> dict:
    """Dotted keys as nested dicts: the tree an Orbax checkpoint written here holds."""
    tree: dict = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return tree


def sharding_for(shape: tuple[int, ...], devices: Sequence):
    """Dim 0 split one block per device when it splits evenly (block i on devices[i]), else replicated."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from bridge.convert_plan import split_rows

    mesh = Mesh(np.array(devices), ("owners",))
    return NamedSharding(mesh, PartitionSpec("owners") if split_rows(shape, len(devices)) else PartitionSpec())


def write(
    path: str | os.PathLike, tensors: Sequence[TensorInfo], produce: Callable[[str, Box], torch.Tensor], devices: Sequence
) -> None:
    """Save `tensors` as one Orbax tree at `path`, each array's shards produced box by box on `devices`."""
    import jax
    import orbax.checkpoint as ocp

    with jax.enable_x64(True):  # int64/float64 stay 64-bit (JAX would truncate them to 32 bits)
        arrays = {info.key: _array(info, produce, devices) for info in tensors}
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(Path(path).absolute(), nest(arrays))
            checkpointer.wait_until_finished()


def _array(info: TensorInfo, produce: Callable[[str, Box], torch.Tensor], devices: Sequence):
    """One global array on `devices`, each shard produced (read and transposed) box by box."""
    import jax

    cache: dict[Box, np.ndarray] = {}  # a replicated array asks every device for the same box

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        box = tuple(zip(*((s.indices(n)[0], len(range(*s.indices(n)))) for s, n in zip(index, info.shape))))
        box = box or ((), ())
        if box not in cache:
            cache[box] = to_numpy(produce(info.key, box))
        return cache[box]

    return jax.make_array_from_callback(info.shape, sharding_for(info.shape, devices), shard)
