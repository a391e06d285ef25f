"""What a built model costs: bytes on every rank, and the collectives of one training step.

Read off the live objects, not assumed: each parameter's DTensor mesh and placements (its shard on
every rank: bridge.layout's shard map on the whole mesh), its local tensor (an FP8 parameter's
bytes: torchside.quantization.storage's buffer shapes), the optimizer's moment formats and master
weights (FusedAdam's own encoders, run on the meta device), FSDP2's units (torch's state:
bridge._torch_compat.fsdp_unit) and every TP module's GEMM parallelism and sequence parallelism.

The step: forward and backward of one batch ([seq, batch / dp] tokens per data-parallel rank, the
activations in the parameters' dtype) and an optimizer step (FusedAdam communicates nothing). The
bytes of a collective are its whole buffer on one rank: the gathered output of an all-gather, the
input of a reduce-scatter, the tensor of an all-reduce (nccl-tests' "size"):

    FSDP (dp_shard)     all-gather of each unit's parameters in forward, again in backward when it
                        reshards after forward; reduce-scatter of its gradients (FSDP2 pads dim 0
                        of every parameter to a multiple of dp_shard)
    HSDP (dp_replicate) all-reduce of each unit's gradient shards
    TP (tp)             column GEMM: all-gather of the input under sequence parallelism (backward:
                        reduce-scatter of its gradient), else an all-reduce of the input's gradient;
                        row GEMM: reduce-scatter of the output under sequence parallelism (backward:
                        all-gather), else an all-reduce; under sequence parallelism, an all-reduce of
                        the gradient of every TP-replicated parameter (norms, row biases)
    Llama (tp)          the vocabulary-split embedding, the head and loss_parallel's cross entropy
                        (`_vocab_parallel_collectives`)

FP8 parameters are gathered as the bytes their FSDP2 hook sends (torchside.quantization.fsdp).

Not priced (listed in `Communication.not_priced`): FP8 amax all-reduces (a few bytes per GEMM under
an FP8 recipe, and per FP8 weight when the optimizer step re-quantizes it), and a Llama embedding
split by hidden columns.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bridge import layout
from bridge.layout import MeshSpec, ShardMap
from twinspec.mesh import DP_REPLICATE, DP_SHARD, TP

if TYPE_CHECKING:
    import torch

    from bridge.plan.build import BuiltModel

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
MEMORY_KINDS = ("parameters", "gradients", "optimizer")
# (TP mode, sequence parallel) -> the collectives around one TP GEMM (torchside.parallel.tp_comm): a column
# GEMM's input [tokens, in] and a row GEMM's output [tokens, out] are what crosses the TP group.
TP_GEMM_COLLECTIVES = {
    ("column", True): (("all_gather", "forward", "input"), ("reduce_scatter", "backward", "input grad")),
    ("column", False): (("all_reduce", "backward", "input grad"),),
    ("row", True): (("reduce_scatter", "forward", "output"), ("all_gather", "backward", "output grad")),
    ("row", False): (("all_reduce", "forward", "output"),),
}


@dataclass(frozen=True)
class ParameterCost:
    """One parameter: where torch and JAX keep it, whether that is the same, and its bytes on every rank."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # nominal (an FP8 parameter lists the dtype it stands for)
    quantized: bool
    placements: str  # on the whole mesh, one per axis
    jax_name: str | None
    pspec: str | None
    same_layout: bool | None  # None: no JAX twin of this parameter
    verdict: str
    bytes: dict[str, tuple[int, ...]]  # MEMORY_KINDS -> bytes on rank 0, 1, ...


@dataclass(frozen=True)
class Collective:
    """One collective a training step runs, on one rank."""

    axis: str  # the mesh axis its group spans
    kind: str  # one of KINDS
    phase: str  # "forward" or "backward"
    source: str  # "fsdp" or "tp"
    what: str  # the unit or module and tensor
    bytes: int


