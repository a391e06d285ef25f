"""FP8 regions (`fp8_autocast`) and FP8 parameter creation (`quantized_model_init`, or TransformerEngine's
older name `fp8_model_init`).

`fp8_autocast(enabled, recipe, amax_reduction_group)` (TransformerEngine's `fp8_recipe=` and
`fp8_group=` work too): the modules called inside run their GEMMs in FP8 under `recipe`. Regions
nest; the innermost one decides, and a `None` recipe or group inherits the enclosing region's
(`DelayedScaling()` at the top, as in TransformerEngine).

DelayedScaling keeps state between steps; its bookkeeping happens here, once per region:

- forward: the quantizers of every module write this step's amaxes into row 0 of the module's
  amax history; at the exit of the OUTERMOST region, the row 0s of all modules (per recipe and
  group) are concatenated, all-reduced with MAX once over the group, and every module's scales
  are updated and its histories rolled;
- backward: the same for the grad-output amaxes, once, at the end of the backward of the first
  FP8 module of the forward (in a sequential model, the last backward to run).

The amax group is explicit: `None` reduces nothing (docs/design.md: groups are never guessed from a
mesh). State is per thread, because the ranks of the threaded process group are threads.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fp8kernels.reference import delayed_scaling_update
from torchside.recipe import RECIPE_CLASSES, DelayedScaling, Recipe

_THREAD_STATE = threading.local()  # .autocast and .model_init: stacks of frames, made on first use


def _stack(name: str) -> list:
    stack = getattr(_THREAD_STATE, name, None)
    if stack is None:
        stack = []
        setattr(_THREAD_STATE, name, stack)
    return stack


class DelayedScalingSync:
    """The delayed-scaling states that one region updates together: one all-reduce, then the updates."""

    def __init__(self, recipe: DelayedScaling, group: dist.ProcessGroup | None) -> None:
        self.recipe = recipe
        self.group = group
        self._states: dict[int, tuple[Tensor, Tensor, float]] = {}  # id(owner) -> (history, scale, fmax)

    def add(self, owner: nn.Module, amax_history: Tensor, scale: Tensor, fmax: float) -> bool:
        """Include `owner`'s state ([len, slots] history, [slots] scale); True if it is the first one."""
        first = not self._states
        self._states.setdefault(id(owner), (amax_history, scale, fmax))
        return first

    def reduce_and_update(self) -> None:
        """All-reduce (MAX) every row 0 at once, then set every scale and roll every history; once per region.

        The histories are stacked side by side ([len, all slots]) and updated by one call: the update
        treats each slot (column) alone, so the values are those of one update per module, in a
        handful of ops instead of a dozen per module.
        """
        states = list(self._states.values())
        self._states.clear()
        if not states:
            return
        (fmax,) = {fmax for _, _, fmax in states}  # a sync serves one direction: one element format
        history = torch.cat([history for history, _, _ in states], dim=1)
        scale = torch.cat([scale for _, scale, _ in states])
        if self.recipe.reduce_amax and self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(history[0], op=dist.ReduceOp.MAX, group=self.group)  # row 0 is contiguous
        new_history, new_scale = delayed_scaling_update(
            history, scale, fmax, margin=self.recipe.margin, algo=self.recipe.amax_compute_algo
        )
        slots = [scale.numel() for _, scale, _ in states]
        targets = [t for history, scale, _ in states for t in (history, scale)]
        sources = [t for pair in zip(new_history.split(slots, dim=1), new_scale.split(slots)) for t in pair]
        torch._foreach_copy_(targets, sources)


@dataclass
class _Region:
    """What one outermost fp8_autocast collects: a forward and a backward sync per (recipe, group)."""

    forward: dict[tuple, DelayedScalingSync] = field(default_factory=dict)
    backward: dict[tuple, DelayedScalingSync] = field(default_factory=dict)

    def syncs(self, recipe: DelayedScaling, group: dist.ProcessGroup | None) -> tuple[DelayedScalingSync, ...]:
        key = (recipe, None if group is None else id(group))  # (torch 2.11's Dynamo cannot trace id(None))
        forward = self.forward.setdefault(key, DelayedScalingSync(recipe, group))
        backward = self.backward.setdefault(key, DelayedScalingSync(recipe, group))
        return forward, backward


@dataclass(frozen=True)
class FP8Frame:
    """The FP8 settings a module sees in its forward."""

    enabled: bool
    recipe: Recipe
    amax_reduction_group: dist.ProcessGroup | None
    region: _Region


def _check_recipe(owner: str, recipe: object) -> None:
    if recipe is not None and not isinstance(recipe, RECIPE_CLASSES):
        names = ", ".join(cls.__name__ for cls in RECIPE_CLASSES)
        raise TypeError(f"{owner}(recipe={recipe!r}): pass None or one of {names} (torchside.recipe)")


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): pass True or False")


