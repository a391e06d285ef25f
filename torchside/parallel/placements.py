"""The one placement table: where a tensor-parallel module's parameters live on the TP mesh.

Keyed by (parameter role, parallel mode); a module declares each parameter's role, its own mode
and the parameter's global shape, and everything else follows from this table:

    role            column                   row         None
    linear_weight   Shard(0)                 Shard(1)    Replicate   [out, in]: column splits out, row splits in
    linear_bias     Shard(0)                 Replicate   Replicate   [out]: row adds it after the reduction
    gated_weight    _StridedShard(0, sf=2)   -           Replicate   [2F, in] = [gate; up]: each half split
    gated_bias      _StridedShard(0, sf=2)   -           Replicate   [2F] = [gate; up]: each half split
    norm            Replicate                Replicate   Replicate   norm weight / bias [hidden]

- the constructor allocates the local shard: the global shape with the Shard dim divided by tp_size;
- `set_device_mesh` wraps that shard as a DTensor with the table's placement (FSDP2 shards dim 0 of
  the local shard again on top: `_StridedShard(0, sf=tp)` for a column weight);
- under sequence parallelism a TP-replicated parameter only sees this rank's tokens, so its
  gradient is a partial sum that the module all-reduces over the TP group.

The gated roles are the fc1 of a gated activation (swiglu, geglu, ...): its rows hold two halves,
gate rows 0..F-1 and up rows F..2F-1, and the activation pairs gate row i with up row F + i. A
plain Shard(0) would give rank 0 only gate rows, so each half is split on its own and a rank keeps
its gate and up rows together: rank j of tp holds [gate rows j*F/tp ..; up rows F + j*F/tp ..]
(2F/tp rows). That is DTensor's `_StridedShard(0, split_factor=2)` (cut dim 0 into 2 blocks, split
each over the mesh, concatenate this rank's parts); JAX writes it as the [2, F, in] view of the
weight with the F axis on "tp". FSDP2 cannot stack its own dim-0 split on top of a strided TP
placement (it would describe the wrong rows), so `parallelize` shards gated weights on dim 1.

Attention needs no role of its own: the fused QKV weight's rows are grouped by key/value head
(see `torchside.modules.multihead_attention`), so Shard(0) gives each rank whole groups.

GroupedLinear's expert weights and biases are linear weights and biases: each is split by the
same row of the table.
"""

from __future__ import annotations

from torch.distributed.tensor import Placement, Replicate, Shard

from torchside.parallel._torch_compat import make_strided_shard
from torchside.recipe import MXFP8BlockScaling, NVFP4BlockScaling, Recipe

ROLES = ("linear_weight", "linear_bias", "gated_weight", "gated_bias", "norm")
PARALLEL_MODES = (None, "column", "row")

# (role, parallel mode) -> the tensor dim split over the TP group, or None for replicated.
_TP_SHARD_DIM: dict[tuple[str, str | None], int | None] = {
    ("linear_weight", "column"): 0,
    ("linear_weight", "row"): 1,
    ("linear_weight", None): None,
    ("linear_bias", "column"): 0,
    ("linear_bias", "row"): None,
    ("linear_bias", None): None,
    ("gated_weight", "column"): 0,
    ("gated_weight", None): None,
    ("gated_bias", "column"): 0,
    ("gated_bias", None): None,
    ("norm", "column"): None,
    ("norm", "row"): None,
    ("norm", None): None,
}

# Roles whose split dim holds this many equal blocks, each split over TP on its own (strided).
_TP_BLOCKS: dict[str, int] = {"gated_weight": 2, "gated_bias": 2}

# Recipes whose quantized buffers tile each GEMM operand exactly: a TP shard must keep whole tiles.
_RECIPE_TILE: dict[type, int] = {MXFP8BlockScaling: 32, NVFP4BlockScaling: 16}


def tp_shard_dim(role: str, parallel_mode: str | None) -> int | None:
    """The dim the TP group splits for this (role, mode), None when the parameter is replicated."""
    key = (role, parallel_mode)
    if key not in _TP_SHARD_DIM:
        raise ValueError(f"no placement for parameter role {role!r} in parallel mode {parallel_mode!r}: "
                         f"roles are {ROLES}, modes {PARALLEL_MODES}")
    return _TP_SHARD_DIM[key]


def tp_placement(role: str, parallel_mode: str | None) -> Placement:
    """The DTensor placement on the 1-D TP mesh."""
    dim = tp_shard_dim(role, parallel_mode)
    if dim is None:
        return Replicate()
    blocks = _TP_BLOCKS.get(role, 1)
    return Shard(dim) if blocks == 1 else make_strided_shard(dim, blocks)


def local_shape(
    owner: str, name: str, role: str, parallel_mode: str | None, global_shape: tuple[int, ...], tp_size: int
) -> tuple[int, ...]:
    """The shape of this rank's shard; ValueError if tp_size does not divide the split dim."""
    dim = tp_shard_dim(role, parallel_mode)
    if dim is None:
        return tuple(global_shape)
    blocks = _TP_BLOCKS.get(role, 1)  # each block is split on its own: every one must divide
    if global_shape[dim] % (blocks * tp_size):
        what = f"each of its {blocks} blocks ({global_shape[dim] // blocks})" if blocks > 1 else "it"
        raise ValueError(
            f"{owner}.{name}: dim {dim} of the global shape {tuple(global_shape)} ({parallel_mode}-parallel) is "
            f"split over tp_size={tp_size} but {what} does not divide by {tp_size}: choose a size that is a "
            f"multiple of {blocks * tp_size}"
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


__all__ = [
    "PARALLEL_MODES",
    "ROLES",
    "check_recipe_fits_shard",
    "grad_is_partial_over_tp",
    "local_shape",
    "tp_placement",
    "tp_shard_dim",
]
