"""`shardbridge convert`: convert a checkpoint between DCP, Orbax, safetensors and HF, streamed shard by shard.

Names and orientation follow the architecture's parameter rules (a torch `weight` [out, in] is a
Flax `kernel` [in, out]; a Hugging Face Llama directory's q/k/v and gate/up become our fused rows
and back; `--to hf` writes the HF config.json a checkpoint converted from HF carries, or `--config`);
FP8 parameters travel as their bytes and scales, never upcast. Every written box is read back before
the target is committed and a per-tensor CRC32 table is printed.
A source we wrote is checked against the checksums recorded with it. Under torchrun, each rank writes
its own blocks of a DCP or safetensors target. Exit codes: 0 done, 1 a checksum differs (source or
written copy; nothing is committed), 2 bad input, 130 interrupted (nothing left behind).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

FORMATS = ("dcp", "orbax", "safetensors", "hf")
SOURCE_KINDS = {"dcp": "directory", "orbax": "directory", "safetensors": "file", "hf": "directory"}


def register(verbs) -> None:
    parser = verbs.add_parser(
        "convert",
        help="convert a checkpoint DCP <-> Orbax <-> safetensors <-> Hugging Face, streamed into the target sharding",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "source",
        help="a DCP or Orbax checkpoint (a step, or their root: its latest step), a .safetensors file or an HF model directory",
    )
    parser.add_argument("target", help="where to write (must not exist; written in full or not at all)")
    parser.add_argument("--from", dest="source_format", required=True, choices=FORMATS)
    parser.add_argument("--to", dest="target_format", required=True, choices=FORMATS)
    parser.add_argument("--arch", default="shardbridge", help="the parameter rule table (default: shardbridge)")
    parser.add_argument(
        "--config",
        help="--to hf: the model's HF config.json (or its directory), copied into the target "
        "(default: the one carried by a checkpoint converted from HF)",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="--to hf: largest safetensors file, bytes or e.g. 5GB, 500MiB (default 5GB)"
    )
    parser.add_argument("--with-optimizer", action="store_true", help="convert the optimizer states too")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    parser.add_argument("--no-verify", action="store_true", help="skip reading the target back")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    if args.config and args.target_format != "hf":
        raise ValueError(f"--config is for --to hf (the target's config.json), not --to {args.target_format}; drop it")
    check_paths(args)  # before torch and jax load (seconds): a mistyped path is answered at once
    from bridge.convert import convert

    stderr = Console(stderr=True, soft_wrap=True)
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=stderr,
        transient=True,
        disable=not stderr.is_terminal,  # (else a pipe or log file gets an empty line)
    )
    task = None

    def on_box(key: str, nbytes: int) -> None:
        progress.update(task, advance=nbytes, description=f"writing {escape(key)}")

    target_options = {"config": args.config, "max_shard_size": args.max_shard_size}
    options = dict(
        with_optimizer=args.with_optimizer, architecture=args.arch, verify=not args.no_verify, target_options=target_options
    )
    checked = convert(args.source, args.source_format, args.target, args.target_format, dry_run=True, **options)
    plan = checked.plan
    if args.dry_run:
        _print_plan(plan, console)
        _say_which_step(checked.source_read, args.source, console)
        return 0
    with progress:
        task = progress.add_task("converting", total=sum(plan.bytes_per_owner()))
        result = convert(args.source, args.source_format, args.target, args.target_format, on_box=on_box, **options)
    console.print(checksum_table(result))
    for key, reason in result.skipped:
        console.print(f"not converted: {escape(key)} ({escape(reason)})", soft_wrap=True)
    if not result.source_verified:
        console.print(
            f"source not verifiable: {escape(args.source)} has no recorded checksums (not written by shardbridge)", soft_wrap=True
        )
    _say_which_step(result.source_read, args.source, console)
    console.print(f"wrote {escape(args.target)}", soft_wrap=True)
    return 0


def _say_which_step(read: Path, source: str, console: Console) -> None:
    """A root of saves was given: which of its steps is read."""
    if read.absolute() != Path(source).absolute():
        console.print(f"read {escape(str(read))} (the latest committed step in {escape(source)})", soft_wrap=True)


def check_paths(args: argparse.Namespace) -> None:
    """The source (exists, file or directory as its format wants), the target (new, its folder writable) and
    --config (exists), checked without torch or jax: ValueError naming the path and the fix."""
    source, kind = Path(args.source), SOURCE_KINDS[args.source_format]
    if not source.exists():
        raise ValueError(f"source {args.source} does not exist; pass a {args.source_format} checkpoint ({kind})")
    if source.is_dir() != (kind == "directory"):
        found = "a directory" if source.is_dir() else "not a directory"
        raise ValueError(
            f"source {args.source} is {found}, but --from {args.source_format} reads a {kind}; check the path and --from"
        )
    target = Path(args.target)
    if os.path.lexists(target):
        raise ValueError(f"target {args.target} exists; pass a new path (it is never overwritten)")
    folder = target.absolute().parent
    while not os.path.lexists(folder):  # missing folders are created: the nearest existing one must take them
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):  # the real test: root passes os.access on read-only mounts
            pass
    except OSError as error:
        raise ValueError(
            f"cannot create target {args.target} ({folder}: {error.strerror}): write it into a directory you can write to"
        ) from error
    if args.config is not None and not Path(args.config).exists():
        raise ValueError(f"--config {args.config} does not exist; pass the model's HF config.json or its directory")


def _print_plan(plan, console: Console) -> None:
    table = Table(title=f"conversion plan ({plan.owners} owners: target processes or devices)")
    for name, justify in (("source", "left"), ("target", "left"), ("shape", "left"), ("dtype", "left"), ("layout", "left")):
        table.add_column(name, justify=justify)
    table.add_column("placement", justify="left")
    for entry in plan.entries:
        placement = "dim 0 split" if all(entry.boxes) and plan.owners > 1 else "whole, one owner"
        table.add_row(
            escape(entry.source.key),
            escape(entry.target.key),
            str(list(entry.target.shape)),
            entry.target.dtype,
            "transpose" if entry.transpose else "same",
            placement,
        )
    console.print(table)
    per_owner = Table()
    per_owner.add_column("owner", justify="right")
    per_owner.add_column("bytes written", justify="right")
    for owner, nbytes in enumerate(plan.bytes_per_owner()):
        per_owner.add_row(str(owner), f"{nbytes:,}")
    console.print(per_owner)
    for key, reason in plan.skipped:
        console.print(f"not converted: {escape(key)} ({escape(reason)})", soft_wrap=True)


def checksum_table(result) -> Table:
    """Per tensor: CRC32 of the bytes as produced from the source and as read back from the target (equal, or it raised)."""
    table = Table(title="per-tensor checksums (CRC32 of each target tensor's bytes)")
    table.add_column("tensor", style="bold")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("produced", justify="right")
    table.add_column("read back", justify="right")
    for c in result.checksums:
        written = "not verified" if c.written is None else f"{c.written:08x}"
        table.add_row(escape(c.key), str(list(c.shape)), c.dtype, f"{c.produced:08x}", written)
    return table
