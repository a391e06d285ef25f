"""Named shardings for the JAX twin: logical axis names, one rules table per parallel mode, meshes.

The mesh always has the three axes `dp_replicate`, `dp_shard` and `tp` (size 1 where unused), built
from devices in rank order: device i is torch rank i, reshaped row-major. So one set of specs covers
FSDP (dp_shard), HSDP (dp_replicate x dp_shard), FSDP x TP and HSDP x TP.

Parameters follow the torch placement table (docs/design.md, "Parallelism") row for row. torch decides a
parameter's layout by its role and position, not by what its dims mean: TP splits a column layer's
out features and a row layer's in features, and FSDP2 shards dim 0 of every parameter, on top of TP.
So each rules table lists, per role, the mesh axes of each axis of the Flax parameter:

    torch weight [out, in] = Flax kernel [in, out] (the dims swap); bias [out]; norm weight/bias [features]
    column: weight Shard(0)  -> kernel (None, ('tp', 'dp_shard'))   bias ('tp', 'dp_shard')   norm 'dp_shard'
    row:    weight Shard(1)  -> kernel ('tp', 'dp_shard')           bias 'dp_shard'           norm 'dp_shard'
    none:   weight Replicate -> kernel (None, 'dp_shard')           bias 'dp_shard'           norm 'dp_shard'

`('tp', 'dp_shard')` on one dim, tp most significant, is the layout torch writes as
`(_StridedShard(0, sf=tp), Shard(0))` when FSDP2 shards a dim TP already split (bridge.layout).
`dp_replicate` never splits a parameter: HSDP keeps a full copy of the FSDP shards per replica.

Activations are named by their logical axes (`x_BSD` is ("batch", "seq", "embed")): batch is split
over both data axes, and in a TP mode the feature dims a TP layer splits (mlp, heads, vocab) over tp.
Parameter axes carry names too; in a TP mode they must agree with the activations: the kernel axis
TP splits must be a name whose activations TP splits, else the layer's output would not be laid out
as its kernel is. A module reads each parameter in its `gathered_spec` (the rules without dp_shard,
applied by `constrain`): torch's FSDP2 all-gathers a parameter before use, and so must XLA.

Where parameters are stored is a placement plan's choice (twinspec.plan; DEFAULT_PLAN gives the
specs of the tables above, tests/jaxside/test_placement_plan.py checks it): `plan_spec` turns the
torch dims a plan splits over tp and dp_shard into the PartitionSpec of the same shards, and
jaxside.modules.placement places every parameter by it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The mesh axes (outermost first, as torch's HSDP mesh), the placement table and plans: shared with torch.
from twinspec.mesh import DP_REPLICATE, DP_SHARD, MESH_AXES, TP
from twinspec.placement import FLAX_ROLES, PARALLEL_MODES
from twinspec.plan import PlannedParam, spec_entries

FEATURE_AXES = ("embed", "mlp", "heads", "kv", "vocab")  # dims of parameters and activations
ACTIVATION_AXES = ("batch", "seq")  # dims only activations have

MeshAxes = str | tuple[str, ...] | None  # one PartitionSpec entry

_DATA = (DP_REPLICATE, DP_SHARD)
_TP_THEN_FSDP = (TP, DP_SHARD)  # most significant first: torch's _StridedShard(sf=tp) + Shard


@dataclass(frozen=True)
class Rules:
    """One parallel mode: mesh axes for each axis of a parameter (by role) and of an activation (by name)."""

    kernel: tuple[MeshAxes, MeshAxes]  # Flax kernel [in, out]
    bias: tuple[MeshAxes]  # [out]
    norm: tuple[MeshAxes]  # [features]
    activations: Mapping[str, MeshAxes]

    def for_role(self, role: str) -> tuple[MeshAxes, ...]:
        """The spec entries of a parameter of `role`."""
        return getattr(self, role)


_DATA_PARALLEL_ACTIVATIONS: Mapping[str, MeshAxes] = MappingProxyType(
    {"batch": _DATA, "seq": None} | dict.fromkeys(FEATURE_AXES)
)
_TENSOR_PARALLEL_ACTIVATIONS: Mapping[str, MeshAxes] = MappingProxyType(
    dict(_DATA_PARALLEL_ACTIVATIONS) | dict.fromkeys(("mlp", "heads", "vocab"), TP)  # what TP layers split
)

RULES: Mapping[str | None, Rules] = {
    "column": Rules(
        kernel=(None, _TP_THEN_FSDP), bias=(_TP_THEN_FSDP,), norm=(DP_SHARD,), activations=_TENSOR_PARALLEL_ACTIVATIONS
    ),
    "row": Rules(kernel=(TP, DP_SHARD), bias=(DP_SHARD,), norm=(DP_SHARD,), activations=_TENSOR_PARALLEL_ACTIVATIONS),
    None: Rules(kernel=(None, DP_SHARD), bias=(DP_SHARD,), norm=(DP_SHARD,), activations=_DATA_PARALLEL_ACTIVATIONS),
}


def make_mesh(
    dp_replicate: int = 1, dp_shard: int = 1, tp: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A (dp_replicate, dp_shard, tp) mesh over devices in rank order, as torch builds its device mesh."""
    sizes = dict(zip(MESH_AXES, (dp_replicate, dp_shard, tp)))
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"make_mesh({name}={size!r}): pass an integer >= 1 (1 leaves the axis unused)")
    count = math.prod(sizes.values())
    if devices is None:
        available = jax.devices()
        if count > len(available):
            raise ValueError(
                f"make_mesh({', '.join(f'{k}={v}' for k, v in sizes.items())}) needs {count} devices but JAX has "
                f"{len(available)}; use smaller axes (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N)"
            )
        devices = available[:count]
    elif len(devices) != count:
        raise ValueError(f"make_mesh: {len(devices)} devices given for a {count}-device mesh {tuple(sizes.values())}")
    return Mesh(np.array(list(devices), dtype=object).reshape(tuple(sizes.values())), MESH_AXES)