def _one_spelling(owner: str, name: str, value: object, te_name: str, te_value: object) -> object:
    """The value given under our name or TransformerEngine's; TypeError if both are given."""
    if value is not None and te_value is not None:
        raise TypeError(f"{owner}: pass {name}= or {te_name}= (TransformerEngine's spelling), not both")
    return te_value if value is None else value


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    recipe: Recipe | None = None,
    amax_reduction_group: dist.ProcessGroup | None = None,
    *,
    fp8_recipe: Recipe | None = None,
    fp8_group: dist.ProcessGroup | None = None,
) -> Iterator[None]:
    """Run the GEMMs of the modules called inside in FP8 under `recipe` (see the module docstring).

    `fp8_recipe=` and `fp8_group=` are TransformerEngine's keywords for `recipe` and `amax_reduction_group`.
    """
    recipe = _one_spelling("fp8_autocast", "recipe", recipe, "fp8_recipe", fp8_recipe)
    amax_reduction_group = _one_spelling(
        "fp8_autocast", "amax_reduction_group", amax_reduction_group, "fp8_group", fp8_group
    )
    _check_bool("fp8_autocast", "enabled", enabled)
    _check_recipe("fp8_autocast", recipe)
    if amax_reduction_group is not None and not isinstance(amax_reduction_group, dist.ProcessGroup):
        raise TypeError(f"fp8_autocast(amax_reduction_group={amax_reduction_group!r}): pass a ProcessGroup or None")
    frames = _stack("autocast")
    parent = frames[-1] if frames else None
    if recipe is None:
        recipe = parent.recipe if parent else DelayedScaling()
    if amax_reduction_group is None and parent is not None:
        amax_reduction_group = parent.amax_reduction_group
    frame = FP8Frame(enabled, recipe, amax_reduction_group, region=parent.region if parent else _Region())
    frames.append(frame)
    try:
        yield
    finally:
        frames.pop()
    # Reached on a normal exit only: after an exception no rank should enter a collective.
    if not frames:
        for sync in frame.region.forward.values():
            sync.reduce_and_update()


def fp8_frame() -> FP8Frame | None:
    """The innermost enabled fp8_autocast frame of this thread, or None when FP8 is off."""
    frames = _stack("autocast")
    return frames[-1] if frames and frames[-1].enabled else None


@dataclass(frozen=True)
class ModelInit:
    """What quantized_model_init asks of the modules built inside it."""

    recipe: Recipe
    preserve_high_precision_init_val: bool


def quantized_model_init(
    enabled: bool = True, recipe: Recipe | None = None, preserve_high_precision_init_val: bool = False
) -> contextlib.AbstractContextManager[None]:
    """Create the GEMM weights of modules built inside as FP8 QuantizedTensor parameters (no high-precision copy).

    `preserve_high_precision_init_val=True` keeps a CPU copy of each initial value
    (`torchside.modules.high_precision_init_val(param)`). A None recipe inherits the enclosing one.
    """
    return _model_init_region("quantized_model_init", enabled, recipe, preserve_high_precision_init_val)


def fp8_model_init(
    enabled: bool = True, recipe: Recipe | None = None, preserve_high_precision_init_val: bool = False
) -> contextlib.AbstractContextManager[None]:
    """TransformerEngine's older name of `quantized_model_init`: the same arguments, the same region."""
    return _model_init_region("fp8_model_init", enabled, recipe, preserve_high_precision_init_val)


@contextlib.contextmanager
def _model_init_region(
    owner: str, enabled: bool, recipe: Recipe | None, preserve_high_precision_init_val: bool
) -> Iterator[None]:
    _check_bool(owner, "enabled", enabled)
    _check_recipe(owner, recipe)
    _check_bool(owner, "preserve_high_precision_init_val", preserve_high_precision_init_val)
    frames = _stack("model_init")
    parent = next((f for f in reversed(frames) if f is not None), None)
    if recipe is None:
        recipe = parent.recipe if parent else DelayedScaling()
    frames.append(ModelInit(recipe, preserve_high_precision_init_val) if enabled else None)
    try:
        yield
    finally:
        frames.pop()


def model_init() -> ModelInit | None:
    """The innermost quantized_model_init of this thread, or None when weights are made in high precision."""
    frames = _stack("model_init")
    return frames[-1] if frames else None


__all__ = [
    "DelayedScalingSync",
    "FP8Frame",
    "ModelInit",
    "fp8_autocast",
    "fp8_frame",
    "fp8_model_init",
    "model_init",
    "quantized_model_init",
]
