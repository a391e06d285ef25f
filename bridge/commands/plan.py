"""`shardbridge plan`: where a placement puts every parameter in torch and JAX, and what it costs per rank.

`plan show` builds the model on the mesh (one process: rank 0 of a fake process group, no GPU)
and prints, per parameter, the torch placements, the JAX twin's PartitionSpec and whether both put
the same elements on every device; the bytes of parameters, gradients and optimizer states on
every rank; and the collectives one training step runs per mesh axis. `plan compare` prints the
totals of several meshes or plans side by side. Exit codes: 0 done, 1 a parameter whose torch and JAX
layouts differ, 2 bad input.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from twinspec.mesh import DEFAULT_MESH

if TYPE_CHECKING:
    from bridge.plan.build import PlanOptions
    from bridge.plan.cost import PlanCost


def register(verbs) -> None:
    parser = verbs.add_parser(
        "plan",
        help="a placement's layouts in torch and JAX, bytes per rank and communication per step",
        description=__doc__.split("\n\n")[1],
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="one placement: every parameter, memory per rank, communication")
    show.add_argument("plan", nargs="?", metavar="PLAN", help="a placement plan TOML (default: the built-in placement)")
    show.add_argument("--mesh", help=f"rep=, dp=, tp= sizes (default: the plan's [mesh], else {DEFAULT_MESH})")
    show.add_argument("--png", metavar="FILE", help="also draw memory per rank and traffic per axis into this PNG")
    show.set_defaults(run=run_show)
    compare = actions.add_parser("compare", help="several meshes (or plans) side by side")
    compare.add_argument("plans", nargs="*", metavar="PLAN", help="placement plan TOMLs (default: the built-in one)")
    compare.add_argument(
        "--mesh",
        action="append",
        help=f"a mesh to compare; repeat it (default: each plan's [mesh], else {DEFAULT_MESH})",
    )
    compare.set_defaults(run=run_compare)
    for sub in (show, compare):
        _add_model_options(sub)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="transformer", help="transformer (default; bridge/twins.py) or llama")
    parser.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--hidden", type=int, default=256, help="transformer hidden size (default 256; ffn 4x)")
    parser.add_argument("--config", default="tiny", help="llama: tiny (default), 125m or 1b")
    parser.add_argument("--sequence-parallel", action="store_true", help="split activations' tokens over tp")
    parser.add_argument("--dtype", default="fp32", help="parameters and activations: fp32 (default) or bf16")
    parser.add_argument("--fp8-params", metavar="RECIPE", help="build the GEMM weights as FP8 parameters (current...)")
    parser.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        help="FusedAdam's fp32 master copies (default: for bf16 and FP8 parameters)",
    )
    parser.add_argument("--exp-avg-dtype", default="fp32", help="Adam's first moment: fp32, bf16, fp16 or e4m3")
    parser.add_argument("--exp-avg-sq-dtype", default="fp32", help="Adam's second moment: fp32, bf16, fp16 or e4m3")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step, all ranks (default 8)")
    parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run_show(args: argparse.Namespace, console: Console) -> int:
    from bridge.cli import check_output_path

    if args.png:
        check_output_path("--png", args.png)
    plan = _read_plan(args.plan)
    options = _options(args, args.mesh, plan)
    cost = _price(options, plan)
    if args.png:
        from bridge.plan.picture import save_png

        save_png(args.png, cost, _title(options))
    if args.json:
        console.out(json.dumps(as_json(options, cost)), highlight=False)
    else:
        _render(console, options, cost)
    if args.png:
        Console(stderr=True, soft_wrap=True).print(f"wrote {escape(args.png)}")
    return 0 if all(p.same_layout is not False for p in cost.parameters) else 1


def run_compare(args: argparse.Namespace, console: Console) -> int:
    paths = args.plans or [None]
    meshes = args.mesh or [None]
    if len(meshes) * len(paths) < 2:
        raise ValueError("plan compare needs two or more candidates: repeat --mesh or give several PLANs")
    candidates = [(path, _read_plan(path), mesh) for path in paths for mesh in meshes]
    options = [_options(args, mesh, plan) for _, plan, mesh in candidates]
    costs = [_price(o, plan) for o, (_, plan, _) in zip(options, candidates)]
    labels = [_label(o, path) for o, (path, _, _) in zip(options, candidates)]
    if args.json:
        console.out(json.dumps([as_json(o, c) | {"label": label} for o, c, label in zip(options, costs, labels)]),
                    highlight=False)  # fmt: skip
    else:
        console.print(_totals_table(labels, costs))
        console.print(_placement_differences(labels, costs))
    return 0 if all(p.same_layout is not False for c in costs for p in c.parameters) else 1


def _read_plan(path: str | None):
    from bridge.plan.build import read_plan

    return None if path is None else read_plan(path)


def _options(args: argparse.Namespace, mesh_text: str | None, plan) -> PlanOptions:
    """The build's options: the mesh from --mesh, else the plan's [mesh], else DEFAULT_MESH."""
    from bridge.plan.build import PlanOptions, plan_sequence_parallel
    from twinspec.plan import choose_mesh

    mesh = choose_mesh(mesh_text, plan)
    sequence_parallel = args.sequence_parallel or plan_sequence_parallel(plan)
    return PlanOptions(
        model=args.model, mesh=mesh, layers=args.layers, hidden=args.hidden, config=args.config,
        sequence_parallel=sequence_parallel, dtype=args.dtype, fp8_params=args.fp8_params,
        master_weights=args.master_weights,
        exp_avg_dtype=args.exp_avg_dtype, exp_avg_sq_dtype=args.exp_avg_sq_dtype, batch=args.batch, seq=args.seq,
    )  # fmt: skip


def _price(options: PlanOptions, plan) -> PlanCost:
    import warnings

    from bridge.plan import build, cost

    with build.fake_world(options.mesh.world_size), warnings.catch_warnings():
        # materializing on a CPU mesh warns that DTensor RNG support is partial
        warnings.filterwarnings("ignore", message="DTensor random operators")
        return cost.price(build.build(options, plan=plan))


def _label(options: PlanOptions, path: str | None) -> str:
    from pathlib import Path

    return f"{Path(path).stem if path else 'built-in'} {options.mesh}"


def _title(options: PlanOptions) -> str:
    model = f"llama {options.config}" if options.model == "llama" else f"transformer {options.layers}x{options.hidden}"
    sp = ", sequence parallel" if options.sequence_parallel else ""
    fp8 = f", FP8 weights ({options.fp8_params})" if options.fp8_params else ""
    return f"{model} on {options.mesh}{sp}, {options.dtype}{fp8}, batch {options.batch} x seq {options.seq}"


def human(size: int) -> str:
    """Bytes with a binary unit: 512 B, 1.50 KiB, 3.00 MiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _per_rank(values: tuple[int, ...]) -> str:
    low, high = min(values), max(values)
    return human(low) if low == high else f"{human(low)}..{human(high)}"


