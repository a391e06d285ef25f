"""The mapping between a torchside model's parameters and its jaxside twin's, both directions.

The jaxside modules mirror torch's attribute paths, so one table of rules (`RULES`) maps every
parameter by its name and rank; the first rule whose pattern matches the torch name wins:

    torch (name, ndim)                     JAX name                  layout
    `...<stem>weight<g>`, 2-D              `...<stem>kernel<g>`      transpose: [out, in] <-> Flax [in, out]
    anything else (biases, norm params)    the same name             same

(`fc1_weight` -> `fc1_kernel`, GroupedLinear's `weight3` -> `kernel3`, a fused QKV `weight`
[(N + 2G) H, D] -> `kernel` [D, (N + 2G) H]: both twins order the fused rows by key/value head
(torchside.modules.multihead_attention), GQA included, so the transpose is the whole mapping and
TP's contiguous split gives both the same heads.) A layout is a pair of JAX functions applied to global
`jax.Array`s under jit: XLA moves whatever must move between devices, no process ever holds a
full tensor, and the result is placed where the JAX model keeps that parameter.

Optimizer states follow their parameter: FusedAdam's `exp_avg`, `exp_avg_sq` and `master_param`
map through the parameter's rule onto `jaxside.optim.FusedAdamState`'s trees of the same names.
FP8 parameters (torchside QuantizedTensor shards) cross as their bytes and `scale_inv`
(`bridge.transfer.quantized_to_jax`) and become the high-precision values the JAX twin keeps;
back in torch the values are cast again by the torch module (`quantize_weight_`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from bridge import layout, transfer

if TYPE_CHECKING:
    import jax
    from flax import nnx
    from jax.sharding import Mesh, NamedSharding
    from torch import nn
    from torch.distributed.tensor import DTensor


@dataclass(frozen=True)
class Layout:
    """How a torch tensor's dims become the JAX parameter's: a function each way, on global jax.Arrays."""

    name: str
    to_jax: Callable[[jax.Array], jax.Array]
    to_torch: Callable[[jax.Array], jax.Array]
    transposes: bool  # whether the two dims swap (what bridge.layout's `transposed` predicts for the shard map)


def _identity(x):
    return x


def _transpose(x):
    return x.T


SAME = Layout("same", _identity, _identity, transposes=False)
TRANSPOSE = Layout("transpose", _transpose, _transpose, transposes=True)


@dataclass(frozen=True)
class Rule:
    """torch names matching `pattern` (with `ndim` dims, any when None) become `jax_name` (a re.sub template)."""

    pattern: str
    ndim: int | None
    jax_name: str
    layout: Layout

    def jax_name_for(self, torch_name: str, ndim: int) -> str | None:
        """The JAX name this rule gives `torch_name`, or None when the rule does not apply."""
        if self.ndim is not None and ndim != self.ndim:
            return None
        match = re.fullmatch(self.pattern, torch_name)
        return None if match is None else match.expand(self.jax_name)


RULES: tuple[Rule, ...] = (
    Rule(r"(?P<path>(?:.*\.)?[a-z0-9_]*?)weight(?P<group>\d*)", 2, r"\g<path>kernel\g<group>", TRANSPOSE),
    Rule(r".*", None, r"\g<0>", SAME),
)


@dataclass(frozen=True)
class ParamPair:
    """One parameter on both sides: torch name, JAX path (as nnx reports it) and the layout between them."""

    torch_name: str
    jax_path: tuple[Any, ...]
    layout: Layout

    @property
    def jax_name(self) -> str:
        return dotted(self.jax_path)


def dotted(path: Iterable[Any]) -> str:
    """An nnx state path as a dotted name, as torch names its parameters (`layers.0.mlp.fc1_kernel`)."""
    return ".".join(str(part) for part in path)


def same_layout(param: DTensor, pair: ParamPair, jax_sharding: NamedSharding, mesh: Mesh) -> bool:
    """Does JAX keep on each device what torch keeps there of this parameter (the kernel transposed)?"""
    shape = tuple(param.shape)
    torch_side = layout.from_named_sharding(
        transfer.equivalent_sharding(param.device_mesh, param.placements, shape, mesh), shape
    )
    if pair.layout.transposes:
        torch_side, shape = torch_side.transposed(), shape[::-1]
    return layout.compare(torch_side, layout.from_named_sharding(jax_sharding, shape)).equal


def jax_parameters(model: nnx.Module) -> dict[tuple[Any, ...], Any]:
    """Every nnx.Param of a JAX model by path (the values: arrays or ShapeDtypeStructs)."""
    from flax import nnx

    return {tuple(path): variable.get_value() for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def pair_parameters(
    torch_shapes: Mapping[str, tuple[int, ...]],
    jax_shapes: Mapping[tuple[Any, ...], tuple[int, ...]],
    rules: Iterable[Rule] = RULES,
) -> list[ParamPair]:
    """Pair every torch parameter with its JAX twin by the rules, checking shapes; ValueError naming any misfit."""
    rules = tuple(rules)
    jax_by_name = {dotted(path): path for path in jax_shapes}
    pairs, problems = [], []
    for torch_name, shape in torch_shapes.items():
        rule, jax_name = next(
            ((r, n) for r in rules if (n := r.jax_name_for(torch_name, len(shape))) is not None), (None, None)
        )
        if rule is None:
            problems.append(f"no rule maps torch {torch_name!r} ({len(shape)}-D)")
            continue
        if jax_name not in jax_by_name:
            problems.append(f"torch {torch_name!r} maps to {jax_name!r}, which the JAX model lacks")
            continue
        path = jax_by_name.pop(jax_name)
        expected = tuple(reversed(shape)) if rule.layout.transposes else tuple(shape)
        if tuple(jax_shapes[path]) != expected:
            problems.append(
                f"torch {torch_name!r} {list(shape)} ({rule.layout.name}) should be {list(expected)} in JAX, "
                f"but {jax_name!r} is {list(jax_shapes[path])}"
            )
            continue
        pairs.append(ParamPair(torch_name, path, rule.layout))
    problems += [f"JAX {name!r} has no torch parameter" for name in jax_by_name]
    if problems:
        raise ValueError("the torch and JAX models do not pair up: " + "; ".join(problems))
    return pairs


def pair_models(torch_model: nn.Module, jax_model: nnx.Module, rules: Iterable[Rule] = RULES) -> list[ParamPair]:
    """`pair_parameters` of two live models."""
    torch_shapes = {name: tuple(p.shape) for name, p in torch_model.named_parameters()}
    jax_shapes = {path: tuple(v.shape) for path, v in jax_parameters(jax_model).items()}
    return pair_parameters(torch_shapes, jax_shapes, rules)


def _relayout(functions: tuple, values: tuple, shardings: tuple) -> tuple:
    """Each functions[i](values[i]) placed on shardings[i]: new buffers (never aliases of torch's storage).

    One jitted program for all values: compiled once per set of shapes and layouts, not per tensor.
    """
    return _relayout_program(functions, shardings)(*values)


@functools.lru_cache(maxsize=64)
def _relayout_program(functions: tuple, shardings: tuple):
    import jax
    import jax.numpy as jnp

    def apply(*values):
        return tuple(jnp.copy(function(value)) for function, value in zip(functions, values))

    return jax.jit(apply, out_shardings=shardings)


def torch_values_to_jax(
    tensors: Mapping[str, Any], pairs: Iterable[ParamPair], mesh: Mesh, shardings: Mapping[tuple, NamedSharding]
) -> dict[tuple[Any, ...], jax.Array]:
    """JAX values of torch tensors (DTensors, by torch name): zero-copy transfer, then each pair's layout.

    `shardings` (by JAX path) is where the JAX model keeps each parameter (jaxside.modules.shardings).
    FP8 shards are dequantized in JAX to the dtype the torch parameter stands for.
    """
    pairs = list(pairs)
    values = []
    for pair in pairs:
        tensor = tensors[pair.torch_name]
        if hasattr(tensor._local_tensor, "quantized_storage"):
            arrays = transfer.quantized_to_jax(tensor, mesh, as_bytes=True)
            values.append(_dequantize(arrays, tuple(tensor.shape), tensor.dtype))
        else:
            values.append(transfer.to_jax(tensor, mesh))
    functions = tuple(pair.layout.to_jax for pair in pairs)
    placed = _relayout(functions, tuple(values), tuple(shardings[pair.jax_path] for pair in pairs))
    return {pair.jax_path: value for pair, value in zip(pairs, placed)}


def _dequantize(arrays: transfer.QuantizedArrays, shape: tuple[int, int], torch_dtype) -> jax.Array:
    import jax
    import jax.numpy as jnp

    from jaxside.quantize import Quantized, dequantize

    dtype = jnp.dtype(str(torch_dtype).removeprefix("torch."))
    q = Quantized(arrays.scheme, arrays.fmt, shape, arrays.data, arrays.scale_inv, None, None, arrays.amax)
    return jax.jit(lambda q: dequantize(q, dtype))(q)


def jax_values_to_torch(
    values: Mapping[tuple[Any, ...], jax.Array], pairs: Iterable[ParamPair], like: Mapping[str, Any]
) -> dict[str, Any]:
    """torch DTensors (by torch name) of JAX values, laid out like the DTensors in `like`, aliasing JAX's buffers."""
    pairs = list(pairs)
    shardings = []
    for pair in pairs:
        reference, mesh = like[pair.torch_name], values[pair.jax_path].sharding.mesh
        shape = tuple(reference.shape)
        shardings.append(transfer.equivalent_sharding(reference.device_mesh, reference.placements, shape, mesh))
    functions = tuple(pair.layout.to_torch for pair in pairs)
    placed = _relayout(functions, tuple(values[pair.jax_path] for pair in pairs), tuple(shardings))
    return {
        pair.torch_name: transfer.to_torch(value, like[pair.torch_name].device_mesh, like[pair.torch_name].placements)
        for pair, value in zip(pairs, placed)
    }


def load_into_jax(model: nnx.Module, values: Mapping[tuple[Any, ...], jax.Array]) -> None:
    """Set the JAX model's parameters (by path) to these values."""
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    for path, value in values.items():
        flat[path].set_value(value)
    nnx.update(model, nnx.from_flat_state(flat))


def load_into_torch(model: nn.Module, tensors: Mapping[str, Any]) -> None:
    """Copy DTensor values (by torch name) into the torch model's shards; FP8 weights are cast by their module."""
    import torch

    with torch.no_grad():
        for name, value in tensors.items():
            param = model.get_parameter(name)
            source = value._local_tensor.to(param.device)
            if hasattr(param._local_tensor, "quantized_storage"):
                owner, attribute = name.rsplit(".", 1)
                model.get_submodule(owner).quantize_weight_(attribute, source)
            else:
                param._local_tensor.copy_(source.to(param.dtype))


OPTIMIZER_STATES = ("exp_avg", "exp_avg_sq", "master_param")  # FusedAdam's keys = FusedAdamState's fields


def optimizer_states_to_jax(
    optimizer, model: nn.Module, pairs: Iterable[ParamPair], mesh: Mesh, shardings: Mapping[tuple, NamedSharding]
) -> dict[str, dict[tuple[Any, ...], jax.Array]]:
    """FusedAdam's fp32 states as JAX trees: {state name: {JAX path: array}} (absent states are left out)."""
    pairs = list(pairs)
    states: dict[str, dict] = {}
    params = dict(model.named_parameters())
    for key in OPTIMIZER_STATES:
        tensors = {p.torch_name: optimizer.state[params[p.torch_name]].get(key) for p in pairs}
        present = [p for p in pairs if tensors[p.torch_name] is not None]
        if present:
            states[key] = torch_values_to_jax(tensors, present, mesh, shardings)
    return states


__all__ = [
    "OPTIMIZER_STATES",
    "RULES",
    "SAME",
    "TRANSPOSE",
    "Layout",
    "ParamPair",
    "Rule",
    "dotted",
    "jax_parameters",
    "jax_values_to_torch",
    "load_into_jax",
    "load_into_torch",
    "optimizer_states_to_jax",
    "pair_models",
    "pair_parameters",
    "same_layout",
    "torch_values_to_jax",
]
