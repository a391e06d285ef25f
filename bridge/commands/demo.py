"""`shardbridge demo`: the whole project in one run, with a verdict per check.

Trains a tiny Llama of FP8 TransformerLayers on FSDP2 x TP (one process per GPU, or CPU processes),
saves a DCP checkpoint asynchronously, reloads it on another topology, moves the shards into JAX on
the same devices to compare layouts and a forward pass, converts the checkpoint to Orbax and restores
it. Prints a table of every check against its tolerance and writes report.json, layouts.png and
loss.png into --out. Exit codes: 0 every check passed, 1 a check failed, 2 bad options.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape

from bridge.demo.options import DemoOptions
from bridge.numerics import RECIPES

DEFAULTS = DemoOptions()


def register(verbs) -> None:
    parser = verbs.add_parser(
        "demo",
        help="train FP8 on FSDP2 x TP, checkpoint, reload elsewhere, cross into JAX and Orbax: one table of checks",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument("--steps", type=int, default=DEFAULTS.steps, help=f"training steps (default {DEFAULTS.steps})")
    parser.add_argument(
        "--recipe", default=DEFAULTS.recipe, help=f"FP8 recipe: {', '.join(RECIPES)} (default {DEFAULTS.recipe})"
    )
    parser.add_argument("--dp", type=int, default=DEFAULTS.dp, help="FSDP2 ranks of the training mesh (default 2)")
    parser.add_argument("--tp", type=int, default=DEFAULTS.tp, help="TP ranks of the training mesh (default 2)")
    parser.add_argument(
        "--reload-dp", type=int, default=DEFAULTS.reload_dp,
        help="processes that reload the checkpoint, FSDP2 only (default 2; another topology than --dp x --tp)",
    )  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="sequences per step (default 8)")
    parser.add_argument(
        "--seq-len", type=int, default=DEFAULTS.seq_len, help="tokens per sequence, a multiple of 32 (default 64)"
    )
    parser.add_argument("--lr", type=float, default=DEFAULTS.lr, help=f"peak learning rate (default {DEFAULTS.lr})")
    parser.add_argument(
        "--out", default=DEFAULTS.out, metavar="DIR",
        help="where report.json, layouts.png, loss.png and the checkpoints dcp/ and orbax/ go; an earlier demo's "
        "dcp/ and orbax/ there are replaced (default ./shardbridge-demo)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cpu", "cuda"),
        help="default: cuda (a process per GPU) where torch sees enough GPUs for the mesh, else CPU processes",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of the table")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from bridge.cli import check_output_path

    fields = ("steps", "recipe", "dp", "tp", "reload_dp", "batch_size", "seq_len", "lr", "out", "device")
    options = DemoOptions(**{name: getattr(args, name) for name in fields})
    from bridge.demo import check_input, run_demo

    check_input(options)  # the mesh first: a refused one leaves no --out folder behind
    check_output_path("--out", options.out, directory=True)
    from bridge.demo.report import table

    errors = Console(stderr=True, soft_wrap=True)
    report = run_demo(options, status=lambda text: errors.print(f"[bold]>[/] {escape(text)}"))
    if args.json:
        console.out(json.dumps(report.to_json()), highlight=False)
    else:
        console.width = max(console.width, 140)  # the table's rows stay one line each, also in a pipe
        console.print(table(report))
        for what, path in report.files.items():
            console.print(f"{what}: {escape(path)}", soft_wrap=True)
        console.print("[bold green]every check passed[/]" if report.passed else "[bold red]a check failed[/]")
    return 0 if report.passed else 1
