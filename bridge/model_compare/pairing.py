"""`params=` of `bridge.compare`: which torch parameter is which NNX parameter, and in what layout.

"auto" tries, for each torch parameter, the usual torch -> Flax names in order and takes the first
the JAX model has (module paths are the same on both sides: `ModuleList` index = `nnx.List` index):

    torch                       NNX                                       layout
    `<stem>weight<g>` 2-D       `<stem>kernel<g>` (bridge.params.RULES)   transpose: [out, in] -> [in, out]
    `weight` 3-D..5-D (conv)    `kernel`                                  [out, in, *k] -> [*k, in, out]
    `weight` 2-D (embedding)    `embedding`                               same
    `weight` 1-D (norm)         `scale`                                   same
    anything else               the same name                             same

A dict {torch name: NNX dotted path} overrides "auto" for the names it holds, and takes the layout
from the shapes (equal: same; reversed 2-D: transpose); a list of bridge.params.Rule is
bridge.params.pair_parameters' first-match table.
Every misfit is reported at once, with the names on the other side that come closest.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from bridge.params import RULES, SAME, TRANSPOSE, Layout, ParamPair, Rule, dotted, jax_parameters, pair_parameters


def _conv_to_jax(x):
    return x.transpose(tuple(range(2, x.ndim)) + (1, 0))


def _conv_to_torch(x):
    return x.transpose((x.ndim - 1, x.ndim - 2) + tuple(range(x.ndim - 2)))


CONV = Layout("conv", _conv_to_jax, _conv_to_torch, transposes=False)

AUTO_RULES: tuple[Rule, ...] = (
    RULES[0],
    *(Rule(r"(?P<path>(?:.*\.)?)weight", ndim, r"\g<path>kernel", CONV) for ndim in (3, 4, 5)),
    Rule(r"(?P<path>(?:.*\.)?)weight", 2, r"\g<path>embedding", SAME),
    Rule(r"(?P<path>(?:.*\.)?)weight", 1, r"\g<path>scale", SAME),
    Rule(r".*", None, r"\g<0>", SAME),
)


def jax_shape(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a torch tensor of `shape` has in JAX after `layout`."""
    if layout is TRANSPOSE:
        return shape[::-1]
    if layout is CONV:
        return shape[2:] + (shape[1], shape[0])
    return shape


def _closest(name: str, names: Iterable[str]) -> str:
    found = difflib.get_close_matches(name, list(names), n=3, cutoff=0.3)
    return f" (closest: {', '.join(found)})" if found else ""


def _pair_by_choice(torch_shapes, jax_shapes, choose) -> list[ParamPair]:
    """Pairs by choose(torch name, shape, JAX names left) -> (JAX name, layout) | None; ValueError listing misfits."""
    jax_by_name = {dotted(path): path for path in jax_shapes}
    every_jax_name = list(jax_by_name)
    pairs, problems = [], []
    for torch_name, shape in torch_shapes.items():
        choice = choose(torch_name, shape, jax_by_name)
        if choice is None:
            closest = _closest(torch_name, every_jax_name)
            problems.append(f"torch {torch_name!r} {list(shape)} has no JAX counterpart{closest}")
            continue
        jax_name, layout = choice
        path = jax_by_name.pop(jax_name)
        expected, found = jax_shape(layout, tuple(shape)), tuple(jax_shapes[path])
        if found != expected:
            problems.append(
                f"torch {torch_name!r} {list(shape)} ({layout.name}) should be {list(expected)} in JAX, "
                f"but {jax_name!r} is {list(found)}"
            )
            continue
        pairs.append(ParamPair(torch_name, path, layout))
    problems += [f"JAX {name!r} has no torch parameter{_closest(name, torch_shapes)}" for name in jax_by_name]
    if problems:
        raise ValueError("the torch and JAX models do not pair up: " + "; ".join(problems))
    return pairs


def _auto(torch_name: str, shape: tuple[int, ...], jax_names) -> tuple[str, Layout] | None:
    for rule in AUTO_RULES:
        jax_name = rule.jax_name_for(torch_name, len(shape))
        if jax_name is not None and jax_name in jax_names:
            return jax_name, rule.layout
    return None


def _explicit(mapping: Mapping[str, str], jax_shapes):
    shapes = {dotted(path): tuple(shape) for path, shape in jax_shapes.items()}

    def choose(torch_name: str, shape: tuple[int, ...], jax_names):
        if torch_name not in mapping:
            return _auto(torch_name, shape, jax_names)
        jax_name = mapping[torch_name]
        if jax_name not in jax_names:
            return None
        reversed_2d = len(shape) == 2 and shapes[jax_name] == tuple(shape)[::-1] and shape[0] != shape[1]
        return jax_name, TRANSPOSE if reversed_2d else SAME

    return choose


def pair(torch_model, jax_model, params) -> list[ParamPair]:
    """The parameter pairs of `params` ("auto", a {torch name: JAX path} dict or bridge.params.Rule list)."""
    torch_shapes = {name: tuple(p.shape) for name, p in torch_model.named_parameters()}
    jax_shapes = {path: tuple(v.shape) for path, v in jax_parameters(jax_model).items()}
    if isinstance(params, str):
        if params != "auto":
            raise ValueError(f"params={params!r}: pass 'auto', a dict {{torch name: JAX path}} or a list of Rules")
        return _pair_by_choice(torch_shapes, jax_shapes, _auto)
    if isinstance(params, Mapping):
        unknown = sorted(set(params) - set(torch_shapes))
        if unknown:
            raise ValueError(f"params names torch parameters the model lacks: {', '.join(unknown)}")
        return _pair_by_choice(torch_shapes, jax_shapes, _explicit(params, jax_shapes))
    rules = list(params)
    if not all(isinstance(rule, Rule) for rule in rules):
        raise TypeError("params: pass 'auto', a dict {torch name: JAX path} or a list of bridge.params.Rule")
    return pair_parameters(torch_shapes, jax_shapes, rules)


__all__ = ["AUTO_RULES", "CONV", "jax_shape", "pair"]
