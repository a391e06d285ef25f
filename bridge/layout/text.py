"""Layouts as text: parse what users type (`dp=4,tp=2`, `_StridedShard(0,sf=2),Shard(0)`,
`(('tp','dp'),None)`) and write placements, specs and index sets back the same way.

Parsing goes through Python's `ast`, never `eval`: only the names below are accepted.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from bridge import _torch_compat
from bridge.layout import MeshSpec
from twinspec.mesh import split_axis_sizes

if TYPE_CHECKING:
    from jax.sharding import PartitionSpec
    from torch.distributed.tensor import Placement

_PLACEMENT_HELP = (
    "write placements as Shard(d), _StridedShard(d, sf=k), Replicate() or Partial(op), "
    "one per mesh axis, separated by commas"
)
_REDUCE_OPS = ("sum", "avg", "max", "min")


def parse_mesh(text: str) -> MeshSpec:
    """`dp=4,tp=2` -> a rank-ordered MeshSpec, its axes named and ordered as written.

    Not twinspec.mesh.parse_mesh: a layout's mesh is any mesh (any names, any number of axes, in the
    user's order, named as the PartitionSpec names them), not a run's three. It is spelled the same way.
    """
    names, sizes = zip(*split_axis_sizes(text))
    return MeshSpec(sizes, names)


def parse_shape(text: str) -> tuple[int, ...]:
    """`8,16` -> (8, 16)."""
    items = [item.strip() for item in text.strip("()[] ").split(",") if item.strip()]
    if not items or not all(item.isdigit() and int(item) > 0 for item in items):
        raise ValueError(f"shape {text!r} must be positive sizes separated by commas, like 8,16")
    return tuple(int(item) for item in items)


def parse_placements(text: str) -> tuple[Placement, ...]:
    """`_StridedShard(0,sf=2),Shard(0)` -> DTensor placement objects (torch's repr and str forms work too)."""
    body = text.strip()
    if body[:1] + body[-1:] in ("[]", "()"):
        body = body[1:-1]
    try:
        tree = ast.parse(f"[{body}]", mode="eval").body
    except SyntaxError:
        raise ValueError(f"placements {text!r} do not parse (unbalanced brackets?); {_PLACEMENT_HELP}") from None
    return tuple(_placement_from_node(node, text) for node in tree.elts)


def format_placements(placements: Sequence[Placement]) -> str:
    """The text `parse_placements` reads back, e.g. `_StridedShard(0, sf=2), Shard(0)`."""
    from torch.distributed.tensor import Partial, Shard

    def one(placement: Placement) -> str:
        if _torch_compat.is_strided_shard(placement):
            return f"_StridedShard({placement.dim}, sf={_torch_compat.split_factor_of(placement)})"
        if isinstance(placement, Shard):
            return f"Shard({placement.dim})"
        if isinstance(placement, Partial):
            return f"Partial({placement.reduce_op})"
        return "Replicate()"

    return ", ".join(one(p) for p in placements)


def parse_pspec(text: str) -> PartitionSpec:
    """`(('tp','dp'),None)` or `P(('tp','dp'), None)` -> a JAX PartitionSpec."""
    from jax.sharding import PartitionSpec

    try:
        tree = ast.parse(text.strip(), mode="eval").body
        if isinstance(tree, ast.Call) and isinstance(tree.func, ast.Name) and tree.func.id in ("P", "PartitionSpec"):
            if tree.keywords:
                raise ValueError("keywords")
            entries = tuple(ast.literal_eval(arg) for arg in tree.args)
        else:  # a bare tuple: the argument list of P
            value = ast.literal_eval(tree)
            entries = value if isinstance(value, tuple) else (value,)
    except (SyntaxError, ValueError):
        raise ValueError(
            f"partition spec {text!r} is not a tuple of None, axis names and tuples of axis names; "
            "write it like (('tp','dp'),None)"
        ) from None
    entries = tuple(tuple(e) if isinstance(e, list) else e for e in entries)
    for entry in entries:
        axis_tuple = isinstance(entry, tuple) and all(isinstance(name, str) for name in entry)
        if not (entry is None or isinstance(entry, str) or axis_tuple):
            raise ValueError(f"partition spec entry {entry!r} in {text!r} must be None, 'axis' or ('axis', ...)")
    return PartitionSpec(*entries)


def format_pspec(pspec: PartitionSpec | Sequence[Any]) -> str:
    """`P(('tp', 'dp'), None)`, independent of the installed jax's repr."""
    return "P(" + ", ".join(repr(tuple(e)) if isinstance(e, tuple | list) else repr(e) for e in pspec) + ")"


def format_indices(held: np.ndarray, limit: int = 8) -> str:
    """`0:4`, `1:8:2`, or a list (cut after `limit` items): one dim's held indices, short."""
    if len(held) == 0:
        return "-"
    if len(held) == 1:
        return str(int(held[0]))
    steps = np.diff(held)
    if np.all(steps == steps[0]):
        stop = int(held[-1]) + 1
        return f"{int(held[0])}:{stop}" if steps[0] == 1 else f"{int(held[0])}:{stop}:{int(steps[0])}"
    shown = ", ".join(str(int(i)) for i in held[:limit])
    return f"[{shown}{', ...' if len(held) > limit else ''}]"


def _placement_from_node(node: ast.expr, text: str) -> Placement:
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(node, ast.Name):  # `Replicate` or `R` without parentheses
        node = ast.Call(func=node, args=[], keywords=[])
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        raise ValueError(f"{ast.unparse(node)!r} in {text!r} is not a placement; {_PLACEMENT_HELP}")
    name = node.func.id
    args = [_literal(arg, text) for arg in node.args]
    keywords = {kw.arg: _literal(kw.value, text) for kw in node.keywords}
    if name in ("Replicate", "R") and not args and not keywords:
        return Replicate()
    if name == "Partial" and len(args) + len(keywords) <= 1:
        reduce_op = str(args[0] if args else keywords.get("reduce_op", "sum"))
        if reduce_op not in _REDUCE_OPS or set(keywords) - {"reduce_op"}:
            raise ValueError(f"{ast.unparse(node)!r}: Partial takes one of {_REDUCE_OPS}")
        return Partial(reduce_op)
    dim = args[0] if args else keywords.get("dim")
    if name in ("Shard", "S") and isinstance(dim, int) and len(args) + len(keywords) == 1:
        return Shard(dim)
    if name in ("_StridedShard", "StridedShard", "_S"):
        split_factor = args[1] if len(args) > 1 else keywords.get("sf", keywords.get("split_factor"))
        if isinstance(dim, int) and isinstance(split_factor, int) and len(args) + len(keywords) == 2:
            return _torch_compat.make_strided_shard(dim, split_factor)
    raise ValueError(f"{ast.unparse(node)!r} in {text!r} is not a placement; {_PLACEMENT_HELP}")


def _literal(node: ast.expr, text: str) -> Any:
    if isinstance(node, ast.Name):  # Partial(sum)
        return node.id
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise ValueError(f"{ast.unparse(node)!r} in {text!r} is not a number or a name; {_PLACEMENT_HELP}") from None
