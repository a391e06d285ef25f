"""`shardbridge`: the command line. Library code returns data; only this file renders it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rich.console import Console
from rich.table import Table

Command = Callable[[argparse.Namespace, Console], int]


def _env(args: argparse.Namespace, console: Console) -> int:
    from bridge import environment

    table = Table(title="shardbridge environment")
    table.add_column("item", style="bold")
    table.add_column("value")
    for row in environment.collect():
        table.add_row(row.name, row.value)
    console.print(table)
    return 0


def _parser() -> tuple[argparse.ArgumentParser, dict[str, Command]]:
    parser = argparse.ArgumentParser(
        prog="shardbridge",
        description="FP8 training modules in PyTorch and JAX on the same devices, "
        "and proofs that their shards and numbers agree.",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="COMMAND")
    commands: dict[str, Command] = {}

    verbs.add_parser("env", help="versions of torch, triton, jax, flax; devices; where Triton kernels run")
    commands["env"] = _env
    return parser, commands


def main(argv: Sequence[str] | None = None) -> int:
    parser, commands = _parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    return commands[args.verb](args, Console())


if __name__ == "__main__":
    sys.exit(main())
