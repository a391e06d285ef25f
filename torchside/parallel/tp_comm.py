"""`TPComm`: the collectives of one tensor-parallel group, as the autograd functions the modules call.

Shape legend: T tokens (dim 0 of the activations; local T/tp under sequence parallelism), D the
other dims. Every collective runs along dim 0, over the group given at construction:

    function               forward                        backward
    gather_tokens          all-gather [T/tp, D] -> [T, D]  reduce-scatter (sum) dx [T, D] -> [T/tp, D]
    reduce_scatter_tokens  reduce-scatter (sum)            all-gather
    all_reduce             all-reduce (sum)                identity
    all_reduce_grad        identity                        all-reduce (sum)

`gather_quantized_rows` all-gathers a per-tensor-scaled FP8 tensor as its bytes: every rank must
hold the same scale (its amax reduced over the group, or a DelayedScaling scale from a region
whose amax group contains this one); the columnwise copy is rebuilt by transposing locally.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import Tensor

from torchside.quantization import QuantizedStorage
from torchside.recipe import DelayedScaling, Float8CurrentScaling, Recipe


def has_per_tensor_scale(recipe: Recipe) -> bool:
    """Recipes whose one scale per tensor lets shards be gathered as FP8 bytes."""
    return isinstance(recipe, DelayedScaling | Float8CurrentScaling)


# Functional collectives, not in-place ones (dist.all_reduce(out), all_gather_into_tensor(out, ...)): torch 2.11's
# Dynamo traced those inside the autograd functions below so that compiled TP blocks' parameters got zero
# gradients (silently; torch 2.13 traced them right).


def all_gather_dim0(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Concatenate every rank's `t` along dim 0, in rank order."""
    return funcol.wait_tensor(funcol.all_gather_tensor(t.contiguous(), 0, group))


def reduce_scatter_dim0(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Sum `t` over the ranks and keep this rank's 1/size of dim 0."""
    size = dist.get_world_size(group)
    if t.shape[0] % size:
        raise ValueError(
            f"sequence parallelism splits dim 0 of the activations over {size} TP ranks, but it has "
            f"{t.shape[0]} rows: make the sequence length a multiple of tp_size={size}"
        )
    return funcol.wait_tensor(funcol.reduce_scatter_tensor(t.contiguous(), "sum", 0, group))


def all_reduce_sum(t: Tensor, group: dist.ProcessGroup) -> Tensor:
    """The sum of `t` over the ranks, in a new tensor."""
    return funcol.wait_tensor(funcol.all_reduce(t.contiguous(), "sum", group))


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, dx):
        return reduce_scatter_dim0(dx, ctx.group), None


class _ReduceScatterTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, dy):
        return all_gather_dim0(dy, ctx.group), None


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx, dy):
        return dy, None


class _AllReduceGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        return all_reduce_sum(dx, ctx.group), None


@dataclasses.dataclass(frozen=True, eq=False)
class TPComm:
    """One TP group's collectives (see the module docstring)."""

    group: dist.ProcessGroup

    @property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def gather_tokens(self, x: Tensor) -> Tensor:
        """[T/tp, ...] -> [T, ...]; the backward reduce-scatters."""
        return _GatherTokens.apply(x, self.group)

    def reduce_scatter_tokens(self, x: Tensor) -> Tensor:
        """Partial sums [T, ...] -> this rank's summed [T/tp, ...]; the backward all-gathers."""
        return _ReduceScatterTokens.apply(x, self.group)

    def all_reduce(self, x: Tensor) -> Tensor:
        """Partial sums -> the sum on every rank; the backward passes the gradient through."""
        return _AllReduce.apply(x, self.group)

    def all_reduce_grad(self, x: Tensor) -> Tensor:
        """x unchanged; its gradient is summed over the group (a replica used on split work)."""
        return _AllReduceGrad.apply(x, self.group)

    def gather_quantized_rows(self, local: QuantizedStorage, columnwise: bool) -> QuantizedStorage:
        """The row-concatenation of every rank's per-tensor FP8 [rows, cols] matrix, sent as bytes."""
        if local.scheme != "tensorwise" or not local.rowwise:
            raise ValueError(f"only rowwise per-tensor FP8 gathers as bytes, not a {local.describe()}")
        data = local.rowwise_data
        gathered = all_gather_dim0(data.view(torch.uint8), self.group).view(data.dtype)
        transposed = gathered.t().contiguous() if columnwise else None
        return dataclasses.replace(
            local,
            rows=gathered.shape[0],
            rowwise_data=gathered,
            columnwise_data=transposed,
            columnwise_scale_inv=local.rowwise_scale_inv if columnwise else None,  # one scale: the same
        )


@dataclasses.dataclass(frozen=True, eq=False)
class LinearParallelism:
    """How one GEMM is split over the TP group (functions.linear reads it)."""

    comm: TPComm
    mode: str  # "column" or "row"
    sequence_parallel: bool
    fp8_all_gather: bool  # gather sequence-parallel inputs as FP8 bytes under per-tensor recipes


__all__ = [
    "LinearParallelism",
    "TPComm",
    "all_gather_dim0",
    "all_reduce_sum",
    "has_per_tensor_scale",
    "reduce_scatter_dim0",
]
