"""`Quantizer`: turns high-precision tensors into QuantizedTensors for one recipe and role.

One table maps each recipe family to the kernel function it calls (the same name in
`fp8kernels.reference` and `fp8kernels.quantize`) and to that function's arguments. The quantizer
adds what a single call cannot know: the delayed-scaling state (scale (1,) and
amax_history (len,), fixed shapes, updated in place), the amax reduction group, and the
stochastic-rounding step. Pickling and deepcopy drop the process group.

A quantizer with an amax group all-reduces its tensor's amax before casting. `reduce_amaxes` does
that for several tensors at once, one all-reduce per group (a GEMM's input and weight), and
`quantize(x, amax=...)` takes the result. `quantize_split` quantizes consecutive row groups of one
tensor with one quantizer each (GroupedLinear's experts): one cast launch for the tensorwise recipes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fp8kernels import ops as kernel_ops
from fp8kernels._backend import Backend
from fp8kernels._checks import check_splits, matrix_view
from twinspec.formats import FORMATS
from fp8kernels.reference import delayed_scaling_update, group_amaxes
from torchside.quantization.storage import QuantizedStorage, from_quantized
from torchside.quantization.tensor import QuantizedTensor
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
    check_role,
)


@dataclass(frozen=True)
class _Family:
    kernel: str  # function name in fp8kernels.reference and fp8kernels.quantize
    arguments: Callable[[Recipe, str], dict]  # the recipe's keyword arguments for a role
    takes_amax_group: bool  # one amax sets the scale, so shards can agree on it by all-reduce


_FAMILIES: dict[type, _Family] = {
    DelayedScaling: _Family("quantize_tensorwise", lambda r, role: {"fmt": r.fp8_format.for_role(role)}, True),
    Float8CurrentScaling: _Family(
        "quantize_tensorwise",
        lambda r, role: {
            "fmt": r.fp8_format.for_role(role),
            "power_2_scale": r.power_2_scale,
            "amax_epsilon": r.amax_epsilon,
        },
        True,
    ),
    Float8BlockScaling: _Family(
        "quantize_blockwise",
        lambda r, role: {
            "fmt": r.fp8_format.for_role(role),
            "block": r.block_for(role),
            "power_2_scale": r.power_2_scale,
        },
        False,
    ),
    MXFP8BlockScaling: _Family(
        "quantize_mxfp8",
        lambda r, role: {"fmt": r.fp8_format.for_role(role), "scale_rounding": r.scale_rounding},
        False,
    ),
    # NVFP4: the global amax, for roles without Hadamard or stochastic rounding (_takes_amax_group).
    NVFP4BlockScaling: _Family(
        "quantize_nvfp4", lambda r, role: {"block": r.block_for(role), "hadamard": r.hadamard_for(role)}, True
    ),
}


def _takes_amax_group(recipe: Recipe, role: str) -> bool:
    # A reduced NVFP4 amax is x's: it cannot stand for the amax of a Hadamard-rotated columnwise copy.
    if isinstance(recipe, NVFP4BlockScaling):
        return not recipe.hadamard_for(role)
    return _FAMILIES[type(recipe)].takes_amax_group


@dataclass(frozen=True, eq=False)
class Quantizer:
    """Quantizes tensors of one role under one recipe; holds the state that recipe needs."""

    recipe: Recipe
    role: str = "input"
    rowwise: bool = True
    columnwise: bool = True
    amax_reduction_group: dist.ProcessGroup | None = None
    device: torch.device | str = "cpu"  # where the state tensors live: the device of the tensors quantized
    scale: Tensor | None = field(init=False, default=None)  # DelayedScaling: fp32 (1,)
    amax_history: Tensor | None = field(init=False, default=None)  # DelayedScaling: fp32 (len,), row 0 = now
    stochastic_step: Tensor | None = field(init=False, default=None)  # NVFP4 grads: int64 (1,), seed offset

    def __post_init__(self) -> None:
        family = _FAMILIES.get(type(self.recipe))
        if family is None:
            names = ", ".join(cls.__name__ for cls in _FAMILIES)
            raise TypeError(f"recipe={self.recipe!r} is not a recipe: pass one of {names} (torchside.recipe)")
        check_role(self.role)
        if not (self.rowwise or self.columnwise):
            raise ValueError("rowwise=False and columnwise=False quantize nothing: enable at least one usage")
        if self.amax_reduction_group is not None and not _takes_amax_group(self.recipe, self.role):
            raise ValueError(
                f"amax_reduction_group applies to DelayedScaling, Float8CurrentScaling and NVFP4 roles without the "
                f"Hadamard transform (its weights), not {type(self.recipe).__name__} for role {self.role!r}: "
                "leave it None"
            )
        set_state = object.__setattr__  # the dataclass is frozen; the state tensors change in place
        if isinstance(self.recipe, DelayedScaling):
            set_state(self, "scale", torch.ones(1, device=self.device))
            set_state(self, "amax_history", torch.zeros(self.recipe.amax_history_len, device=self.device))
        if isinstance(self.recipe, NVFP4BlockScaling) and self.recipe.stochastic_for(self.role):
            set_state(self, "stochastic_step", torch.zeros(1, dtype=torch.int64, device=self.device))

    @property
    def fmax(self) -> float:
        """Largest finite value of the element format this quantizer writes."""
        fmt = "e2m1" if isinstance(self.recipe, NVFP4BlockScaling) else self.recipe.fp8_format.for_role(self.role)
        return FORMATS[fmt].max

    def kernel_call(self, x: Tensor, amax: Tensor | None = None) -> tuple[str, dict]:
        """(function name, keyword arguments) of the next quantization of `x`; advances the rounding step.

        `amax`: x's amax already reduced over the group (`reduce_amaxes`); None reduces it here.
        """
        family = _FAMILIES[type(self.recipe)]
        kwargs = family.arguments(self.recipe, self.role) | {"rowwise": self.rowwise, "columnwise": self.columnwise}
        if amax is not None and not self.takes_reduced_amax:
            raise ValueError(
                f"amax= is the amax reduced over this quantizer's amax_reduction_group, but this "
                f"{type(self.recipe).__name__} {self.role} quantizer reduces none: leave it None"
            )
        if self.scale is not None:
            kwargs["scale"] = self._scale_on(x.device)
        elif self.takes_reduced_amax:  # every shard casts with the amax of all of them
            if amax is None:
                (amax,) = reduce_amaxes([(self, x)])
            kwargs["amax" if isinstance(self.recipe, Float8CurrentScaling) else "global_amax"] = amax
        elif isinstance(self.recipe, Float8CurrentScaling):
            # The amax by torch (one dispatch) rather than by a second kernel launch: the host issues
            # launches slower than the GPU runs these casts. The same amax, so the same scale and bytes.
            kwargs["amax"] = local_amax(x)
        if self.stochastic_step is not None:
            # The seed stays a device tensor and the counter advances by a device op: no host read, so a CUDA
            # graph that captured this cast draws new random bits on every replay. The bits use the seed mod
            # 2^32 (fp8kernels.formats.stochastic_key), so the recipe's seed is reduced first: no int64 overflow.
            kwargs["stochastic_seed"] = self.stochastic_step + self.recipe.stochastic_rounding_seed % 2**32
            self.stochastic_step.add_(1)
        return family.kernel, kwargs

    def quantize(self, x: Tensor, *, backend: Backend | None = None, amax: Tensor | None = None) -> QuantizedTensor:
        """`x` as a QuantizedTensor of x's shape and nominal dtype (backend: default from x's device).

        `amax`: x's amax reduced over the group by `reduce_amaxes`; None reduces it here when needed.
        """
        return QuantizedTensor(self.quantize_storage(x, backend=backend, amax=amax), tuple(x.shape), x.dtype)

    def quantize_storage(
        self, x: Tensor, *, backend: Backend | None = None, amax: Tensor | None = None
    ) -> QuantizedStorage:
        """The buffers `quantize` wraps, for callers that only read them (the FP8 GEMMs)."""
        _check_high_precision(x)
        name, kwargs = self.kernel_call(x, amax)
        q = kernel_ops.quantize(name, x, backend, **kwargs)
        if self.amax_history is not None:  # row 0 collects the max of this step's amaxes
            current = self.amax_history[:1]
            torch.maximum(current, nan_as_inf(q.amax), out=current)
        return from_quantized(q)

    @property
    def takes_reduced_amax(self) -> bool:
        """Whether each quantization first all-reduces the tensor's amax (current scaling, NVFP4 with a group)."""
        return self.scale is None and self._reduces_amax()

    def update(self) -> None:
        """DelayedScaling: reduce this step's amax over the group, set the next scale, roll the history."""
        if self.amax_history is None:
            return  # the other recipes keep no state between steps
        if self._reduces_amax():
            current = self.amax_history[:1].clone()
            dist.all_reduce(current, op=dist.ReduceOp.MAX, group=self.amax_reduction_group)
            self.amax_history[:1].copy_(current)
        history, scale = delayed_scaling_update(
            self.amax_history, self.scale, self.fmax, margin=self.recipe.margin, algo=self.recipe.amax_compute_algo
        )
        self.amax_history.copy_(history)
        self.scale.copy_(scale)

    def _scale_on(self, device: torch.device) -> Tensor:
        """The DelayedScaling scale, which must live where the tensors it scales do."""
        if self.scale.device != device:
            raise ValueError(
                f"the DelayedScaling state is on {self.scale.device} but the tensor on {device}: "
                f"build the Quantizer with device={str(device)!r}"
            )
        return self.scale

    def _reduces_amax(self) -> bool:
        group = self.amax_reduction_group
        enabled = getattr(self.recipe, "reduce_amax", True)
        return group is not None and enabled and dist.get_world_size(group) > 1

    def __getstate__(self) -> dict:
        # Process groups cannot be pickled or copied: the copy must be given its own group.
        return {**self.__dict__, "amax_reduction_group": None}


