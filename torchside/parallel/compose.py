"""`parallelize`: the one place that orders tensor parallelism, FSDP2 and materialization.

    1. set_device_mesh(tp_mesh, weight_mesh) on every outermost TP module (containers forward it);
    2. fully_shard each block, then the root (FSDP2 turns a TP Shard(0) into _StridedShard(0, sf=tp));
       FP8 weights must split on whole scale blocks (a ValueError names the one that does not);
    3. materialize what is still on the meta device: to_empty, then reset_parameters.

A placement plan (`plan=`, torchside.parallel.plan; DEFAULT_PLAN when None) is checked against the
model before step 1, and decides in step 2 each parameter's FSDP dim (FSDP2's shard_placement_fn)
and each block's reshard_after_forward; the TP modes it chooses are the ones the model was built
with (the TP modules split themselves; parallelize_llama splits the embedding by the plan).

One exception to that order: a block that builds FP8 weights is materialized (and cast, every TP
shard scaled by the whole weight's amax) just before its fully_shard, because FSDP2 decides at
fully_shard whether a parameter all-gathers through the QuantizedTensor hooks. Block by block, the
peak stays at one unsharded block.

Meshes are passed in, already sliced by the caller (`world["dp_shard"]`, `world["tp"]`, ...): nothing
here reads a mesh dimension's name. `mesh` is the data-parallel mesh: 1-D for FSDP, 2-D
(dp_replicate, dp_shard) for HSDP.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from torchside.parallel.module_mesh import TensorParallelMixin, local_tensor
from torchside.parallel.plan import DEFAULT_PLAN, Plan, fsdp_placement_fn, mesh_shape, resolve
from torchside.quantization import QuantizedTensor


def outermost_tp_modules(model: nn.Module) -> list[nn.Module]:
    """The TP modules not inside another one: each gets set_device_mesh once (it forwards to its children)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, TensorParallelMixin):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _holds_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


def materialize(module: nn.Module, device: torch.device | str) -> None:
    """Allocate every meta parameter and buffer under `module` on `device`, then re-initialize their modules."""
    pending = [m for m in module.modules() if _holds_meta(m)]
    for m in pending:
        m.to_empty(device=device, recurse=False)
    for m in pending:
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()


def _builds_fp8_weights_on_meta(block: nn.Module) -> bool:
    return any(getattr(m, "builds_fp8_weights", False) and _holds_meta(m) for m in block.modules())


def _check_fp8_shards_whole(module: nn.Module, shards: int) -> None:
    """ValueError naming an FP8 weight whose FSDP2 shards (dim 0 cut by torch.chunk) would split a scale block.

    fully_shard would fail on it too, but without saying which weight or why.
    """
    pending = [("", module)]
    while pending:
        prefix, current = pending.pop(0)
        for name, param in current.named_parameters(prefix=prefix, recurse=False):
            local = local_tensor(param)
            if not isinstance(local, QuantizedTensor):
                continue
            storage = local.quantized_storage
            step = storage.row_granularity()
            shard_rows = math.ceil(local.shape[0] / shards) * local.rows_per_index()
            if shard_rows < storage.rows and shard_rows % step:
                raise ValueError(
                    f"parallelize: FSDP over {shards} ranks cuts FP8 weight {name} of {type(module).__name__} (this "
                    f"rank's {storage.describe()}) into {shard_rows}-row shards, which split its groups of {step} "
                    f"rows sharing a scale: make its rows per shard a multiple of {step}, shard over fewer ranks, or "
                    "build it in high precision (quantized_model_init(enabled=False))"
                )
        # Children that fully_shard has split already hold FSDP shards: they were checked then.
        children = current.named_children()
        pending += [(f"{prefix}.{n}" if prefix else n, c) for n, c in children if not isinstance(c, FSDPModule)]


