"""`parameter_layouts`: every parameter's global shape, mesh and placements (what DCP and the bridge read).

A plain tensor is listed as held whole by this rank (no mesh). A DTensor lists its mesh shape,
mesh dimension names (as the caller named them; they are reported, never interpreted), the global
ranks of the mesh in row-major order, its placements and this rank's local shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor import DTensor, Placement

from torchside.parallel._torch_compat import placement_text


@dataclass(frozen=True)
class ParameterLayout:
    """Where one parameter lives."""

    name: str
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str  # the nominal dtype (an FP8 parameter lists the dtype it stands for)
    quantized: bool  # the local shard holds FP8/FP4 bytes
    mesh_shape: tuple[int, ...] = ()
    mesh_dim_names: tuple[str, ...] = ()
    mesh_ranks: tuple[int, ...] = ()  # row-major over mesh_shape
    placements: tuple[Placement, ...] = ()

    def describe(self) -> str:
        """One line: name, global shape, mesh and placements."""
        if not self.mesh_shape:
            return f"{self.name} {list(self.global_shape)} plain"
        mesh = ",".join(f"{n}={s}" for n, s in zip(self.mesh_dim_names, self.mesh_shape, strict=True))
        placements = ",".join(placement_text(p) for p in self.placements)
        return f"{self.name} {list(self.global_shape)} mesh({mesh}) [{placements}] local {list(self.local_shape)}"


def parameter_layouts(model: nn.Module) -> list[ParameterLayout]:
    """Every parameter of `model`, in `named_parameters` order."""
    layouts = []
    for name, param in model.named_parameters():
        local = param.to_local() if isinstance(param, DTensor) else param
        common = {
            "name": name,
            "global_shape": tuple(param.shape),
            "local_shape": tuple(local.shape),
            "dtype": str(param.dtype).removeprefix("torch."),
            "quantized": hasattr(local, "quantized_storage"),
        }
        if isinstance(param, DTensor):
            mesh = param.device_mesh
            names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
            common |= {
                "mesh_shape": tuple(mesh.shape),
                "mesh_dim_names": tuple(names),
                "mesh_ranks": tuple(mesh.mesh.flatten().tolist()),
                "placements": tuple(param.placements),
            }
        layouts.append(ParameterLayout(**common))
    return layouts


__all__ = ["ParameterLayout", "parameter_layouts"]
