"""`TensorParallelMixin`: the one `set_device_mesh`, and the TP state every module shares.

A module using it keeps a `ModuleConfig` in `self.config` and declares its parameters in
`self._param_specs` (name -> spec with the global `shape`, `role` and `parallel_mode`); a container
(MultiheadAttention, TransformerLayer) passes the ModuleConfig of its children and declares none.
Then:

- `tp_local_shape(spec)` is the shard its constructor allocates (from the placement table);
- `set_device_mesh(tp_mesh, weight_mesh)` wraps its own parameters as DTensors on `tp_mesh` with
  the table's placements, makes `weight_mesh`'s group the amax group of its weight quantizers,
  and makes the same call on every child with the mixin (containers forward; nothing is copied);
- `forward_param(name)` is what a forward computes with: the local tensor of a DTensor parameter
  (the same storage, so FSDP2's in-place all-gathers stay visible; `requires_grad` kept; its
  gradient comes back as a DTensor with the parameter's placements), with a TP all-reduce of the
  gradient where sequence parallelism leaves it partial;
- `linear_parallelism(name)` and `amax_groups(name)` say how a GEMM is split and over which
  groups its per-tensor quantizers reduce their amax, so that every shard uses the scale the
  whole tensor would get on one device; `weight_shard_group(name)` is the group that casts the
  stored shards of an FP8 weight (`weight_mesh`'s, else the TP group), checked to cover them all.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from torchside.parallel.placements import (
    check_fp8_weight_fits_shard,
    grad_is_partial_over_tp,
    local_shape,
    tp_placement,
    tp_shard_dim,
)
from torchside.parallel.tp_comm import LinearParallelism, TPComm

_KEPT_PARAM_ATTRIBUTES = ("high_precision_init_val",)  # python attributes a re-wrapped parameter keeps


def group_ranks(group: dist.ProcessGroup) -> tuple[int, ...]:
    """The global ranks of a process group, in group order."""
    return tuple(dist.get_process_group_ranks(group))


def ranks_splitting(param: Tensor) -> int:
    """How many ranks hold different pieces of `param` (1 for a plain tensor)."""
    if not isinstance(param, DTensor):
        return 1
    mesh = param.device_mesh
    return math.prod(mesh.size(d) for d, p in enumerate(param.placements) if not isinstance(p, Replicate))


def local_tensor(param: Tensor) -> Tensor:
    """This rank's shard of a DTensor (a view sharing its storage, outside autograd), or `param` itself."""
    if not isinstance(param, DTensor):
        return param
    with torch.no_grad():
        return param.to_local()


def rewrap_like(param: Tensor, local: Tensor) -> nn.Parameter:
    """`local` as a parameter laid out like `param`: a DTensor on its mesh and placements if it is one."""
    if isinstance(param, DTensor):
        local = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return nn.Parameter(local, requires_grad=param.requires_grad)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def _check_1d_mesh(owner: str, name: str, mesh: object) -> DeviceMesh:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{owner}.set_device_mesh({name}={mesh!r}): pass a DeviceMesh or None")
    if mesh.ndim != 1:
        raise ValueError(
            f"{owner}.set_device_mesh({name}=...) got a {mesh.ndim}-D mesh of shape {tuple(mesh.shape)}: pass a 1-D "
            f"mesh, e.g. world_mesh['tp'] for tp_mesh, or a flattened mesh of every dim that shards the weights "
            f"for weight_mesh"
        )
    return mesh


