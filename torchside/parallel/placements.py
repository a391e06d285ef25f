"""The one placement table (twinspec.placement, framework-free): where a tensor-parallel module's parameters live on the TP mesh.

Keyed by (parameter role, parallel mode); a module declares each parameter's role, its own mode
and the parameter's global shape, and everything else follows from this table:

    role            column                   row         None
    linear_weight   Shard(0)                 Shard(1)    Replicate   [out, in]: column splits out, row splits in
    linear_bias     Shard(0)                 Replicate   Replicate   [out]: row adds it after the reduction
    norm            Replicate                Replicate   Replicate   norm weight / bias [hidden]

- the constructor allocates the local shard: the global shape with the Shard dim divided by tp_size;
- `set_device_mesh` wraps that shard as a DTensor with the table's placement (FSDP2 shards dim 0 of
  the local shard again on top: `_StridedShard(0, sf=tp)` for a column weight);
- under sequence parallelism a TP-replicated parameter only sees this rank's tokens, so its
  gradient is a partial sum that the module all-reduces over the TP group.

A gated fc1 (swiglu, geglu, ...) needs no role of its own either: its rows interleave gate and up
(`torchside.modules.layernorm_mlp`), so Shard(0) gives each rank whole (gate, up) pairs, one
contiguous chunk that DCP, FSDP2 and a JAX PartitionSpec all describe.

Attention needs no role of its own: the fused QKV weight's rows are grouped by key/value head
(see `torchside.modules.multihead_attention`), so Shard(0) gives each rank whole groups.

GroupedLinear's expert weights and biases are linear weights and biases: each is split by the
same row of the table.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard

from torchside.recipe import Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling, Recipe
from twinspec.placement import tp_shard_dim  # the table itself, shared with the JAX twin

# Recipes whose quantized buffers tile each GEMM operand exactly: a TP shard must keep whole tiles.
_RECIPE_TILE: dict[type, int] = {MXFP8BlockScaling: 32, NVFP4BlockScaling: 16}


def tp_placement(role: str, parallel_mode: str | None) -> Placement:
    """The DTensor placement on the 1-D TP mesh."""
    dim = tp_shard_dim(role, parallel_mode)
    return Replicate() if dim is None else Shard(dim)


def local_shape(
    owner: str, name: str, role: str, parallel_mode: str | None, global_shape: tuple[int, ...], tp_size: int
) -> tuple[int, ...]:
    """The shape of this rank's shard; ValueError if tp_size does not divide the split dim."""
    dim = tp_shard_dim(role, parallel_mode)
    if dim is None:
        return tuple(global_shape)
    if global_shape[dim] % tp_size:
        raise ValueError(
            f"{owner}.{name}: dim {dim} of the global shape {tuple(global_shape)} ({parallel_mode}-parallel) "
            f"does not divide by tp_size={tp_size}: choose a size that is a multiple of {tp_size}"
        )
    shape = list(global_shape)
    shape[dim] //= tp_size
    return tuple(shape)


def grad_is_partial_over_tp(role: str, parallel_mode: str | None, sequence_parallel: bool) -> bool:
    """Whether the gradient needs an all-reduce over the TP group (replicated, seeing local tokens only)."""
    return sequence_parallel and tp_shard_dim(role, parallel_mode) is None


def check_recipe_fits_shard(recipe: Recipe, owner: str, name: str, shape: tuple[int, ...], tp_size: int) -> None:
    """ValueError when a recipe cannot quantize this local GEMM weight shard (and its transpose) whole."""
    tile = _RECIPE_TILE.get(type(recipe))
    if tile is None or tp_size == 1:
        return
    bad = [size for size in shape if size % tile]
    if bad:
        raise ValueError(
            f"{owner}.{name}: {type(recipe).__name__} quantizes in {tile}-element tiles along both dims, but the "
            f"local shard is {tuple(shape)} with tp_size={tp_size}: make every split dim a multiple of "
            f"{tile} * tp_size (and the others a multiple of {tile}), or use another recipe"
        )


def check_fp8_weight_fits_shard(
    recipe: Recipe, owner: str, name: str, shape: tuple[int, ...], local: tuple[int, ...]
) -> None:
    """ValueError when the TP shards of an FP8 weight would cut through its Float8BlockScaling blocks.

    A stored FP8 weight shard must be the slice of the whole weight's cast, so that FSDP2 gathers
    and checkpoints reshard its bytes; a shard holding part of a 128x128 block would scale it by
    its own amax instead. (MXFP8 and NVFP4 tiles: check_recipe_fits_shard.)
    """
    if not isinstance(recipe, Float8BlockScaling):
        return
    block = recipe.block_for("weight")
    for dim, (whole, part) in enumerate(zip(shape, local, strict=True)):
        if part != whole and part % block[dim]:
            raise ValueError(
                f"{owner}.{name}: an FP8 weight of shape {tuple(shape)} under Float8BlockScaling has "
                f"{block[0]}x{block[1]} scale blocks, but tensor parallelism splits dim {dim} into {part}-wide "
                f"shards that cut through them: make dim {dim} a multiple of {block[dim]} * {whole // part}, "
                "use another recipe, or build the weight in high precision (quantized_model_init(enabled=False))"
            )


__all__ = [
    "check_fp8_weight_fits_shard",
    "check_recipe_fits_shard",
    "grad_is_partial_over_tp",
    "local_shape",
    "tp_placement",
    "tp_shard_dim",
]