@dataclass
class Communication:
    collectives: list[Collective] = field(default_factory=list)
    not_priced: list[str] = field(default_factory=list)

    def totals(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(axis, kind) -> (calls, bytes) of one rank's step."""
        totals: dict[tuple[str, str], tuple[int, int]] = {}
        for c in self.collectives:
            calls, size = totals.get((c.axis, c.kind), (0, 0))
            totals[(c.axis, c.kind)] = (calls + 1, size + c.bytes)
        return totals


@dataclass
class PlanCost:
    mesh: MeshSpec
    parameters: list[ParameterCost]
    communication: Communication

    def memory(self) -> dict[str, tuple[int, ...]]:
        """MEMORY_KINDS -> bytes on each rank, summed over the parameters."""
        return {
            kind: tuple(sum(p.bytes[kind][rank] for p in self.parameters) for rank in range(self.mesh.size))
            for kind in MEMORY_KINDS
        }


def price(built: BuiltModel) -> PlanCost:
    """Every parameter's layouts and bytes, and the step's collectives, of a built model."""
    world = _world_spec(built)
    costs = [_parameter_cost(built, world, name, param) for name, param in built.model.named_parameters()]
    return PlanCost(world, costs, communication(built))


def _world_spec(built: BuiltModel) -> MeshSpec:
    from bridge.transfer import torch_mesh_spec

    return torch_mesh_spec(built.meshes.world)


def world_map(param: torch.Tensor, world: MeshSpec) -> tuple[ShardMap, tuple[Any, ...]]:
    """The parameter's shard map on the whole mesh, and its placements there: Replicate on axes its mesh lacks."""
    from torch.distributed.tensor import DTensor, Replicate

    by_axis = {}
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        unknown = [name for name in names if name not in world.axis_names]
        if unknown:
            raise ValueError(f"a parameter's mesh axes {unknown} are not axes of the mesh {world}")
        by_axis = dict(zip(names, param.placements))
    placements = tuple(by_axis.get(name, Replicate()) for name in world.axis_names)
    return layout.from_placements(world, placements, tuple(param.shape)), placements


def _parameter_cost(built: BuiltModel, world: MeshSpec, name: str, param) -> ParameterCost:
    from bridge.layout import text
    from torchside.parallel.module_mesh import local_tensor

    shard_map, placements = world_map(param, world)
    local = local_tensor(param)
    local_shapes = [()] * world.size
    for coordinate in world.coordinates():
        local_shapes[world.rank_of(coordinate)] = shard_map.local_shape(coordinate)
    sizes = {
        "parameters": tuple(_stored_bytes(local, param.dtype, shape) for shape in local_shapes),
        "gradients": tuple(math.prod(shape) * param.dtype.itemsize for shape in local_shapes),
        "optimizer": tuple(_optimizer_bytes(built.optimizer, local, shape) for shape in local_shapes),
    }
    twin = built.jax_specs.get(name)
    pspec, same, verdict = None, None, "no JAX twin of this parameter"
    if twin is not None:
        pspec = text.format_pspec(twin.pspec)
        jax_shape = tuple(param.shape)[::-1] if twin.transposes else tuple(param.shape)
        jax_map = layout.from_pspec(world, twin.pspec, jax_shape)
        comparison = layout.compare(shard_map.transposed() if twin.transposes else shard_map, jax_map)
        same, verdict = comparison.equal, comparison.reason
    return ParameterCost(
        name, tuple(param.shape), str(param.dtype).removeprefix("torch."), hasattr(local, "quantized_storage"),
        text.format_placements(placements), None if twin is None else twin.name, pspec, same, verdict, sizes,
    )  # fmt: skip


def _stored_bytes(local, dtype, shape: tuple[int, ...]) -> int:
    """Bytes of a local shard of `shape`: its elements, or an FP8 parameter's buffers for that many rows."""
    storage = getattr(local, "quantized_storage", None)
    if storage is None:
        return math.prod(shape) * dtype.itemsize
    from torchside.quantization.storage import buffer_shapes

    rows, cols = math.prod(shape[:-1]), shape[-1]
    buffers = buffer_shapes(storage, rows, cols)
    return sum(math.prod(s) * getattr(storage, n).element_size() for n, s in buffers.items())


def _optimizer_bytes(optimizer, local, shape: tuple[int, ...]) -> int:
    """The state FusedAdam keeps for a local shard of `shape`: step, both moments as encoded, the master."""
    import torch

    from fp8kernels.adam_reference import split_master
    from torchside.optim import moment_formats

    values = torch.zeros(shape, dtype=torch.float32, device="meta")
    total = torch.zeros((), dtype=torch.float32).nbytes  # the step count
    for name, dtype in optimizer.moment_dtypes.items():
        stored, scale_inv = moment_formats.encode(values, dtype, root=name == "exp_avg_sq")
        total += stored.nbytes + (0 if scale_inv is None else scale_inv.nbytes)
    if optimizer._keeps_master(local):
        remainders = optimizer.store_param_remainders and not hasattr(local, "quantized_storage")
        total += (split_master(values)[1] if remainders else values).nbytes
    return total


# ---- communication


def communication(built: BuiltModel) -> Communication:
    """The collectives of one training step on rank 0 (module docstring)."""
    result = Communication()
    _fsdp_collectives(built, result)
    _tp_collectives(built, result)
    if built.options.model == "llama":
        _vocab_parallel_collectives(built, result)
    result.not_priced.append("FP8 amax all-reduces (a few bytes per GEMM under an FP8 recipe, per FP8 weight per step)")
    return result


def _fsdp_collectives(built: BuiltModel, result: Communication) -> None:
    from torch.distributed.fsdp import FSDPModule

    from bridge import _torch_compat

    mesh = built.options.mesh
    world = _world_spec(built)
    for name, module in built.model.named_modules():
        unit = _torch_compat.fsdp_unit(module) if isinstance(module, FSDPModule) else None
        if unit is None:
            continue
        label = f"{name or 'root'} ({len(unit.params)} parameters)"
        gathered = reduced = 0  # per rank: what it sends to the all-gather, what it keeps of the reduce-scatter
        for param in unit.params:
            shard_map, _ = world_map(param, world)
            padded = max(math.prod(shard_map.local_shape(c)) for c in world.coordinates())  # dim 0 ceil-chunked
            gather_dtype = unit.param_dtype or param.dtype
            gathered += _fsdp_send_bytes(param, built, padded * gather_dtype.itemsize)
            reduced += padded * (unit.reduce_dtype or gather_dtype).itemsize
        if mesh.dp_shard > 1:
            passes = ("forward", "backward") if unit.reshard_after_forward else ("forward",)
            for phase in passes:
                result.collectives.append(
                    Collective(DP_SHARD, "all_gather", phase, "fsdp", label, gathered * mesh.dp_shard)
                )
            result.collectives.append(
                Collective(DP_SHARD, "reduce_scatter", "backward", "fsdp", label, reduced * mesh.dp_shard)
            )
        if mesh.dp_replicate > 1:
            result.collectives.append(Collective(DP_REPLICATE, "all_reduce", "backward", "fsdp", label, reduced))


def _fsdp_send_bytes(param, built: BuiltModel, high_precision: int) -> int:
    """What a rank sends to FSDP2's all-gather of `param`: an FP8 parameter's buffers as its hook sends them."""
    from torchside.parallel.module_mesh import local_tensor

    local = local_tensor(param)
    if not hasattr(local, "quantized_storage"):
        return high_precision
    inputs, _ = local.fsdp_pre_all_gather(built.meshes.world[DP_SHARD], _tp_shape(param), None, None, None)
    return sum(t.nbytes for t in inputs)


def _tp_collectives(built: BuiltModel, result: Communication) -> None:
    from torchside.parallel import TensorParallelMixin
    from torchside.parallel.placements import grad_is_partial_over_tp

    options = built.options
    if options.mesh.tp == 1:
        return
    tokens = options.seq * options.batch // options.mesh.data_parallel_size  # whole sequences of this rank's batch
    itemsize = options.torch_dtype(options.dtype).itemsize

    def add(kind: str, phase: str, what: str, size: int) -> None:
        result.collectives.append(Collective(TP, kind, phase, "tp", what, size))

    for module_name, module in built.model.named_modules():
        if not isinstance(module, TensorParallelMixin) or module.tp_size == 1:
            continue
        for name, spec in module._param_specs.items():
            param = getattr(module, name)
            if param is None:
                continue
            what = f"{module_name}.{name}"
            parallelism = module.linear_parallelism(name) if spec.role == "linear_weight" else None
            if parallelism is not None:
                features = spec.shape[1] if parallelism.mode == "column" else spec.shape[0]  # [out, in]
                for kind, phase, tensor in TP_GEMM_COLLECTIVES[parallelism.mode, parallelism.sequence_parallel]:
                    add(kind, phase, f"{what} {tensor}", tokens * features * itemsize)
            if grad_is_partial_over_tp(spec.role, spec.parallel_mode, module.sequence_parallel):
                add("all_reduce", "backward", f"{what} grad", math.prod(_tp_shape(param)) * param.dtype.itemsize)


def _vocab_parallel_collectives(built: BuiltModel, result: Communication) -> None:
    """Llama's TP outside our layers: the vocabulary-split embedding and head, and loss_parallel's cross entropy.

    The embedding's partial lookups are summed (all-reduce; under sequence parallelism reduce-scattered,
    and the gradient all-gathered back); the head gathers the hidden states (sequence parallelism:
    all-gather, its gradient reduce-scattered; else the gradient of the replicated input is all-reduced);
    the cross entropy all-reduces three fp32 values per token (the logits' max, the sum of their
    exponentials, the target's logit). An embedding split by hidden columns is not priced.
    """
    from torch.distributed.tensor import DTensor, Shard

    from bridge.layout import text

    options = built.options
    if options.mesh.tp == 1:
        return
    weight = built.model.embedding.weight
    names = weight.device_mesh.mesh_dim_names if isinstance(weight, DTensor) else ()
    split = dict(zip(names, weight.placements)).get(TP) if names else None
    if not (isinstance(split, Shard) and split.dim == 0):
        shown = "not split" if split is None else text.format_placements([split])
        result.not_priced.append(f"tp: the embedding ({shown} over tp, not by vocabulary rows), the head, the loss")
        return
    tokens = options.seq * options.batch // options.mesh.data_parallel_size
    hidden = tokens * built.model.config.hidden_size * weight.dtype.itemsize

    def add(kind: str, phase: str, what: str, size: int) -> None:
        result.collectives.append(Collective(TP, kind, phase, "tp", what, size))

    if options.sequence_parallel:
        add("reduce_scatter", "forward", "embedding output", hidden)
        add("all_gather", "backward", "embedding output grad", hidden)
        add("all_gather", "forward", "lm_head input", hidden)
        add("reduce_scatter", "backward", "lm_head input grad", hidden)
    else:
        add("all_reduce", "forward", "embedding output", hidden)
        add("all_reduce", "backward", "lm_head input grad", hidden)
    for what in ("max", "sum of exponentials", "target logit"):
        add("all_reduce", "forward", f"loss_parallel: each token's logit {what}", tokens * 4)  # fp32 logits


def _tp_shape(param) -> tuple[int, ...]:
    """The shape of the TP shard a forward reads (FSDP2 gathers the data-parallel shards back into it)."""
    from torch.distributed.tensor import DTensor, Shard

    shape = list(param.shape)
    if isinstance(param, DTensor):
        names = param.device_mesh.mesh_dim_names or ()
        for d, (name, placement) in enumerate(zip(names, param.placements)):
            if name == TP and isinstance(placement, Shard):
                shape[placement.dim] //= param.device_mesh.size(d)
    return tuple(shape)


def per_axis(collectives: Iterable[Collective]) -> dict[str, dict[str, int]]:
    """axis -> kind -> bytes."""
    table: dict[str, dict[str, int]] = {}
    for c in collectives:
        table.setdefault(c.axis, dict.fromkeys(KINDS, 0))[c.kind] += c.bytes
    return table


__all__ = ["KINDS", "MEMORY_KINDS", "Collective", "Communication", "ParameterCost", "PlanCost", "price", "world_map"]
