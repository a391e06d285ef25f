"""The torch side of `bridge.compare`: one forward and backward, recording what every submodule call saw.

For each call of each submodule (forward pre-hooks and hooks) it keeps the inputs as they came in,
the output, and the reductions torch ran inside it (a TorchDispatchMode: GEMMs, norms, softmax;
what bridge.numerics.chain_bound needs). The backward of `sum(y * dy)` then leaves, per call, the
gradient that reached its output and the gradient its own computation sends to each input: the
pre-hook hands the module a clone of each input that needs a gradient, so a gradient hook on the
clone sees this call's contribution only (the parent's residual path goes to the original).
Every hook is removed afterwards, also on error.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from bridge.numerics import BF16_U, FP16_U, FP32_U, Reduction

UNITS = {torch.float32: FP32_U, torch.bfloat16: BF16_U, torch.float16: FP16_U}


@dataclass
class Call:
    """One call of a submodule: its inputs and output (detached) and, after the backward, their gradients."""

    name: str
    args: tuple
    kwargs: dict
    output: Any
    reductions: list[Reduction] = field(default_factory=list)
    grad_positions: tuple[int, ...] = ()  # the positional args whose gradient this call's backward gives
    input_grads: dict[int, torch.Tensor] = field(default_factory=dict)
    output_grads: dict[int, torch.Tensor] = field(default_factory=dict)  # by index of the float output leaves


def float_leaves(tree: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a (nested) output, in pytree order."""
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return [leaf for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.is_floating_point()]


def output_unit(output: Any) -> float:
    """The largest unit roundoff among an output's floating-point dtypes (fp32 when it has none)."""
    return max((UNITS.get(leaf.dtype, FP32_U) for leaf in float_leaves(output)), default=FP32_U)


def _detached(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda x: x.detach() if isinstance(x, torch.Tensor) else x, tree)


def _numel(shape) -> int:
    return math.prod(shape)


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Reduction:
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    return Reduction("gemm", k, (n, m), out.numel(), a.numel(), UNITS.get(out.dtype, FP32_U))


def _sum(length: int, out: torch.Tensor) -> Reduction:
    return Reduction("sum", length, (length,), out.numel(), 0, UNITS.get(out.dtype, FP32_U))


def _reduced_length(x: torch.Tensor, dims) -> int:
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return x.numel()
    dims = [dims] if isinstance(dims, int) else dims
    return _numel(x.shape[d] for d in dims)


# reductions over dims given by an argument: aten op -> the index of that argument
DIM_ARGUMENT = {"sum": 1, "mean": 1, "var": 1, "var_mean": 1, "std": 1, "logsumexp": 1, "linalg_vector_norm": 2}


def reductions_of(func, args: tuple, kwargs: dict, out: Any) -> list[Reduction]:
    """The sums an aten op runs (none for elementwise and data-movement ops)."""
    name = func.__name__.split(".")[0]
    first = out[0] if isinstance(out, (tuple, list)) else out
    if name in ("mm", "bmm"):
        return [_gemm(args[0], args[1], first)]
    if name in ("addmm", "baddbmm"):
        return [_gemm(args[1], args[2], first)]
    if name in ("native_layer_norm", "native_layer_norm_backward"):
        return [_sum(_numel(args[1]), first)]
    if name in ("_softmax", "_log_softmax"):
        return [_sum(args[0].shape[args[1]], first)]
    if name in DIM_ARGUMENT and isinstance(args[0], torch.Tensor):
        index = DIM_ARGUMENT[name]
        dims = args[index] if len(args) > index else kwargs.get("dim")
        return [_sum(_reduced_length(args[0], dims), first)]
    if name == "_fused_rms_norm":
        return [_sum(_numel(args[1]), first)]
    if name.startswith("_scaled_dot_product") and name.endswith(("attention", "cpu")):
        q, k, v = args[:3]
        scores = q.shape[:-1] + k.shape[-2:-1]
        return [
            Reduction("gemm", q.shape[-1], (k.shape[-2], q.shape[-2]), _numel(scores), q.numel(), FP32_U),
            _sum(k.shape[-2], first),
            Reduction("gemm", k.shape[-2], (v.shape[-1], q.shape[-2]), first.numel(), _numel(scores), FP32_U),
        ]
    return []


class _ReductionRecorder(TorchDispatchMode):
    """Appends each op's sums to every submodule call running now (the innermost and its parents)."""

    def __init__(self, stack: list[Call]) -> None:
        super().__init__()
        self.stack = stack

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.stack:
            found = reductions_of(func, args, kwargs or {}, out)
            for call in self.stack:
                call.reductions.extend(found)
        return out


@contextlib.contextmanager
def recording(model: nn.Module, names: set[str]) -> Iterator[list[Call]]:
    """Record every call of the submodules named in `names` ("" is the model) while the block runs."""
    calls: list[Call] = []  # in the order the calls finished: children before their parents
    stack: list[Call] = []
    handles = []

    def pre_hook(name: str):
        def hook(module, args, kwargs):
            call = Call(name, _detached(args), _detached(kwargs), None)
            positions = tuple(i for i, a in enumerate(args) if _differentiable(a))
            call.grad_positions = positions
            args = list(args)
            for i in positions:
                args[i] = args[i].clone()
                args[i].register_hook(_store(call.input_grads, i))
            stack.append(call)
            return tuple(args), kwargs

        return hook

    def post_hook(name: str):
        def hook(module, args, kwargs, output):
            call = stack.pop()
            call.output = _detached(output)
            for index, leaf in enumerate(float_leaves(output)):
                if leaf.requires_grad:
                    leaf.register_hook(_store(call.output_grads, index))
            calls.append(call)

        return hook

    try:
        for name, module in model.named_modules():
            if name in names:
                handles.append(module.register_forward_pre_hook(pre_hook(name), with_kwargs=True))
                handles.append(module.register_forward_hook(post_hook(name), with_kwargs=True))
        with _ReductionRecorder(stack):
            yield calls
    finally:
        for handle in handles:
            handle.remove()


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad


def _store(into: dict, key: int):
    def hook(grad):
        into[key] = grad.detach()

    return hook


__all__ = ["Call", "float_leaves", "output_unit", "recording", "reductions_of"]
