"""FP8 regions for the JAX modules: `fp8_autocast`, the twin of torchside.autocast.fp8_autocast.

Modules called inside `with fp8_autocast(recipe=...)` run their GEMMs in FP8; open the region inside
the function JAX traces (the loss function given to nnx.grad). Regions nest, the innermost decides,
and a None recipe inherits the enclosing region's (DelayedScaling() at the top), as in torchside.

DelayedScaling keeps state between steps; as in torchside, its bookkeeping happens once per region:

- forward: each module writes this step's amaxes into row 0 of its forward history (the max with
  what is there); at the exit of the OUTERMOST region every module called inside sets its scales
  and rolls its history;
- backward: a backward cannot write state, so the grad amaxes leave it as the gradients of each
  module's `fp8_grad_amax`; `finish_backward(model, grads, recipe)` (jaxside.modules.base) then
  writes them into the backward histories and updates, once per step.

No all-reduce is needed: under jit an amax is that of the whole logical array, however it is
sharded, which is torchside's result with an amax group spanning every rank holding a piece of it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from twinspec.recipe import RECIPE_CLASSES, DelayedScaling, Recipe

_THREAD_STATE = threading.local()  # .frames: the stack of open regions, made on first use


def _frames() -> list:
    if not hasattr(_THREAD_STATE, "frames"):
        _THREAD_STATE.frames = []
    return _THREAD_STATE.frames


@dataclass
class Region:
    """What one outermost fp8_autocast collects: the modules that ran under DelayedScaling, with their recipe."""

    delayed: list[tuple[object, DelayedScaling]] = field(default_factory=list)

    def enlist(self, module: object, recipe: DelayedScaling) -> None:
        """Record a DelayedScaling module's call; a second call of one module in a region is refused."""
        if any(seen is module for seen, _ in self.delayed):
            raise ValueError(
                f"{type(module).__name__} ran twice in one fp8_autocast region under DelayedScaling: JAX would add "
                "its two grad amaxes where torchside takes their max; call it once per region or use two modules"
            )
        self.delayed.append((module, recipe))


@dataclass(frozen=True)
class FP8Frame:
    """The FP8 settings a module sees when it is called."""

    enabled: bool
    recipe: Recipe
    region: Region


@contextlib.contextmanager
def fp8_autocast(enabled: bool = True, recipe: Recipe | None = None) -> Iterator[None]:
    """Run the GEMMs of the modules called inside in FP8 under `recipe` (see the module docstring)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"fp8_autocast(enabled={enabled!r}): pass True or False")
    if recipe is not None and not isinstance(recipe, RECIPE_CLASSES):
        names = ", ".join(cls.__name__ for cls in RECIPE_CLASSES)
        raise TypeError(f"fp8_autocast(recipe={recipe!r}): pass None or one of {names} (twinspec.recipe)")
    frames = _frames()
    parent = frames[-1] if frames else None
    if recipe is None:
        recipe = parent.recipe if parent else DelayedScaling()
    frame = FP8Frame(enabled, recipe, region=parent.region if parent else Region())
    frames.append(frame)
    try:
        yield
    finally:
        frames.pop()
    if not frames:  # reached on a normal exit of the outermost region only
        for module, delayed_recipe in frame.region.delayed:
            module.update_forward_scaling(delayed_recipe)


def fp8_frame() -> FP8Frame | None:
    """The innermost enabled fp8_autocast frame of this thread, or None when FP8 is off."""
    frames = _frames()
    return frames[-1] if frames and frames[-1].enabled else None
