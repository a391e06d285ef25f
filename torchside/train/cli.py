"""`python -m torchside.train`: flags named like TrainOptions' fields; a summary line on stdout; the exit status."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence

import torch.distributed as dist

from torchside.train.loop import train
from torchside.train.options import TrainOptions


def parse_args(argv: Sequence[str] | None = None) -> TrainOptions:
    """TrainOptions from flags named like its fields (--batch-size, --no-progress, ...)."""
    description = sys.modules[__package__].__doc__.split("\n\n")[0]  # the package docstring's first paragraph
    parser = argparse.ArgumentParser(prog="python -m torchside.train", description=description)
    for field in dataclasses.fields(TrainOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = {"int": int, "float": float}.get(field.type, str)
            parser.add_argument(flag, type=kind, default=field.default)
    args = parser.parse_args(argv)
    try:
        return TrainOptions(**vars(args))
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    summary = train(options)
    if not dist.is_initialized() or dist.get_rank() == 0:
        report = dataclasses.asdict(summary)
        del report["losses"]
        print(json.dumps(report), flush=True)
    if dist.is_initialized():
        # Every rank past its last collective (rank 0 was still plotting) before any tears gloo down: a rank
        # destroying its groups while a peer still uses them aborted the process ("terminate called without an
        # active exception", seen twice in CI on the 2-rank resume test).
        dist.barrier()
        dist.destroy_process_group()
    return 0 if summary.nonfinite_losses == 0 and summary.nonfinite_params == 0 else 1

