"""Put a module's variables on a mesh: parameters by jaxside.sharding's rules, everything else replicated.

Each parameter carries its logical axes (`nnx.with_partitioning`) and, as metadata, its rules row:
`parallel_role` (kernel, bias or norm) and `parallel_mode` (None, "column" or "row"). The rules are
keyed by role and mode, not by name alone (torch places a parameter by its role), so the names go
through `jaxside.sharding.named_sharding`, which also refuses dims the mesh does not divide. Read the
names outside any `nnx.logical_axis_rules` context: they are taken as they were annotated.
`gathered` reads a parameter in the layout a GEMM needs it in (FSDP's all-gather, in the program).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxside.sharding import constrain, gathered_spec, named_sharding


def _is_variable(node: object) -> bool:
    return isinstance(node, nnx.Variable)


def shardings(model: nnx.Module, mesh: Mesh) -> nnx.State:
    """The NamedSharding of every variable of `model` on `mesh` (a mesh from jaxside.sharding.make_mesh)."""
    state = nnx.state(model)
    logical_specs = nnx.get_partition_spec(state)

    def sharding_of(variable: nnx.Variable, logical: nnx.Variable) -> nnx.Variable:
        metadata = variable.get_metadata()
        role = metadata.get("parallel_role")
        if role is None:  # FP8 state and anything unannotated: one full copy per device
            return variable.replace(NamedSharding(mesh, PartitionSpec()))
        axes = tuple(logical.get_value())
        mode = metadata.get("parallel_mode")
        return variable.replace(named_sharding(mesh, axes, mode, role, shape=variable.get_value().shape))

    return jax.tree.map(sharding_of, state, logical_specs, is_leaf=_is_variable)


def place(model: nnx.Module, mesh: Mesh) -> None:
    """Move every variable of `model` to its sharding on `mesh` (see `shardings`), in place."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, shardings(model, mesh)))


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
