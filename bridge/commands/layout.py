"""`shardbridge layout`: which device holds which elements, in torch and in JAX.

Give a mesh, a shape and either DTensor placements or a JAX PartitionSpec. It prints the
shard map of both frameworks, the equivalent spec in the other one (or why there is
none) and a verdict. Exit codes: 0 same layout, 1 no equivalent or a difference,
2 bad input.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich.columns import Columns
from rich.console import Console
from rich.markup import escape
from rich.table import Table

if TYPE_CHECKING:
    from bridge.layout import ShardMap


def register(verbs) -> None:
    parser = verbs.add_parser(
        "layout",
        help="which device holds which elements for DTensor placements or a JAX PartitionSpec, "
        "the equivalent in the other framework, and a picture",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--mesh", required=True, help="mesh axes in rank order, e.g. dp=4,tp=2")
    parser.add_argument("--shape", required=True, help="global shape in the framework you describe, e.g. 8,16")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--placements", help='DTensor placements, e.g. "_StridedShard(0,sf=2),Shard(0)"')
    source.add_argument("--pspec", help="JAX PartitionSpec, e.g. \"(('tp','dp'),None)\"")
    parser.add_argument(
        "--transpose",
        action="store_true",
        help="the other framework holds the transpose (torch Linear [out,in] vs Flax kernel [in,out])",
    )
    parser.add_argument("--png", metavar="FILE", help="also draw both maps into this PNG")
    parser.add_argument("--json", action="store_true", help="print the maps and verdict as JSON")
    parser.set_defaults(run=run)


@dataclass(frozen=True)
class _Layouts:
    """Both sides of one question; the JAX side is None where it has no equivalent."""

    placements_text: str
    torch_map: ShardMap
    pspec_text: str | None
    jax_map: ShardMap | None
    verdict: str
    equal: bool


def run(args: argparse.Namespace, console: Console) -> int:
    from bridge.cli import check_output_path

    if args.png:
        check_output_path("--png", args.png)
    layouts = _layouts(args)
    if args.png:
        _save_png(args.png, layouts)
    if args.json:
        console.out(json.dumps(_as_json(args.mesh, layouts)), highlight=False)
    else:
        _render(console, args.mesh, layouts)
    if args.png:
        Console(stderr=True, soft_wrap=True).print(f"wrote {escape(args.png)}")
    return 0 if layouts.equal else 1


def _layouts(args: argparse.Namespace) -> _Layouts:
    from bridge import layout
    from bridge.layout import text, translate

    mesh = text.parse_mesh(args.mesh)
    shape = text.parse_shape(args.shape)
    if args.transpose and len(shape) != 2:
        raise ValueError(f"--transpose swaps the dims of a 2-D weight; --shape {args.shape} has {len(shape)} dims")
    other_shape = shape[::-1] if args.transpose else shape
    if args.pspec is not None:
        pspec = text.parse_pspec(args.pspec)
        jax_map = layout.from_pspec(mesh, pspec, shape)
        placements = translate.pspec_to_placements(mesh, pspec, len(shape), transpose=args.transpose)
        torch_map = layout.from_placements(mesh, placements, other_shape)
    else:
        placements = text.parse_placements(args.placements)
        torch_map = layout.from_placements(mesh, placements, shape)
        try:
            pspec = translate.placements_to_pspec(mesh, placements, shape, transpose=args.transpose)
        except ValueError as no_equivalent:  # a legitimate answer, not bad input
            return _Layouts(text.format_placements(placements), torch_map, None, None, str(no_equivalent), False)
        jax_map = layout.from_pspec(mesh, pspec, other_shape)
    comparison = layout.compare(torch_map.transposed() if args.transpose else torch_map, jax_map)
    return _Layouts(
        text.format_placements(placements),
        torch_map,
        text.format_pspec(pspec),
        jax_map,
        comparison.reason,
        comparison.equal,
    )


def _render(console: Console, mesh_text: str, layouts: _Layouts) -> None:
    from bridge.layout import draw

    console.print(f"[bold]mesh[/] {escape(mesh_text)} in rank order (JAX device i = torch rank i)")
    console.print(_shard_table(layouts))
    torch_title = f"torch {tuple(layouts.torch_map.global_shape)}: {layouts.placements_text}"
    panels = [draw.text_grid(layouts.torch_map, escape(torch_title))] if _drawable(layouts.torch_map) else []
    if layouts.jax_map is not None and _drawable(layouts.jax_map):
        jax_title = f"jax {tuple(layouts.jax_map.global_shape)}: {layouts.pspec_text}"
        panels.append(draw.text_grid(layouts.jax_map, escape(jax_title)))
    console.print(Columns(panels))
    console.print(f"[bold]torch placements[/] {escape(layouts.placements_text)}")
    console.print(f"[bold]JAX PartitionSpec[/] {escape(layouts.pspec_text or '(none)')}")
    colour = "green" if layouts.equal else "red"
    console.print(f"[bold {colour}]verdict[/] {escape(layouts.verdict)}")


def _shard_table(layouts: _Layouts) -> Table:
    from bridge.layout.text import format_indices

    torch_map, jax_map = layouts.torch_map, layouts.jax_map
    table = Table(title="shard map: global indices held per dim")
    table.add_column("rank", justify="right")
    table.add_column("coordinate")
    table.add_column("torch", style="cyan")
    if jax_map is not None:
        table.add_column("jax", style="magenta")
    for coordinate in torch_map.mesh.coordinates():
        cells = [str(torch_map.mesh.rank_of(coordinate)), torch_map.mesh.describe(coordinate)]
        for shard_map in (torch_map, jax_map):
            if shard_map is not None:
                cells.append(" x ".join(format_indices(held) for held in shard_map.indices[coordinate]))
        table.add_row(*cells)
    return table


def _drawable(shard_map: ShardMap) -> bool:
    return len(shard_map.global_shape) <= 2


def _save_png(path: str, layouts: _Layouts) -> None:
    from bridge.layout import draw

    panels = [(f"torch: {layouts.placements_text}", layouts.torch_map)]
    if layouts.jax_map is not None:
        panels.append((f"jax: {layouts.pspec_text}", layouts.jax_map))
    draw.save_png(path, panels)


def _as_json(mesh_text: str, layouts: _Layouts) -> dict[str, Any]:
    return {
        "mesh": mesh_text,
        "torch": {"placements": layouts.placements_text, "shard_map": layouts.torch_map.to_json()},
        "jax": {
            "pspec": layouts.pspec_text,
            "shard_map": None if layouts.jax_map is None else layouts.jax_map.to_json(),
        },
        "verdict": {"equal": layouts.equal, "reason": layouts.verdict},
    }
