"""`shardbridge verify`: the same model in torch and JAX on the same devices, compared step by step.

Starts one process per device of the mesh under torchrun's launcher (bridge.runtime), builds the
torchside model and its jaxside twin with the same weights, runs forward, backward and Adam for
--steps steps under each recipe, and compares every block's output, the input gradient, every
weight gradient, parameter and Adam moment shard by shard (tolerances: bridge.numerics). Exit
codes: 0 all within tolerance, 1 a divergence (the first one is named), 2 bad input.

--plan PLAN places both twins by a placement plan (a TOML file, jaxside.plan): its [mesh] is the
default --mesh, and the plan is checked against the model before any process starts.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from bridge.numerics import RECIPES

RECIPE_CHOICES = f"{', '.join(RECIPES)} (comma-separated) or all"


def register(verbs) -> None:
    parser = verbs.add_parser(
        "verify",
        help="run a model in torch and JAX on the same devices and name the first tensor that diverges",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--model", default="mlp", help="linear, mlp (default) or transformer (bridge/twins.py)")
    parser.add_argument("--layers", type=int, default=2, help="blocks in the stack (default 2)")
    parser.add_argument(
        "--hidden", type=int, default=256, help="hidden size (default 256; ffn = 4x; TP must divide the ffn and heads)"
    )
    parser.add_argument("--recipe", default="current", help=RECIPE_CHOICES)
    parser.add_argument(
        "--mesh", action="append", help="mesh axes, e.g. dp=2,tp=2 (FSDP x TP) or rep=2,dp=2 (HSDP); repeatable"
    )
    parser.add_argument(
        "--plan", metavar="PLAN", help="a placement plan TOML file (examples/plans/); its [mesh] is the default --mesh"
    )
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps compared (default 5)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: cuda where torch sees a GPU per process, else the CPU"
    )
    parser.add_argument("--json", action="store_true", help="print every check as JSON")
    parser.add_argument("--report", metavar="FILE", help="also write the JSON report here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    cases = _cases(args)
    if args.report:
        from bridge.cli import check_output_path

        check_output_path("--report", args.report)  # before the run, whose results would be lost
    import torch

    from bridge import crosscheck, runtime

    processes = cases[0].mesh.size
    errors = Console(stderr=True, soft_wrap=True)
    device, fallback = runtime.choose_device_type(args.device, processes, torch.cuda.device_count())
    if fallback:
        errors.print(escape(fallback))
    with errors.status(f"verifying in {processes} co-located torch+JAX processes"):
        reports = runtime.launch(crosscheck.verify, processes, cases, device_type=device)[0]
    if args.report:
        with open(args.report, "w") as file:
            json.dump(reports, file, indent=1)
    if args.json:
        console.out(json.dumps(reports), highlight=False)
    else:
        for report in reports:
            render(console, report)
    return 0 if all(report["passed"] for report in reports) else 1


def _cases(args: argparse.Namespace) -> list:
    from bridge.crosscheck import MeshShape, VerifyCase, parse_mesh
    from jaxside.plan import DEFAULT_PLAN, Plan

    recipes = RECIPES if args.recipe == "all" else tuple(r.strip() for r in args.recipe.split(",") if r.strip())
    plan = DEFAULT_PLAN if args.plan is None else Plan.from_toml(args.plan)
    if args.mesh:
        meshes = [parse_mesh(text) for text in args.mesh]
    else:
        meshes = [parse_mesh("dp=2,tp=2") if plan.mesh is None else MeshShape(**plan.mesh)]
    if len({mesh.size for mesh in meshes}) > 1:
        raise ValueError(f"meshes {[str(m) for m in meshes]} need different process counts; verify them one by one")
    cases = [VerifyCase(args.model, args.layers, args.hidden, mesh, recipes, args.steps, plan) for mesh in meshes]
    for case in cases:
        _check_tp_divides(case)
        _check_plan(case)
    return cases


def _check_plan(case) -> None:
    """The plan against the torch twin (on meta) and the mesh: ValueError naming the rule, before processes start."""
    from bridge.twins import build_torch
    from torchside.parallel.plan import resolve

    mesh = case.mesh
    resolve(
        build_torch(case.spec), case.plan, {"dp_replicate": mesh.dp_replicate, "dp_shard": mesh.dp_shard, "tp": mesh.tp}
    )


def _check_tp_divides(case) -> None:
    """TP splits the ffn (column fc1, row fc2) and a transformer's heads: check here, before processes start."""
    from bridge.twins import HEAD_DIM

    tp = case.mesh.tp
    split = {f"the ffn size 4 x --hidden = {case.spec.ffn}": case.spec.ffn}
    if case.model == "transformer":
        split[f"the {case.hidden // HEAD_DIM} heads (--hidden / {HEAD_DIM})"] = case.hidden // HEAD_DIM
    for what, size in split.items():
        if size % tp:
            raise ValueError(
                f"--mesh {case.mesh}: tp={tp} does not divide {what}; pick a tp that divides it or another --hidden"
            )


def render(console: Console, report: dict) -> None:
    """One table per (mesh, recipe): the worst check of each stage, and the first divergence."""
    title = f"{report['model']} on {report['mesh']}, recipe {report['recipe']}, {report['steps']} steps"
    table = Table(title=escape(title))
    table.add_column("stage", style="bold")
    table.add_column("checks", justify="right")
    table.add_column("worst relative", justify="right")
    table.add_column("worst max-abs", justify="right")
    table.add_column("worst tensor", overflow="fold")
    table.add_column("verdict")
    stages: dict[str, list[dict]] = {}
    for check in report["checks"]:
        stages.setdefault(check["stage"], []).append(check)
    for stage, checks in stages.items():
        worst = max(checks, key=lambda c: (not c["passed"], c["relative"]))
        failed = sum(not c["passed"] for c in checks)
        verdict = "[green]ok[/]" if not failed else f"[red]{failed} diverge[/]"
        table.add_row(stage, str(len(checks)), f"{worst['relative']:.2e}", f"{worst['max_abs']:.2e}",
                      escape(f"{worst['name']} (step {worst['step']})"), verdict)  # fmt: skip
    console.print(table)
    first = report["first_divergence"]
    if first is None:
        console.print("[bold green]verdict[/] torch and JAX agree within bridge.numerics' tolerances")
        return
    limit = first["tolerance"]
    console.print(
        f"[bold red]first divergence[/] step {first['step']}, {first['stage']}, layer {escape(first['layer'])}, "
        f"tensor {escape(first['name'])}: relative {first['relative']:.3e} (limit {limit['relative']}), "
        f"max-abs {first['max_abs']:.3e} (limit {limit['max_abs']}){', NaN' if first['nan'] else ''}",
        soft_wrap=True,
    )
