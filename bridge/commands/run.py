"""`shardbridge run -n N script.py [args]`: start a co-located torch+JAX script under torchrun.

The script calls `bridge.runtime.initialize()` to bring up torch's process group and JAX's
distributed runtime in each process. This is torchrun itself (`torch.distributed.run`,
standalone rendezvous on this node); for several nodes call torchrun with its rendezvous options.
Example: `shardbridge run -n 2 examples/run_colocated.py` moves one sharded tensor from torch to JAX
and back on the same devices.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console


def register(verbs) -> None:
    parser = verbs.add_parser(
        "run",
        help="start a script in N co-located torch+JAX processes (torchrun, one per device)",
        description=__doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the example stays on its own line
    )
    parser.add_argument("-n", "--nproc", type=int, required=True, help="processes (one per device)")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from torch.distributed import run as torchrun

    from bridge.runtime import ctrl_c_as_keyboard_interrupt

    if args.nproc < 1:
        raise ValueError(f"-n {args.nproc}: start at least one process")
    if not Path(args.script).is_file():
        raise ValueError(f"{args.script}: no such script; pass the path of a Python file")
    with ctrl_c_as_keyboard_interrupt():
        torchrun.main(["--standalone", "--nproc-per-node", str(args.nproc), args.script, *args.script_args])
    return 0
