"""Orbax boxes: read any box of a saved array with TensorStore, write a tree placed on this process's devices.

An Orbax checkpoint (jaxside.checkpoint's step directory) stores each array as a zarr array inside
an OCDBT database, named by its dotted tree path; TensorStore opens that array and reads the byte
ranges of one box, whatever mesh saved it. Keys nest at the dots (`model.layers.0.fc1_kernel` is
tree["model"]["layers"]["0"]["fc1_kernel"]).

Writing: each array is built with `jax.make_array_from_callback` on a sharding over this process's
devices (dim 0 split one block per device when it splits evenly, else replicated), so each device's
shard is read and transposed box by box; Orbax then commits the tree atomically. Orbax writes one
tree per save, so this process holds its shards of every array until the save ends: its share of the
model, not one shard (the DCP and safetensors writers stream instead). Once Orbax has committed
the tree, jaxside.checkpoint's checksum file (each array's CRC32) is written beside it.

Source checks: a step directory with that checksum file (jaxside.checkpoint saves, our targets) is
verifiable: each array is read whole once, in slabs of rows, and checked against its recorded CRC32
before the first box is read from it (CheckFailed on a mismatch). Without the file it converts
unverified. An Orbax temporary directory (an unfinished save) is refused as `load` refuses one; a root
of jaxside.checkpoint saves (step-<N> directories) means its latest committed step (`path` says which).
Orbax's absl log lines are kept off (`quiet_absl`): its failures reach the caller as exceptions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from bridge.convert import facts
from bridge.convert.plan import Box, TensorInfo, WriteJob
from bridge.errors import CheckFailed
from torchside.checkpoint import commit

_SLAB_BYTES = 16 << 20  # what a checksum pass holds at a time


@contextlib.contextmanager
def quiet_absl() -> Iterator[None]:
    """Orbax's absl log lines off: what goes wrong reaches the caller as an exception (one `error:` line in the CLI)."""
    logger = logging.getLogger("absl")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


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
    """The arrays of an Orbax checkpoint (a committed step directory, or a root: its latest), read a box at a time."""

    def __init__(self, path: str | os.PathLike, *, check: bool = True) -> None:
        import jax
        import orbax.checkpoint as ocp

        from jaxside import checkpoint

        self.path = Path(path).absolute()
        if not self.path.is_dir():
            raise ValueError(
                f"{self.path} is not an Orbax checkpoint (not a directory); pass a step directory (step-<N>) or their root"
            )
        steps = checkpoint.committed_steps(self.path)
        if steps:  # a root of jaxside.checkpoint saves: its latest committed step
            self.path = checkpoint.step_path(self.path, steps[-1])
        if not ocp.step.is_path_finalized(self.path):
            commit.refuse_unfinished(self.path)
        try:
            with quiet_absl(), ocp.StandardCheckpointer() as checkpointer:
                tree = checkpointer.metadata(self.path).item_metadata.tree
        except Exception as error:  # no Orbax metadata: another format, or a damaged checkpoint
            raise ValueError(
                f"{self.path} is not a readable Orbax checkpoint ({type(error).__name__}: {error}): "
                f"{_hint(self.path)}"
            ) from error
        self.tensors, self.skipped, self._stores = {}, [], {}
        for _, leaf in jax.tree_util.tree_leaves_with_path(tree):
            name = leaf.name
            self.tensors[name] = TensorInfo(name, tuple(leaf.shape), str(np.dtype(leaf.dtype)))
        self.facts = facts.read_file(self.path)
        self._recorded = checkpoint.recorded_checksums(self.path) if check else None
        self.verifiable = self._recorded is not None
        self._checked: set[str] = set()

    def _store(self, key: str):
        import tensorstore as ts

        if key not in self._stores:
            kvstore = {"driver": "ocdbt", "base": f"file://{self.path}/", "path": key}
            self._stores[key] = ts.open({"driver": "zarr", "kvstore": kvstore}, open=True).result()
        return self._stores[key]

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of array `key` (TensorStore reads only the chunks that overlap it)."""
        self._check(key)
        offsets, sizes = box
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        try:
            values = self._store(key)[index].read().result()
        except Exception as error:  # TensorStore's errors for missing or damaged chunks
            raise ValueError(f"reading {key} from {self.path} failed ({error}): convert an intact copy") from error
        return from_numpy(values, self.tensors[key].dtype)

    def _check(self, key: str) -> None:
        """Check array `key` against its recorded CRC32 once (read whole, a slab of rows at a time)."""
        if not self.verifiable or key in self._checked:
            return
        if key not in self._recorded:
            raise ValueError(f"{self.path}: no CRC32 recorded for array {key}; restore the checksum file from a copy")
        info = self.tensors[key]
        crc = 0
        for offsets, sizes in _slabs(info):
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            crc = zlib.crc32(np.ascontiguousarray(self._store(key)[index].read().result()).reshape(-1).view(np.uint8), crc)
        if crc != self._recorded[key]:
            raise CheckFailed(
                f"{self.path}: array {key} has CRC32 {crc:08x}, but {self._recorded[key]:08x} was recorded when it was "
                "written: the source is corrupted; nothing was written. Convert an intact copy"
            )
        self._checked.add(key)


def _slabs(info: TensorInfo) -> list[Box]:
    """Boxes of whole rows covering the array in order, each at most about _SLAB_BYTES."""
    if not info.shape or info.shape[0] == 0:
        return [((0,) * len(info.shape), info.shape)]
    rows = max(1, _SLAB_BYTES // max(1, info.nbytes // info.shape[0]))
    rest = (0,) * (len(info.shape) - 1)
    return [((r, *rest), (min(rows, info.shape[0] - r), *info.shape[1:])) for r in range(0, info.shape[0], rows)]


def _hint(path: Path) -> str:
    if (path / ".metadata").is_file():
        return "it is a DCP checkpoint: pass --from dcp"
    unfinished = sorted(p.name for p in path.glob("step-*") if p.is_dir())
    if unfinished:  # (committed steps were taken before this)
        return f"it holds no committed step, only unfinished saves ({', '.join(unfinished)}); pass a committed step"
    return "pass a committed Orbax step directory (step-<N>) written by jaxside.checkpoint or Orbax"


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

    from bridge.convert.plan import split_rows

    mesh = Mesh(np.array(devices), ("owners",))
    return NamedSharding(mesh, PartitionSpec("owners") if split_rows(shape, len(devices)) else PartitionSpec())


def write(job: WriteJob) -> None:
    """Save every tensor as one Orbax tree, each array's shards produced box by box on the job's devices."""
    import jax
    import orbax.checkpoint as ocp

    from jaxside import checkpoint

    with jax.enable_x64(True):  # int64/float64 stay 64-bit (JAX would truncate them to 32 bits)
        arrays = {info.key: _array(info, job.produce, job.devices) for info in job.tensors()}
        with quiet_absl(), ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(Path(job.path).absolute(), nest(arrays))
            checkpointer.wait_until_finished()
    checkpoint.write_checksums(job.path, job.tensor_crcs())
    facts.write_file(job.path, job.facts)


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
