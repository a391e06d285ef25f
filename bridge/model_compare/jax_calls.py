"""The JAX side of `bridge.compare`: a submodule of the NNX model called on torch's inputs, and its vjp.

Each call runs functionally (nnx.split, then nnx.merge inside one jitted program, differentiated
with nnx.grad of <y, dy>, whose gradient is the vjp of dy): whatever the call writes
(DelayedScaling's amax histories, the NVFP4 rounding step) lands in a throwaway copy,
so every teacher-forced call starts from the model's state as it was, as the torch call did at the
model's first step. Programs are cached by (graph, argument structure, recipe): the blocks of a
stack share one.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx

from bridge.model_compare.recorder import Call, float_leaves
from jaxside import xla_options
from jaxside.modules import fp8_autocast


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A numpy copy of a torch tensor, bit for bit (bf16 and FP8 as ml_dtypes)."""
    x = x.detach().cpu().contiguous()
    if x.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        bits = {1: torch.uint8, 2: torch.uint16}[x.element_size()]
        return x.view(bits).numpy().view(getattr(ml_dtypes, str(x.dtype).removeprefix("torch."))).copy()
    return x.numpy().copy()


def to_jax(x: torch.Tensor) -> jax.Array:
    """A JAX copy of a torch tensor, bit for bit."""
    return jnp.asarray(to_numpy(x))


def to_torch(x: jax.Array | np.ndarray) -> torch.Tensor:
    """A torch float tensor of a JAX or numpy array (bf16 and FP8 widened to fp32, exactly)."""
    array = np.asarray(x)
    if array.dtype.kind == "V" or array.dtype.type.__module__ == "ml_dtypes":
        array = array.astype(np.float32)
    return torch.from_numpy(np.array(array))


def tree_to_jax(tree: Any) -> Any:
    return torch.utils._pytree.tree_map(lambda x: to_jax(x) if isinstance(x, torch.Tensor) else x, tree)


def submodule(model: nnx.Module, name: str) -> nnx.Module | None:
    """The NNX submodule at torch's dotted path (`layers.0.mlp`), or None when the JAX model has none there."""
    node: Any = model
    for part in filter(None, name.split(".")):
        try:
            node = node[int(part)] if part.isdigit() else getattr(node, part)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return node if isinstance(node, nnx.Module) and callable(node) else None


def _floating(leaf: Any) -> bool:
    return isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jnp.floating)


@functools.lru_cache(maxsize=256)
def _program(graphdef, treedef, statics: tuple, positions: tuple[int, ...], recipe):
    """out, vjp(cotangents) of one submodule call: the float output leaves and the grads of params and diff args."""

    def run(params, rest, diff_args, arrays, cotangents):
        module = nnx.merge(graphdef, params, rest)
        leaves = list(arrays)
        for index, value in statics:
            leaves[index] = value

        def call(module, diff_args):
            args, kwargs = jax.tree.unflatten(treedef, leaves)
            args = list(args)
            for position, value in zip(positions, diff_args):
                args[position] = value
            region = fp8_autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext()
            with region:
                out = module(*args, **kwargs)
            return [leaf for leaf in jax.tree.leaves(out) if _floating(leaf)]

        if cotangents is None:
            return call(module, diff_args), None, None

        def pulled(module, diff_args):  # <y, dy>: its gradient is the vjp of dy, exactly
            outputs = call(module, diff_args)
            return sum(jnp.sum(o * c.astype(o.dtype), dtype=jnp.float32) for o, c in zip(outputs, cotangents)), outputs

        grad = nnx.grad(pulled, argnums=(nnx.DiffState(0, nnx.Param), 1), has_aux=True)
        (param_grads, arg_grads), outputs = grad(module, diff_args)
        return outputs, param_grads, arg_grads

    return xla_options.jit(run)


def run_call(module: nnx.Module, args: tuple, kwargs: dict, positions: tuple[int, ...], recipe, cotangents):
    """(outputs, {param path: numpy grad}, {position: grad}) of `module(*args, **kwargs)` (torch values),
    differentiating the params and the positional args at `positions` against `cotangents` (torch tensors;
    None: forward only)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    placeholder = tuple(None if i in positions else a for i, a in enumerate(args))
    leaves, treedef = jax.tree.flatten((tree_to_jax(placeholder), tree_to_jax(kwargs)))
    statics = tuple((i, leaf) for i, leaf in enumerate(leaves) if not isinstance(leaf, jax.Array))
    arrays = [leaf if isinstance(leaf, jax.Array) else None for leaf in leaves]
    diff_args = [to_jax(args[i]) for i in positions]
    jax_cotangents = None if cotangents is None else [to_jax(c) for c in cotangents]
    program = _program(graphdef, treedef, statics, positions, recipe)
    outputs, param_grads, arg_grads = program(params, rest, diff_args, arrays, jax_cotangents)
    outputs = [to_torch(o) for o in outputs]
    if cotangents is None:
        return outputs, {}, {}
    flat = {tuple(path): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(param_grads)}
    return outputs, flat, {p: to_torch(g) for p, g in zip(positions, arg_grads)}


def run_recorded(call: Call, module: nnx.Module, recipe, backward: bool):
    """`run_call` of a recorded torch call: its inputs, and with backward its output gradients as cotangents."""
    outputs = float_leaves(call.output)
    wants_grads = backward and bool(call.output_grads)
    cotangents = [call.output_grads.get(i, torch.zeros_like(o)) for i, o in enumerate(outputs)] if wants_grads else None
    positions = call.grad_positions if wants_grads else ()
    return run_call(module, call.args, call.kwargs, positions, recipe, cotangents)


__all__ = ["run_call", "run_recorded", "submodule", "to_jax", "to_numpy", "to_torch", "tree_to_jax"]
