"""Placement plans in torch: `Plan` (twinspec.plan, framework-free) applied to a torch model.

- `resolve(model, plan, mesh)`: the plan checked against the model's units and parameters, by
  their torch names (`Resolution`: each unit's TP mode, each parameter's tp and FSDP dims);
- `fsdp_placement_fn(model, resolution)`: FSDP2's `shard_placement_fn` giving each parameter the
  dim the plan shards (None, FSDP2's default Shard(0), for dim 0);
- `mesh_shape(mesh, tp_mesh)`: the MeshShape of a data-parallel mesh and a TP mesh.

A module with a `tp_unit` class attribute is a unit whose TP mode a plan chooses (an untied head
only while it holds a weight). A parameter's role and mode come from its module's `_param_specs`
(the placement table's keys); an embedding's weight is a column-parallel weight (its vocabulary
rows split); any other parameter is replicated over TP.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from twinspec.mesh import MeshShape
from twinspec.plan import DEFAULT_PLAN, Param, Plan, Resolution


def model_units(model: nn.Module) -> dict[str, str]:
    """name -> kind of every unit of `model` whose TP mode a plan chooses."""
    return {name: module.tp_unit for name, module in model.named_modules() if _is_unit(module)}


def _is_unit(module: nn.Module) -> bool:
    kind = getattr(module, "tp_unit", None)
    return module.weight is not None if kind == "embedding" else kind is not None  # a tied head holds no weight


def model_params(model: nn.Module) -> dict[str, Param]:
    """name -> the parameter as its module declares it (global shape, role, mode)."""
    params = {}
    for module_name, module in model.named_modules():
        specs = getattr(module, "_param_specs", {})
        for name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if name in specs:
                spec = specs[name]
                params[full] = Param(tuple(spec.shape), spec.role, spec.parallel_mode)
            elif getattr(module, "tp_unit", None) == "embedding":
                params[full] = Param(tuple(param.shape), "linear_weight", "column")
            else:
                params[full] = Param(tuple(param.shape), "norm", None)
    return params


def resolve(model: nn.Module, plan: Plan = DEFAULT_PLAN, mesh: MeshShape | None = None) -> Resolution:
    """`plan` checked against `model` on `mesh` (ValueError naming the rule) and applied to its units and parameters."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan={plan!r}: pass a Plan (Plan.from_toml(path), Plan.from_dict(d) or DEFAULT_PLAN)")
    return plan.resolve(model_units(model), model_params(model), mesh)


def mesh_shape(mesh: DeviceMesh | None, tp_mesh: DeviceMesh | None) -> MeshShape:
    """The sizes of a data-parallel mesh (1-D FSDP, 2-D HSDP) and a TP mesh."""
    tp = 1 if tp_mesh is None else tp_mesh.size()
    if mesh is None:
        return MeshShape(tp=tp)
    return MeshShape(dp_replicate=mesh.size(0) if mesh.ndim == 2 else 1, dp_shard=mesh.size(mesh.ndim - 1), tp=tp)


def fsdp_placement_fn(model: nn.Module, resolution: Resolution) -> Callable[[Tensor], Shard | None] | None:
    """FSDP2's shard_placement_fn for the parameters `model` holds now; None when every one shards dim 0."""
    dims = {id(param): resolution.params[name].fsdp_dim for name, param in model.named_parameters()}
    if not any(dims.values()):
        return None

    def placement(param: Tensor) -> Shard | None:
        dim = dims.get(id(param), 0)
        return Shard(dim) if dim else None

    return placement


__all__ = [
    "DEFAULT_PLAN",
    "Param",
    "Plan",
    "Resolution",
    "fsdp_placement_fn",
    "mesh_shape",
    "model_params",
    "model_units",
    "resolve",
]
