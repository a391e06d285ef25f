"""`shardbridge env`: versions, devices, and where Triton kernels run."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table


def register(verbs) -> None:
    parser = verbs.add_parser("env", help="versions of torch, triton, jax, flax; devices; where Triton kernels run")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from bridge import environment

    table = Table(title="shardbridge environment")
    table.add_column("item", style="bold")
    table.add_column("value")
    for row in environment.collect():
        table.add_row(row.name, row.value)
    console.print(table)
    return 0