class TensorParallelMixin:
    """TP state, `set_device_mesh` and the forward-time views of parameters (see the module docstring)."""

    def _init_tensor_parallel(self, config=None) -> None:
        """TP state from a ModuleConfig's TP fields: `self.config`, or for a container the config it gives its children.

        A container has no parameters of its own (an FP8Module declares its specs next): its
        set_device_mesh checks the mesh and forwards it.
        """
        config = self.config if config is None else config
        self._param_specs = {}
        self.tp_size = config.tp_size
        self.sequence_parallel = config.sequence_parallel
        self.tp_comm = None if config.tp_group is None else TPComm(config.tp_group)
        self.weight_amax_group: dist.ProcessGroup | None = None
        self._tp_mesh: DeviceMesh | None = None

    def tp_local_shape(self, name: str, spec) -> tuple[int, ...]:
        """The shape of this rank's shard of parameter `name` (its spec holds the global shape)."""
        return local_shape(type(self).__name__, name, spec.role, spec.parallel_mode, spec.shape, self.tp_size)

    def set_device_mesh(self, tp_mesh: DeviceMesh | None = None, weight_mesh: DeviceMesh | None = None) -> None:
        """Parameters become DTensors on `tp_mesh`; `weight_mesh`: the ranks that share each weight's scale.

        Call it before `fully_shard` (FSDP2 builds its strided sharding from these placements) and
        before `reset_parameters` of a meta-device model. Children with the mixin get the same call.
        """
        self._set_own_device_mesh(tp_mesh, weight_mesh)
        for child in self.children():
            if isinstance(child, TensorParallelMixin):
                child.set_device_mesh(tp_mesh, weight_mesh)

    def _set_own_device_mesh(self, tp_mesh: DeviceMesh | None, weight_mesh: DeviceMesh | None) -> None:
        """set_device_mesh without the children: a container whose children were built with the meshes calls it."""
        owner = type(self).__name__
        if tp_mesh is not None:
            self._set_tp_mesh(owner, _check_1d_mesh(owner, "tp_mesh", tp_mesh))
        if weight_mesh is not None:
            self.weight_amax_group = _check_1d_mesh(owner, "weight_mesh", weight_mesh).get_group()

    def _set_tp_mesh(self, owner: str, tp_mesh: DeviceMesh) -> None:
        if tp_mesh.size() != self.tp_size:
            raise ValueError(
                f"{owner}.set_device_mesh: tp_mesh has {tp_mesh.size()} ranks but the module was built with "
                f"tp_size={self.tp_size}: build it with ModuleConfig(tp_size={tp_mesh.size()}) or pass a "
                f"{self.tp_size}-rank tp_mesh"
            )
        group = tp_mesh.get_group()
        if self.tp_comm is not None and group_ranks(self.tp_comm.group) != group_ranks(group):
            raise ValueError(
                f"{owner}.set_device_mesh: tp_mesh holds ranks {group_ranks(group)} but ModuleConfig.tp_group "
                f"holds {group_ranks(self.tp_comm.group)}: pass the mesh of the same ranks"
            )
        fp8_init = getattr(self, "quantized_init", None)  # an FP8Module's quantized_model_init: FP8 GEMM weights
        for name, spec in self._param_specs.items():
            param = getattr(self, name)
            if param is None:
                continue
            if fp8_init is not None and spec.role == "linear_weight":
                check_fp8_weight_fits_shard(fp8_init.recipe, owner, name, spec.shape, self.tp_local_shape(name, spec))
            if isinstance(param, DTensor) and param.device_mesh.ndim != 1:
                raise ValueError(
                    f"{owner}.{name} is already sharded over a {param.device_mesh.ndim}-D mesh: call "
                    "set_device_mesh before fully_shard"
                )
            placement = tp_placement(spec.role, spec.parallel_mode)
            self.register_parameter(name, _as_tp_dtensor(param, tp_mesh, placement, spec.shape))
        self.tp_comm = TPComm(group)
        self._tp_mesh = tp_mesh

    # ---- what a forward computes with

    def forward_param(self, name: str) -> Tensor | None:
        """Parameter `name` as a local tensor, its gradient summed over TP where only local tokens saw it."""
        param = getattr(self, name)
        if param is None:
            return None
        local = param.to_local(grad_placements=param.placements) if isinstance(param, DTensor) else param
        spec = self._param_specs[name]
        if self.tp_size > 1 and grad_is_partial_over_tp(spec.role, spec.parallel_mode, self.sequence_parallel):
            local = self._require_tp_comm().all_reduce_grad(local)
        return local

    def linear_parallelism(self, weight_name: str) -> LinearParallelism | None:
        """How the GEMM with weight `weight_name` is split over TP; None when it is not."""
        mode = self._param_specs[weight_name].parallel_mode
        if self.tp_size == 1 or mode is None:
            return None
        return LinearParallelism(self._require_tp_comm(), mode, self.sequence_parallel, self.config.fp8_all_gather)

    def amax_groups(self, weight_name: str) -> tuple[dist.ProcessGroup | None, ...]:
        """(input, weight, grad_output) amax groups of a GEMM's per-tensor quantizers: where each is split."""
        spec = self._param_specs[weight_name]
        mode = spec.parallel_mode if self.tp_size > 1 else None
        tp = self._require_tp_comm().group if mode is not None else None
        input_split = mode == "row" or (mode == "column" and self.sequence_parallel)
        weight_split = mode is not None and tp_shard_dim(spec.role, mode) is not None  # after FSDP2's gather
        return (tp if input_split else None), (tp if weight_split else None), (tp if mode == "column" else None)

    def weight_shard_group(self, name: str) -> dist.ProcessGroup | None:
        """The amax group giving every stored shard of FP8 weight `name` one scale; ValueError if none covers them."""
        holders = ranks_splitting(getattr(self, name))
        group = self.weight_amax_group or self.amax_groups(name)[1]
        covered = 1 if group is None else dist.get_world_size(group)
        if covered < holders:
            raise ValueError(
                f"{type(self).__name__}.{name}: this FP8 weight is split over {holders} ranks but its amax is "
                f"reduced over {covered}: call set_device_mesh(weight_mesh=...) with a 1-D mesh of every rank that "
                "shards it (e.g. the flattened (dp_shard, tp) mesh) so that all shards share one scale"
            )
        return group

    def _require_tp_comm(self) -> TPComm:
        if self.tp_comm is None:
            raise ValueError(
                f"{type(self).__name__} has tp_size={self.tp_size} but no TP group: pass "
                "ModuleConfig(tp_group=...) or call set_device_mesh(tp_mesh=...)"
            )
        return self.tp_comm


def _as_tp_dtensor(param: Tensor, mesh: DeviceMesh, placement, global_shape: tuple[int, ...]) -> nn.Parameter:
    """This rank's shard (a plain tensor or a 1-D DTensor) as a DTensor parameter on `mesh`."""
    with torch.no_grad():
        local = local_tensor(param) if isinstance(param, DTensor) else param.detach()
        shape, stride = torch.Size(global_shape), _contiguous_stride(global_shape)
        dtensor = DTensor.from_local(local, mesh, [placement], run_check=False, shape=shape, stride=stride)
    wrapped = nn.Parameter(dtensor, requires_grad=param.requires_grad)
    for attribute in _KEPT_PARAM_ATTRIBUTES:
        if hasattr(param, attribute):
            setattr(wrapped, attribute, getattr(param, attribute))
    return wrapped


__all__ = ["TensorParallelMixin", "group_ranks", "local_tensor", "ranks_splitting", "rewrap_like"]