def _check_sequence_parallel(model: nn.Module, planned: bool | None) -> None:
    """ValueError when the plan's sequence parallelism is not what the TP modules were built with."""
    built = {module.sequence_parallel for module in model.modules() if isinstance(module, TensorParallelMixin)}
    if planned is not None and built and built != {planned}:
        raise ValueError(
            f"parallelize: the plan sets sequence_parallel={planned} but the model was built with "
            f"sequence_parallel={sorted(built)}: build it with ModuleConfig(sequence_parallel={planned})"
        )


def _check_fp8_weights_shard_dim_0(model: nn.Module, placement_fn) -> None:
    """FP8 weight shards are cut by rows (their scale groups): an FSDP dim 1 for one is not supported."""
    if placement_fn is None:
        return
    for name, param in model.named_parameters():
        if isinstance(local_tensor(param), QuantizedTensor) and placement_fn(param) is not None:
            raise ValueError(
                f"parallelize: the plan shards FP8 weight {name} on dim 1, but FP8 weights shard over FSDP by rows "
                "only (their scale groups): give it fsdp_dim = 0, or build it in high precision"
            )


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh | None,
    *,
    tp_mesh: DeviceMesh | None = None,
    weight_mesh: DeviceMesh | None = None,
    blocks: Iterable[nn.Module] | None = None,
    device: torch.device | str = "cpu",
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    plan: Plan | None = None,
) -> nn.Module:
    """TP meshes, FSDP2 per block then on the root, and materialization of a meta-device model (module docstring).

    `blocks` defaults to the outermost TP modules; `mesh=None` applies TP only. `weight_mesh` is the
    1-D mesh of every rank that shards a weight (FSDP: the shard dim; FSDP x TP: (dp_shard, tp)
    flattened), which per-tensor FP8 weights need to share one scale across FSDP shards.
    `reshard_after_forward` is the setting of blocks no rule of `plan` sets.
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"parallelize(mesh={mesh!r}): pass the data-parallel DeviceMesh (1-D FSDP, 2-D HSDP) or None")
    if mesh is not None and mesh.ndim > 2:
        raise ValueError(
            f"parallelize(mesh=...) got a {mesh.ndim}-D mesh: pass the data-parallel part only (1-D for FSDP, 2-D "
            "(dp_replicate, dp_shard) for HSDP) and the TP part as tp_mesh"
        )
    resolution = resolve(model, DEFAULT_PLAN if plan is None else plan, mesh_shape(mesh, tp_mesh))
    _check_sequence_parallel(model, resolution.sequence_parallel)
    tp_modules = outermost_tp_modules(model)
    for module in tp_modules:
        module.set_device_mesh(tp_mesh, weight_mesh)
    if mesh is not None:
        placement_fn = fsdp_placement_fn(model, resolution)  # after set_device_mesh: its parameter objects
        _check_fp8_weights_shard_dim_0(model, placement_fn)
        fsdp_options = {
            "mesh": mesh,
            "mp_policy": mp_policy or MixedPrecisionPolicy(),
            "shard_placement_fn": placement_fn,
        }
        names = {id(module): name for name, module in model.named_modules()}
        for block in tp_modules if blocks is None else list(blocks):
            if block is model:
                break  # the model is itself the one block: sharded as the root below
            if _builds_fp8_weights_on_meta(block):
                materialize(block, device)
            _check_fp8_shards_whole(block, mesh.size(mesh.ndim - 1))
            reshard = resolution.reshard_after_forward(names[id(block)], reshard_after_forward)
            fully_shard(block, reshard_after_forward=reshard, **fsdp_options)
        if _builds_fp8_weights_on_meta(model):
            materialize(model, device)
        _check_fp8_shards_whole(model, mesh.size(mesh.ndim - 1))  # HSDP shards over its last dim
        fully_shard(model, reshard_after_forward=False, **fsdp_options)  # the root is gathered first anyway
    materialize(model, device)
    return model


__all__ = ["materialize", "outermost_tp_modules", "parallelize"]