def spec_for(logical_axes: Sequence[str], mode: str | None = None, role: str | None = None) -> PartitionSpec:
    """The PartitionSpec of a parameter (`role` kernel, bias or norm) or, without a role, an activation."""
    axes = _checked_axes(logical_axes)
    if mode not in RULES:
        raise ValueError(f"parallel mode {mode!r} is not one of {PARALLEL_MODES}; use the layer's torch parallel_mode")
    rules = RULES[mode]
    if role is None:
        return PartitionSpec(*(rules.activations[name] for name in axes))
    if role not in FLAX_ROLES:
        roles = tuple(FLAX_ROLES)
        raise ValueError(f"role={role!r} is not a parameter role: use one of {roles}, or None for activations")
    entries = rules.for_role(role)
    if len(axes) != len(entries) or any(name in ACTIVATION_AXES for name in axes):
        raise ValueError(
            f"a {role} has {len(entries)} axes named from {FEATURE_AXES} (a kernel is Flax's [in, out]); got {axes}"
        )
    for name, entry in zip(axes, entries):
        if _splits_over_tp(entry) and rules.activations[name] != TP:
            tp_names = [n for n, a in rules.activations.items() if a == TP]
            raise ValueError(
                f"{mode} mode splits the {role} axis {name!r} over tp, but activations named {name!r} are not split "
                f"over tp, so the layer's output would not match its kernel; name that axis one of {tp_names}"
            )
    return PartitionSpec(*entries)


def plan_spec(planned: PlannedParam, *, transpose: bool) -> PartitionSpec:
    """The PartitionSpec holding what torch holds of a parameter placed by a plan (twinspec.plan.Resolution).

    `planned` is in torch's dims; `transpose`: the JAX parameter is the torch one transposed (a Flax
    kernel [in, out] of a torch weight [out, in]). One axis on a dim is its name, two a tuple.
    """
    entries = [axes[0] if len(axes) == 1 else axes or None for axes in spec_entries(planned)]
    return PartitionSpec(*(entries[::-1] if transpose else entries))


