"""`shardbridge`: the command line. Library code returns data; only the command modules render it.

Each verb lives in its own module under `bridge/commands/` with
`register(verbs)` (adds its subparser and `set_defaults(run=fn)`) and `fn(args, console) -> int`.

The exit contract (docs/design.md, "The command line contract") is applied here, once, for every verb:

    0    done
    1    a check or verification failed (a verb returns 1, or raises bridge.errors.CheckFailed)
    2    bad input or environment: ValueError, TypeError, OSError (a missing or unwritable path...)
    130  interrupted (Ctrl-C), after the verb's own cleanup

Each failure prints one line `error: ...` on stderr, never wrapped; `shardbridge --debug VERB ...`
prints the traceback too. Verbs raise; they do not catch these exceptions themselves.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence
from pathlib import Path

import rich.console
from rich.console import Console
from rich.markup import escape

from bridge.errors import CheckFailed

# One line per verb; the module is imported only to build the parser (no heavy imports at top).
COMMANDS = ("env", "layout", "plan", "quantize", "convert", "verify", "run", "demo")

# Without a terminal (a pipe, a log file) tables take the width they need up to this, so names never wrap.
PIPE_WIDTH = 1000

EXIT_CODES = """\
exit codes (every command):
  0    done
  1    a check or verification failed
  2    bad input or environment (one line "error: ..." names the path or option and the fix)
  130  interrupted (Ctrl-C)
Errors are one line on stderr; add --debug before the command for the traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardbridge",
        description="FP8 training modules in PyTorch and JAX on the same devices, "
        "and proofs that their shards and numbers agree.",
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--debug", action="store_true", help="print the traceback of an error too")
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
    try:
        return args.run(args, _stdout_console())
    except CheckFailed as error:
        return _fail(error, 1, args.debug)
    except (ValueError, TypeError, OSError) as error:
        return _fail(error, 2, args.debug)
    except KeyboardInterrupt as error:
        return _fail(error, 130, args.debug, "interrupted")


def check_output_path(option: str, path: str, *, directory: bool = False) -> Path:
    """`path` of an output option, checked before any work starts (a folder is created): ValueError with the fix."""
    target = Path(path)
    blocking = _file_in_the_way(target if directory else target.parent)
    if blocking is not None:
        raise ValueError(f"{option} {path}: {blocking} is a file, not a folder; pick another path")
    if directory:
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            reason = f"cannot create the directory ({error.strerror})"
            raise ValueError(f"{option} {path}: {reason}; pick another path") from error
        folder = target
    else:
        folder = target.parent
        if target.is_dir():
            raise ValueError(f"{option} {path} is a directory; name a file in it")
        if not folder.is_dir():
            raise ValueError(f"{option} {path}: directory {folder} does not exist; create it or pick another path")
    try:
        with tempfile.TemporaryFile(dir=folder):  # the real test: root passes os.access on read-only mounts
            pass
    except OSError as error:
        raise ValueError(f"{option} {path}: cannot write in {folder} ({error.strerror}); pick another path") from error
    return target


def _file_in_the_way(folder: Path) -> Path | None:
    """The nearest existing path at or above `folder` when it is not a folder (a file), else None."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _stdout_console() -> Console:
    """The console results go to: as wide as needed when it is not a terminal (COLUMNS still wins)."""
    console = Console()
    if not console.is_terminal and "COLUMNS" not in os.environ:
        console.width = PIPE_WIDTH
    return console


def _fail(error: BaseException, code: int, debug: bool, message: str | None = None) -> int:
    """One `error:` line on stderr (after the traceback with --debug); the exit code."""
    if debug:
        traceback.print_exception(error)
    text = message or str(error) or type(error).__name__
    errors = rich.console.Console(stderr=True, soft_wrap=True, highlight=False)
    errors.print(f"[bold red]error:[/] {escape(' '.join(text.split()))}")
    return code


if __name__ == "__main__":
    sys.exit(main())
