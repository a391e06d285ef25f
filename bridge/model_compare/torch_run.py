"""One torch forward (and backward of sum(y * dy)) of the user's model, recorded (bridge.model_compare.recorder).

The model's own gradients are put back afterwards: compare leaves `.grad` as it found it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from bridge.model_compare.recorder import Call, float_leaves, recording

DY_SEED = 0  # the seed of the output gradient dy, the same on both sides


@dataclass
class TorchRun:
    """What one torch run left: every recorded call (the model's own is named ""), dy, and the weight grads."""

    calls: list[Call]
    dy: list[torch.Tensor]
    grads: dict[str, torch.Tensor]

    @property
    def root(self) -> Call:
        return next(call for call in self.calls if call.name == "")


def seeded_dy(outputs: list[torch.Tensor]) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(DY_SEED)
    return [torch.randn(o.shape, generator=generator).to(device=o.device, dtype=o.dtype) for o in outputs]


def run_torch(model: nn.Module, inputs: tuple[torch.Tensor, ...], recipe, names: set[str], backward: bool) -> TorchRun:
    """Run `model(*inputs)` under `recipe` (a torchside recipe or None), recording the calls of `names`."""
    saved = {name: p.grad for name, p in model.named_parameters()}
    xs = tuple(
        x.detach().clone().requires_grad_(backward and x.is_floating_point()) for x in inputs
    )  # the caller's tensors stay untouched
    try:
        for p in model.parameters():
            p.grad = None
        region = contextlib.nullcontext()
        if recipe is not None:
            import torchside

            region = torchside.fp8_autocast(enabled=True, fp8_recipe=recipe)
        with torch.enable_grad(), recording(model, names | {""}) as calls:
            with region:
                output = model(*xs)
        outputs = float_leaves(output)
        dy = seeded_dy(outputs)
        if backward:
            pairs = [(o, g) for o, g in zip(outputs, dy) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
            # The model's own cotangents are dy, not what reached each output tensor: an output that also feeds
            # another (a block's output returned beside the final one) or is returned twice got more.
            root = next(call for call in calls if call.name == "")
            root.output_grads = {i: g for i, (o, g) in enumerate(zip(outputs, dy)) if o.requires_grad}
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        return TorchRun(list(calls), dy, grads)
    finally:
        for name, p in model.named_parameters():
            p.grad = saved[name]


__all__ = ["TorchRun", "run_torch", "seeded_dy"]
