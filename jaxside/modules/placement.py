"""Put a module's variables on a mesh: parameters by a placement plan, everything else replicated.

Each parameter carries its logical axes (`nnx.with_partitioning`) and, as metadata, its row of the
placement table: `parallel_role` (kernel, bias or norm) and `parallel_mode` (None, "column" or
"row"). `shardings` hands every parameter, by its torch name, role and mode, to a `twinspec.plan.Plan`
(DEFAULT_PLAN: the built-in placement, torch's table with FSDP on dim 0), which decides the dims
tp and dp_shard split, as it does for the torch model; dims the mesh does not divide are refused.
Modules with a `tp_unit` class attribute (embedding, attention, mlp) are the units whose TP mode a
plan chooses. Read the names outside any `nnx.logical_axis_rules` context: they are taken as they
were annotated. `gathered` reads a parameter in the layout a GEMM needs it in (FSDP's all-gather,
in the program).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxside.sharding import _check_divisible, constrain, gathered_spec, plan_spec
from twinspec.mesh import MESH_AXES, MeshShape
from twinspec.placement import FLAX_ROLES
from twinspec.plan import DEFAULT_PLAN, Param, Plan, Resolution, torch_name


def _torch_view(path, variable: nnx.Variable) -> tuple[str, Param, bool] | None:
    """(torch name, the parameter as torch declares it, whether JAX holds it transposed); None: no table row."""
    metadata = variable.get_metadata()
    role = metadata.get("parallel_role")
    if role is None:
        return None
    shape = tuple(variable.get_value().shape)
    transpose = role == "kernel" and len(shape) == 2  # a Flax kernel [in, out] of a torch weight [out, in]
    name = torch_name(".".join(map(str, path)), len(shape))
    return (
        name,
        Param(shape[::-1] if transpose else shape, FLAX_ROLES[role], metadata.get("parallel_mode")),
        transpose,
    )


def resolve_plan(model: nnx.Module, plan: Plan = DEFAULT_PLAN, mesh: MeshShape | None = None) -> Resolution:
    """`plan` applied to `model` on `mesh` (Plan.resolve), by torch's names for its units and parameters."""
    units = {
        ".".join(map(str, path)): node.tp_unit
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.Module) and getattr(node, "tp_unit", None)
    }
    flat = nnx.to_flat_state(nnx.state(model))
    params = dict(view[:2] for path, variable in flat if (view := _torch_view(path, variable)) is not None)
    return plan.resolve(units, params, mesh)


def shardings(model: nnx.Module, mesh: Mesh, plan: Plan = DEFAULT_PLAN) -> nnx.State:
    """The NamedSharding of every variable of `model` on `mesh` (a mesh from jaxside.sharding.make_mesh)."""
    if tuple(mesh.axis_names) != MESH_AXES:
        raise ValueError(f"mesh axes {tuple(mesh.axis_names)} are not {MESH_AXES}: build the mesh with make_mesh")
    state = nnx.state(model)
    logical_specs = dict(nnx.to_flat_state(nnx.get_partition_spec(state)))
    resolution = resolve_plan(model, plan, MeshShape(**mesh.shape))

    def sharding_of(path, variable: nnx.Variable) -> nnx.Variable:
        view = _torch_view(path, variable)
        if view is None:  # FP8 state and anything unannotated: one full copy per device
            return variable.replace(NamedSharding(mesh, PartitionSpec()))
        name, _, transpose = view
        spec = plan_spec(resolution.params[name], transpose=transpose)
        _check_divisible(mesh, spec, tuple(variable.get_value().shape), tuple(logical_specs[path].get_value()))
        return variable.replace(NamedSharding(mesh, spec))

    return nnx.from_flat_state({path: sharding_of(path, variable) for path, variable in nnx.to_flat_state(state)})


def place(model: nnx.Module, mesh: Mesh, plan: Plan = DEFAULT_PLAN) -> None:
    """Move every variable of `model` to its sharding on `mesh` (see `shardings`), in place."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, shardings(model, mesh, plan)))


def gathered(variable: nnx.Variable) -> jax.Array:
    """A parameter's value as a GEMM or norm reads it: gathered over dp_shard, still split over tp.

    Without this XLA may compute in the stored layout (jaxside.sharding.gathered_spec says what then
    goes wrong). Variables without a rules row (FP8 state) are read as they are.
    """
    value = variable.get_value()
    metadata = variable.get_metadata()
    role = metadata.get("parallel_role")
    if role is None:
        return value
    axes = tuple(nnx.get_partition_spec(variable).get_value())
    return constrain(value, gathered_spec(axes, metadata.get("parallel_mode"), role))
