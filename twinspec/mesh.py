"""A run's mesh: its three axes, how users spell them, and `MeshShape`, their sizes.

Every run's world mesh has the axes `MESH_AXES`, outermost first: dp_replicate (HSDP's replicas),
dp_shard (FSDP's shards) and tp (tensor parallelism). torch's DeviceMesh and JAX's Mesh name them
alike and put rank i at the same coordinate, so the bridge maps one onto the other by name.

Users write sizes as `name=size,...` (`split_axis_sizes`: the spelling every mesh text follows)
and may write `rep` for dp_replicate and `dp` for dp_shard (`AXIS_SPELLINGS`). The same names and
rules hold for `--mesh rep=2,dp=2` (`parse_mesh`) and for a placement plan's `[mesh]` table
(`mesh_from_table`); a size is an integer >= 1, and no axis may be given twice under two names.
A command runs on `DEFAULT_MESH` (FSDP x TP, 2 x 2) when neither names a mesh (twinspec.plan.choose_mesh).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

DP_REPLICATE, DP_SHARD, TP = "dp_replicate", "dp_shard", "tp"
MESH_AXES = (DP_REPLICATE, DP_SHARD, TP)  # outermost first: replicas (HSDP), FSDP shards, tensor parallelism

# Every name a user may give an axis: its own and a short one (`dp` is FSDP's dp_shard, not all data parallelism).
AXIS_SPELLINGS: Mapping[str, str] = {
    "rep": DP_REPLICATE, DP_REPLICATE: DP_REPLICATE, "dp": DP_SHARD, DP_SHARD: DP_SHARD, TP: TP
}  # fmt: skip
_AXES_HELP = "the axes are dp_replicate (or rep), dp_shard (or dp) and tp"
_SPELLING_HELP = "write axes as name=size, e.g. dp=2,tp=2"


@dataclass(frozen=True)
class MeshShape:
    """The sizes of the (dp_replicate, dp_shard, tp) mesh; 1 leaves an axis unused."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    def __post_init__(self) -> None:
        for axis, size in zip(MESH_AXES, self.sizes):
            _check_size(f"MeshShape({axis}={size!r})", axis, size)

    @property
    def sizes(self) -> tuple[int, int, int]:
        """The sizes in the order of MESH_AXES (a DeviceMesh's or a JAX Mesh's shape)."""
        return self.dp_replicate, self.dp_shard, self.tp

    @property
    def axis_sizes(self) -> dict[str, int]:
        """{axis name: size} for every axis of MESH_AXES."""
        return dict(zip(MESH_AXES, self.sizes))

    @property
    def data_parallel_size(self) -> int:
        """The ranks a batch splits over: dp_replicate x dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        """The ranks (processes, devices) of the whole mesh."""
        return math.prod(self.sizes)

    def __str__(self) -> str:  # what parse_mesh reads back
        return ",".join(f"{axis}={size}" for axis, size in self.axis_sizes.items() if size > 1) or "single"


def split_axis_sizes(text: str) -> list[tuple[str, int]]:
    """`name=size,...` -> [(name, size), ...] as written: names are identifiers, sizes integers >= 1, each name once."""
    where = f"mesh {text!r}"
    pairs: list[tuple[str, int]] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, equals, value = (part.strip() for part in item.partition("="))
        if not equals or not name.isidentifier():
            raise ValueError(f"{where}: {item!r} is not name=size; {_SPELLING_HELP}")
        if name in dict(pairs):
            raise ValueError(f"{where} gives {name} twice; give each axis once")
        pairs.append((name, _check_size(where, name, int(value) if re.fullmatch(r"[0-9]+", value) else value)))
    if not pairs:
        raise ValueError(f"{where} names no axis; {_SPELLING_HELP}")
    return pairs


def parse_mesh(text: str) -> MeshShape:
    """`dp=2,tp=2` (FSDP x TP), `rep=2,dp=2` (HSDP), `dp_replicate=2,dp_shard=2,tp=2`: a --mesh option's text."""
    return _mesh_shape(split_axis_sizes(text), f"mesh {text!r}")


def mesh_from_table(table: object) -> MeshShape:
    """A placement plan's `[mesh]` table ({name: size}, the names and sizes of `parse_mesh`)."""
    if not isinstance(table, Mapping):
        raise TypeError(f"[mesh] must be a table of axis sizes, e.g. dp_shard = 2, tp = 2; got {table!r}")
    return _mesh_shape(table.items(), "[mesh]")


def _mesh_shape(pairs: Iterable[tuple[str, object]], where: str) -> MeshShape:
    sizes: dict[str, int] = {}
    spelled: dict[str, str] = {}  # axis -> the name it was given as
    for name, size in pairs:
        axis = AXIS_SPELLINGS.get(name)
        if axis is None:
            raise ValueError(f"{where} names an unknown axis {name!r}: {_AXES_HELP}")
        if axis in spelled:
            raise ValueError(f"{where} gives {axis} twice, as {spelled[axis]!r} and {name!r}; give each axis once")
        spelled[axis] = name
        sizes[axis] = _check_size(where, name, size)
    return MeshShape(**sizes)


def _check_size(where: str, name: str, size: object) -> int:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{where}: {name} = {size!r} is not a size; pass an integer >= 1 (1 leaves the axis unused)")
    return size


DEFAULT_MESH = MeshShape(dp_shard=2, tp=2)  # a command's mesh when neither --mesh nor a plan names one

__all__ = [
    "AXIS_SPELLINGS",
    "DEFAULT_MESH",
    "DP_REPLICATE",
    "DP_SHARD",
    "MESH_AXES",
    "TP",
    "MeshShape",
    "mesh_from_table",
    "parse_mesh",
    "split_axis_sizes",
]