def _check_high_precision(x: object) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point() or isinstance(x, QuantizedTensor):
        raise TypeError(f"quantize takes a float32, bfloat16 or float16 tensor, got {type(x).__name__}")


def quantize_split(
    quantizers: Sequence[Quantizer], x: Tensor, m_splits: Sequence[int], *, backend: Backend | None = None
) -> list[QuantizedStorage]:
    """`quantizers[g].quantize_storage(rows of group g)` for consecutive row groups of x [..., K] (m_splits[g]
    rows in group g): the same buffers and state updates, for far fewer launches.

    The tensorwise recipes (DelayedScaling, Float8CurrentScaling) cast every group in ONE launch
    (`quantize_tensorwise_split`: TransformerEngine's split quantize), all amaxes taken by one torch op and
    all-reduced together; the other recipes quantize group by group. The quantizers must share a recipe,
    role, usages and amax group (one per group of one module).
    """
    _check_high_precision(x)
    x2d, _ = matrix_view(x)
    splits = check_splits(m_splits, x2d.shape[0])
    if len(quantizers) != len(splits):
        raise ValueError(f"quantize_split takes one quantizer per group: {len(quantizers)} for m_splits={splits}")
    if not quantizers:
        return []
    first = quantizers[0]
    settings = (first.recipe, first.role, first.rowwise, first.columnwise, first.amax_reduction_group)
    for g, q in enumerate(quantizers):
        if (q.recipe, q.role, q.rowwise, q.columnwise, q.amax_reduction_group) != settings:
            raise ValueError(
                f"quantizer {g} differs from quantizer 0 in recipe, role, rowwise/columnwise usage or amax group: "
                "quantize_split takes the quantizers of one role of one module (quantize_storage each otherwise)"
            )
    family = _FAMILIES[type(first.recipe)]
    if family.kernel != "quantize_tensorwise":
        parts = x2d.split(splits)
        return [q.quantize_storage(part, backend=backend) for q, part in zip(quantizers, parts, strict=True)]
    kwargs = family.arguments(first.recipe, first.role) | {"rowwise": first.rowwise, "columnwise": first.columnwise}
    if first.scale is not None:
        kwargs["scales"] = torch.cat([q._scale_on(x.device) for q in quantizers])
    elif first.takes_reduced_amax:  # every shard casts with the amaxes of all of them: one all-reduce for all
        amaxes = group_amaxes(x2d, splits)
        dist.all_reduce(amaxes, op=dist.ReduceOp.MAX, group=first.amax_reduction_group)
        kwargs["amaxes"] = amaxes
    results = kernel_ops.quantize_tensorwise_split(x2d, splits, backend, **kwargs)
    if first.amax_history is not None:  # row 0 collects the max of this step's amaxes
        torch._foreach_maximum_([q.amax_history[:1] for q in quantizers], [nan_as_inf(r.amax) for r in results])
    return [from_quantized(r) for r in results]