def _render(console: Console, options: PlanOptions, cost: PlanCost) -> None:
    from bridge.plan.cost import MEMORY_KINDS

    console.print(f"[bold]{escape(_title(options))}[/] (rank 0 of {cost.mesh.size}: mesh {escape(str(cost.mesh))})")
    table = Table(title="parameters: where torch and JAX keep them, bytes on each rank")
    for column in ("parameter", "shape", "dtype", "torch placements", "JAX PartitionSpec", "same", "bytes/rank"):
        table.add_column(column, justify="right" if column == "bytes/rank" else "left")
    for p in cost.parameters:
        same = "-" if p.same_layout is None else "[green]yes[/]" if p.same_layout else "[red]no[/]"
        table.add_row(escape(p.name), "x".join(map(str, p.shape)), p.dtype + (" (fp8)" if p.quantized else ""),
                      escape(p.placements), escape(p.pspec or "-"), same, _per_rank(p.bytes["parameters"]))  # fmt: skip
    console.print(table)
    memory = cost.memory()
    table = Table(title="memory per rank")
    for column in ("rank", "coordinate", *MEMORY_KINDS, "total"):
        table.add_column(column, justify="left" if column == "coordinate" else "right")
    for coordinate in cost.mesh.coordinates():
        rank = cost.mesh.rank_of(coordinate)
        sizes = [memory[kind][rank] for kind in MEMORY_KINDS]
        table.add_row(str(rank), cost.mesh.describe(coordinate), *map(human, sizes), human(sum(sizes)))
    console.print(table)
    console.print(_communication_table(cost))
    for note in cost.communication.not_priced:
        console.print(f"[dim]not priced: {escape(note)}[/]")
    differing = [p for p in cost.parameters if p.same_layout is False]
    if differing:
        first = differing[0]
        console.print(f"[bold red]verdict[/] {len(differing)} parameters differ; {escape(first.name)}: "
                      f"{escape(first.verdict)}", soft_wrap=True)  # fmt: skip
    else:
        console.print("[bold green]verdict[/] torch and JAX keep every parameter's elements on the same devices")


