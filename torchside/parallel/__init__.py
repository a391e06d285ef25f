"""Tensor parallelism for the FP8 modules, and its composition with FSDP2.

- `placements`: the one placement table, keyed by (parameter role, parallel mode);
- `tp_comm`: the TP collectives as autograd functions (FP8-byte all-gather for sequence parallelism);
- `module_mesh`: `TensorParallelMixin`, the one `set_device_mesh` every module inherits;
- `compose`: `parallelize(model, mesh, tp_mesh=..., weight_mesh=...)`;
- `layouts`: `parameter_layouts(model)`, every parameter's global shape, mesh and placements;
- `plan`: placement plans (`Plan`, `DEFAULT_PLAN`: twinspec.plan) applied to a torch model.

`MESH_AXES` are the world mesh's axis names (twinspec.mesh, the same in JAX).
"""

from torchside.parallel.compose import materialize, parallelize
from torchside.parallel.layouts import ParameterLayout, parameter_layouts
from torchside.parallel.module_mesh import TensorParallelMixin
from torchside.parallel.placements import tp_placement
from torchside.parallel.plan import DEFAULT_PLAN, Plan
from torchside.parallel.tp_comm import TPComm
from twinspec.mesh import MESH_AXES

__all__ = [
    "DEFAULT_PLAN",
    "MESH_AXES",
    "ParameterLayout",
    "Plan",
    "TPComm",
    "TensorParallelMixin",
    "materialize",
    "parallelize",
    "parameter_layouts",
    "tp_placement",
]
