"""Split a `Llama` over an (HSDP or FSDP) x TP mesh: torch's own TP styles outside our layers, ours inside.

Order (one place, as `torchside.parallel.parallelize` asks):

1. the embedding and the head, with torch's `parallelize_module`:
   - `embedding`: `RowwiseParallel`, the vocabulary-split embedding. Its weight [V, D] becomes a
     `Shard(0)` DTensor: each TP rank looks up the tokens of its vocabulary rows (zeros elsewhere)
     and the partial embeddings are summed, into every rank (`Replicate`) or, with sequence
     parallelism, reduce-scattered over the sequence (`Shard(0)` of [S, B, D]).
     `Shard(0)` of the weight is exactly a column-parallel head's layout (our placement table:
     linear weight, column), so the tied head needs no collective on its weight: each rank
     multiplies the gathered hidden states by its vocabulary rows and gets its slice of the
     logits, `Shard(2)` of [S, B, V], which `torch.distributed.tensor.parallel.loss_parallel`
     turns into a cross entropy without gathering V. `ColwiseParallel` (the hidden dim split)
     would make the head row-parallel: an all-reduce of the whole [S, B, V] logits every step.
   - `lm_head`: `PrepareModuleInput` turns the final norm's output into a `Replicate` DTensor
     (an all-gather of the sequence under sequence parallelism); the weight passes as it is. An
     untied head's own weight [Vp, D] becomes a `Shard(0)` DTensor too: the same layout, the
     same vocab-split logits. The vocabulary is padded to a multiple of tp (the model's
     `padded_vocab_size`), so any vocabulary size splits.
2. our TransformerLayers and the final RMSNorm: `set_device_mesh`, then FSDP2 per layer and on the
   root (embedding, norm), then materialization, all through `torchside.parallel.parallelize`.

Data-parallel gradients are sums, not FSDP2's averages: each rank's loss is its tokens' loss over
the global batch's token count (`torchside.train.loss_of`), so that the output gradients every FP8
cast sees are the single-device ones (a rank's mean over its own tokens doubles them at DP 2, and
E5M2 rounds doubled subnormals differently); `sum_data_parallel_gradients` then undoes FSDP2's
division by the DP size (exact for a power of 2). FSDP2's own `set_gradient_divide_factor(1.0)`
would do it inside the reduce-scatter, but needs NCCL's PREMUL_SUM, which gloo lacks.

`load_full_state` gives every rank its shards of one full state dict (a seed checkpoint), so that
a run on any mesh starts from the values of the same single-device initialization.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, parallelize_module

from torchside.models.llama import Llama
from torchside.parallel import parallelize
from torchside.parallel.plan import DEFAULT_PLAN, Plan, mesh_shape, resolve
from twinspec.mesh import DP_REPLICATE, DP_SHARD, MESH_AXES, TP


@dataclass(frozen=True)
class LlamaMeshes:
    """The meshes a run needs, cut from one world mesh with dims MESH_AXES ("dp_replicate", "dp_shard", "tp")."""

    world: DeviceMesh | None  # None: one device
    data: DeviceMesh | None  # FSDP: 1-D (dp_shard), HSDP: 2-D (dp_replicate, dp_shard); None: no data parallelism
    tp: DeviceMesh | None  # None: no tensor parallelism
    weight: DeviceMesh | None  # every rank holding a different piece of a weight: (dp_shard, tp) flattened

    @property
    def data_parallel_size(self) -> int:
        return self.world.size(0) * self.world.size(1)

    def data_parallel_rank(self) -> int:
        """This rank's index among the data-parallel ranks (row-major over dp_replicate, dp_shard)."""
        coordinate = self.world.get_coordinate()
        return coordinate[0] * self.world.size(1) + coordinate[1]


def build_meshes(device_type: str, *, dp: int = 1, tp: int = 1, replicate: int = 1) -> LlamaMeshes:
    """A (replicate, dp, tp) world mesh with axes MESH_AXES over replicate * dp * tp ranks (the group's size)."""
    for name, size in (("dp", dp), ("tp", tp), ("replicate", replicate)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"build_meshes({name}={size!r}): pass an integer >= 1")
    world = init_device_mesh(device_type, (replicate, dp, tp), mesh_dim_names=MESH_AXES)
    data = None
    if replicate > 1:
        data = world[DP_REPLICATE, DP_SHARD]  # HSDP even with dp == 1: FSDP2 keeps the replicas in sync
    elif dp > 1:
        data = world[DP_SHARD]
    weight = None
    if dp > 1 and tp > 1:
        weight = world[DP_SHARD, TP]._flatten(f"{DP_SHARD}_{TP}")
    elif dp > 1 or tp > 1:
        weight = world[DP_SHARD if dp > 1 else TP]
    return LlamaMeshes(world, data, world[TP] if tp > 1 else None, weight)