def named_sharding(
    mesh: Mesh,
    logical_axes: Sequence[str],
    mode: str | None = None,
    role: str | None = None,
    shape: Sequence[int] | None = None,
) -> NamedSharding:
    """`spec_for` on a mesh from `make_mesh`; with `shape`, also checks that every split dim divides evenly."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are not {MESH_AXES}: build the mesh with make_mesh")
    spec = spec_for(logical_axes, mode, role)
    if shape is not None:
        _check_divisible(mesh, spec, tuple(shape), tuple(logical_axes))
    return NamedSharding(mesh, spec)


def gathered_spec(logical_axes: Sequence[str], mode: str | None, role: str) -> PartitionSpec:
    """The layout a GEMM or norm reads a parameter in: `spec_for` without dp_shard, as FSDP2 unshards it.

    What tp splits stays split. Reading a kernel in its stored layout instead would hand XLA a GEMM
    whose out features are split over dp_shard too, while the batch is: XLA then gathers the batch.
    """
    return PartitionSpec(*(_without_fsdp(entry) for entry in spec_for(logical_axes, mode, role)))


def constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """x laid out as `spec` on its mesh: the one in context (`jax.set_mesh`), else the one x is on.

    Inside jit an array's type carries its mesh, so a parameter `place`d on a make_mesh mesh keeps
    it. Off such a mesh (one device, or another mesh's axes) x is returned as it is.
    """
    mesh = _mesh_of(x)
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def data_parallel_size(x: jax.Array) -> int:
    """dp_replicate x dp_shard of the make_mesh mesh `constrain` would use for x; 1 off such a mesh."""
    mesh = _mesh_of(x)
    return 1 if mesh is None else mesh.shape[DP_REPLICATE] * mesh.shape[DP_SHARD]


def _mesh_of(x: jax.Array):
    """The mesh in context, else the one x is on; None unless it has make_mesh's axes."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        mesh = jax.typeof(x).sharding.mesh
    return mesh if tuple(mesh.axis_names) == MESH_AXES else None


def _checked_axes(logical_axes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(logical_axes, str):
        raise TypeError(f"logical_axes={logical_axes!r} is one string; pass a tuple of names, e.g. ({logical_axes!r},)")
    axes = tuple(logical_axes)
    known = ACTIVATION_AXES + FEATURE_AXES
    unknown = [name for name in axes if name not in known]
    if unknown:
        raise ValueError(f"unknown logical axes {unknown}; use names from {known}")
    return axes


def _without_fsdp(entry: MeshAxes) -> MeshAxes:
    kept = tuple(axis for axis in ((entry,) if isinstance(entry, str) else entry or ()) if axis != DP_SHARD)
    return kept[0] if len(kept) == 1 else kept or None


def _splits_over_tp(entry: MeshAxes) -> bool:
    return entry == TP or (isinstance(entry, tuple) and TP in entry)


def _check_divisible(mesh: Mesh, spec: PartitionSpec, shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    """JAX refuses dims the mesh does not divide; torch.chunk would not: say so before anything is placed."""
    if len(shape) != len(names):
        raise ValueError(f"shape {shape} has {len(shape)} dims but the logical axes {names} name {len(names)}")
    for dim, (size, entry) in enumerate(zip(shape, spec)):
        mesh_axes = () if entry is None else (entry,) if isinstance(entry, str) else entry
        parts = math.prod(mesh.shape[name] for name in mesh_axes)
        if size % parts:
            raise ValueError(
                f"dim {dim} ({names[dim]!r}) has size {size}, which mesh axes {mesh_axes} split into {parts} parts; "
                f"JAX shards only evenly divisible dims (torch.chunk would leave short shards): pad it to "
                f"{-(-size // parts) * parts} or use a mesh whose axes divide it"
            )