def nan_as_inf(amax: Tensor) -> Tensor:
    """A NaN amax recorded as +inf: a MAX all-reduce keeps inf on every rank, where a NaN may be dropped on
    some; the update then refuses the non-finite step (fp8kernels.reference.delayed_scaling_update)."""
    return torch.where(amax.isnan(), math.inf, amax)


def local_amax(x: Tensor) -> Tensor:
    """max |x| as fp32 (1,) in one read of x (no full-size temporaries); NaN if any element is NaN."""
    if x.numel() == 0:
        return torch.zeros(1, device=x.device)
    # The inf-norm reduces |x| in x's dtype without materializing it; the max is one of x's values: exact.
    return torch.linalg.vector_norm(x, ord=math.inf).float().reshape(1)


def reduce_amaxes(items: Sequence[tuple[Quantizer, Tensor]]) -> list[Tensor | None]:
    """Each tensor's amax over its quantizer's group (None where it reduces none), one all-reduce per group.

    Pass each result to that quantizer's `quantize(x, amax=...)`: a GEMM's operands then cost one
    collective instead of one each.
    """
    amaxes: list[Tensor | None] = [local_amax(x) if q.takes_reduced_amax else None for q, x in items]
    # Groups matched by `is`, not keyed by id(): torch 2.11's Dynamo cannot trace id() of a process group.
    groups: list[tuple[dist.ProcessGroup, list[int]]] = []
    for i, (q, _) in enumerate(items):
        if amaxes[i] is None:
            continue
        same = [indices for group, indices in groups if group is q.amax_reduction_group]
        if same:
            same[0].append(i)
        else:
            groups.append((q.amax_reduction_group, [i]))
    for group, indices in groups:
        together = amaxes[indices[0]] if len(indices) == 1 else torch.cat([amaxes[i] for i in indices])
        dist.all_reduce(together, op=dist.ReduceOp.MAX, group=group)
        for k, i in enumerate(indices):
            amaxes[i] = together[k : k + 1]
    return amaxes