def _check_fits(model: Llama, tp: int, sequence_parallel: bool) -> None:
    config = model.config
    if config.num_kv_heads % tp:
        raise ValueError(
            f"parallelize_llama: tp={tp} must divide num_kv_heads={config.num_kv_heads}: choose a tp that divides it"
        )
    if model.norm.tp_size != tp or model.norm.sequence_parallel != sequence_parallel:
        raise ValueError(
            f"parallelize_llama(tp={tp}, sequence_parallel={sequence_parallel}): the model was built with "
            f"ModuleConfig(tp_size={model.norm.tp_size}, sequence_parallel={model.norm.sequence_parallel}); "
            "build it with the same values"
        )


def parallelize_llama(
    model: Llama,
    meshes: LlamaMeshes | None,
    *,
    device: torch.device | str,
    mp_policy: MixedPrecisionPolicy | None = None,
    plan: Plan | None = None,
) -> Llama:
    """TP on the embedding and head (torch), then our layers' TP, FSDP2 and materialization (module docstring).

    `meshes=None`: one device, only the materialization of a meta-device model. `plan` (None:
    DEFAULT_PLAN) is checked first; its embedding mode "hidden" splits the embedding (and an untied
    head) by hidden columns instead (`ColwiseParallel`, weight `Shard(1)`), which makes the head
    row-parallel: its logits are a partial sum over TP.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_llama(model={type(model).__name__}): pass a torchside.models.Llama")
    if meshes is None:
        meshes = LlamaMeshes(world=None, data=None, tp=None, weight=None)
    tp = 1 if meshes.tp is None else meshes.tp.size()
    sequence_parallel = model.norm.sequence_parallel
    _check_fits(model, tp, sequence_parallel)
    plan = DEFAULT_PLAN if plan is None else plan
    resolution = resolve(model, plan, mesh_shape(meshes.data, meshes.tp))
    if meshes.tp is not None:
        hidden_layout = Shard(0) if sequence_parallel else Replicate()  # of [S, B, D]
        by_vocab = resolution.tp_modes["embedding"] == "vocab"
        style = RowwiseParallel if by_vocab else ColwiseParallel
        styles = {
            "embedding": style(input_layouts=Replicate(), output_layouts=hidden_layout),
            "lm_head": PrepareModuleInput(
                input_layouts=(hidden_layout, None), desired_input_layouts=(Replicate(), None), use_local_output=False
            ),
        }
        parallelize_module(model, meshes.tp, styles)
        if model.lm_head.weight is not None:  # untied: split by its own mode, vocabulary rows or hidden columns
            head_dim = 0 if resolution.tp_modes["lm_head"] == "vocab" else 1
            weight = distribute_tensor(model.lm_head.weight.detach(), meshes.tp, [Shard(head_dim)])
            model.lm_head.weight = nn.Parameter(weight, requires_grad=model.lm_head.weight.requires_grad)
    parallelize(
        model,
        meshes.data,
        tp_mesh=meshes.tp,
        weight_mesh=meshes.weight,
        blocks=list(model.layers),
        device=device,
        mp_policy=mp_policy,
        plan=plan,
    )
    return model


@torch.no_grad()
def sum_data_parallel_gradients(model: torch.nn.Module, meshes: LlamaMeshes | None) -> None:
    """Multiply every gradient by the DP size after backward: FSDP2's average becomes the sum (module docstring)."""
    size = 1 if meshes is None or meshes.world is None else meshes.data_parallel_size
    if size == 1:
        return
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in (p.grad for p in model.parameters()) if g is not None]
    torch._foreach_mul_(grads, float(size))


def load_full_state(model: Llama, full_state: dict[str, torch.Tensor] | None, *, from_rank0: bool = False) -> None:
    """Copy one full state dict into every rank's shards; from_rank0: only rank 0 passes it, the rest None."""
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_rank0)
    # A copy: set_model_state_dict replaces the dict's values by this rank's shards.
    set_model_state_dict(model, {} if full_state is None else dict(full_state), options=options)


__all__ = ["LlamaMeshes", "build_meshes", "load_full_state", "parallelize_llama", "sum_data_parallel_gradients"]
