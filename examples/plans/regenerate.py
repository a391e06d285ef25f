"""Rewrite each examples/plans/NAME.txt: `shardbridge plan show examples/plans/NAME.toml --model llama`.

Run after a change to a plan or to `plan show`'s output: `python examples/plans/regenerate.py` from the
repository root. tests/bridge/test_plan_examples.py fails while a committed .txt differs from a fresh run.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

PLANS = Path(__file__).resolve().parent
REPO = PLANS.parents[1]


def transcript(plan: Path) -> str:
    """What NAME.txt holds: the command, its standard output (at the CLI's width for a pipe) and its exit code.

    Needs the repository on sys.path and no COLUMNS in the environment (it would set the tables' width)."""
    from bridge import cli

    argv = ["plan", "show", plan.relative_to(REPO).as_posix(), "--model", "llama"]
    output = io.StringIO()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(output):
        code = cli.main(argv)
    return f"$ shardbridge {' '.join(argv)}\n{output.getvalue()}(exit {code})\n"


def main() -> int:
    sys.path.insert(0, str(REPO))
    os.environ.pop("COLUMNS", None)
    for plan in sorted(PLANS.glob("*.toml")):
        plan.with_suffix(".txt").write_text(transcript(plan))
        print(f"wrote {plan.with_suffix('.txt').relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