def _communication_table(cost: PlanCost) -> Table:
    table = Table(title="communication of one training step, per rank")
    for column in ("axis", "collective", "calls", "forward", "backward", "total"):
        table.add_column(column, justify="left" if column in ("axis", "collective") else "right")
    rows: dict[tuple[str, str], dict[str, int]] = {}
    for c in cost.communication.collectives:
        row = rows.setdefault((c.axis, c.kind), {"calls": 0, "forward": 0, "backward": 0})
        row["calls"] += 1
        row[c.phase] += c.bytes
    for (axis, kind), row in rows.items():
        table.add_row(axis, kind.replace("_", "-"), str(row["calls"]), human(row["forward"]), human(row["backward"]),
                      human(row["forward"] + row["backward"]))  # fmt: skip
    if not rows:
        table.add_row("-", "none", "0", "-", "-", "-")
    return table


def _totals_table(labels: list[str], costs: list[PlanCost]) -> Table:
    from bridge.plan.cost import MEMORY_KINDS

    table = Table(title="side by side (bytes on the fullest rank; communication per rank per step)")
    table.add_column("")
    for label in labels:
        table.add_column(escape(label), justify="right")
    memories = [c.memory() for c in costs]
    for kind in MEMORY_KINDS:
        table.add_row(kind, *(human(max(m[kind])) for m in memories))
    table.add_row("total", *(human(max(map(sum, zip(*m.values())))) for m in memories))
    keys = sorted({key for c in costs for key in c.communication.totals()})
    for axis, kind in keys:
        cells = []
        for c in costs:
            calls, size = c.communication.totals().get((axis, kind), (0, 0))
            cells.append(f"{human(size)} ({calls})" if calls else "-")
        table.add_row(f"{axis} {kind.replace('_', '-')}", *cells)
    table.add_row("same layout in JAX", *(f"{sum(bool(p.same_layout) for p in c.parameters)}/{len(c.parameters)}"
                                          for c in costs))  # fmt: skip
    return table


def _placement_differences(labels: list[str], costs: list[PlanCost]) -> Table:
    table = Table(title="parameters placed differently (torch placements; the meshes' axes in order)")
    table.add_column("parameter")
    for label in labels:
        table.add_column(escape(label))
    by_name = [{p.name: p for p in c.parameters} for c in costs]
    for name in by_name[0]:
        placements = [escape(params[name].placements) if name in params else "-" for params in by_name]
        if len(set(placements)) > 1:
            table.add_row(escape(name), *placements)
    return table


def as_json(options: PlanOptions, cost: PlanCost) -> dict[str, Any]:
    import dataclasses

    from bridge.plan.cost import per_axis

    return {
        "model": options.model,
        "mesh": str(options.mesh),
        "mesh_axes": dict(zip(cost.mesh.axis_names, cost.mesh.shape)),
        "options": {k: v for k, v in dataclasses.asdict(options).items() if k != "mesh"},
        "parameters": [
            dataclasses.asdict(p) | {"shape": list(p.shape), "bytes": {k: list(v) for k, v in p.bytes.items()}}
            for p in cost.parameters
        ],
        "memory": {kind: list(sizes) for kind, sizes in cost.memory().items()},
        "communication": {
            "collectives": [dataclasses.asdict(c) for c in cost.communication.collectives],
            "per_axis": per_axis(cost.communication.collectives),
            "not_priced": cost.communication.not_priced,
        },
    }
