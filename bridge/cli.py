"""`shardbridge`: the command line. Library code returns data; only the command modules render it.

Each verb lives in its own module under `bridge/commands/` with
`register(verbs)` (adds its subparser and `set_defaults(run=fn)`) and `fn(args, console) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from rich.console import Console

# One line per verb; the module is imported only to build the parser (no heavy imports at top).
COMMANDS = ("env", "layout", "quantize", "convert", "verify", "run", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardbridge",
        description="FP8 training modules in PyTorch and JAX on the same devices, "
        "and proofs that their shards and numbers agree.",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"bridge.commands.{name}").register(verbs)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.verb is None:
        parser.print_help()
        return 2
    return args.run(args, Console())


if __name__ == "__main__":
    sys.exit(main())
