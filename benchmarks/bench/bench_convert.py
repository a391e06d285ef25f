"""`shardbridge convert` on a ~1B-parameter checkpoint: time and throughput per direction, against the disk floor.

1.07B bf16 parameters (2.1 GB) as 16 weights of 8192 x 8192 under `model.layers.<i>.weight`, saved by
DCP in one process. Directions timed (one process; the Orbax target goes to this process's JAX
devices), each including the read-back verification (every box read again and checksummed):

    dcp -> safetensors, safetensors -> dcp, dcp -> orbax (transposed), orbax -> dcp (transposed back)

Floor = bytes read + written (source once, target written once and read back once) / the disk
bandwidth in benchmarks/harness.py (~1.0 GB/s read, ~1.1 GB/s write, direct I/O; the page cache can beat it).
Peer, same run: `dcp.load` of the whole state dict plus `safetensors.torch.save_file` (a gather-everything
converter, which holds the full model in host memory). Disk: about 13 GB in a temporary directory,
removed at the end. Usage (repository root): PYTHONPATH=. python3 benchmarks/bench/bench_convert.py [--layers 16]
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from benchmarks.harness import DISK_READ_BYTES_PER_S, DISK_WRITE_BYTES_PER_S, Result, argument_parser, report
from bridge.convert import convert

DIRECTIONS = (
    ("dcp", "src", "safetensors", "out.safetensors"),
    ("safetensors", "out.safetensors", "dcp", "dcp2"),
    ("dcp", "src", "orbax", "step-0"),
    ("orbax", "step-0", "dcp", "dcp3"),
)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--size", type=int, default=8192)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench_convert_"))
    try:
        state = {f"model.layers.{i}.weight": torch.randn(args.size, args.size, dtype=torch.bfloat16) for i in range(args.layers)}
        nbytes = sum(t.nbytes for t in state.values())
        dcp.save(state, checkpoint_id=work / "src", no_dist=True)
        del state
        floor = nbytes / DISK_READ_BYTES_PER_S + nbytes / DISK_WRITE_BYTES_PER_S + nbytes / DISK_READ_BYTES_PER_S
        rows = []
        for source_format, source, target_format, target in DIRECTIONS:
            start = time.perf_counter()
            result = convert(work / source, source_format, work / target, target_format)
            seconds = time.perf_counter() - start
            assert result.ok, f"{source_format} -> {target_format}: checksums differ"
            rows.append(Result(f"{source_format} -> {target_format}", seconds, floor, unit="s",
                               extra={"GB/s": nbytes / seconds * 1e-9}))  # fmt: skip
        start = time.perf_counter()
        from safetensors.torch import save_file

        full = {f"model.layers.{i}.weight": torch.empty(args.size, args.size, dtype=torch.bfloat16) for i in range(args.layers)}
        dcp.load(full, checkpoint_id=work / "src", no_dist=True)
        save_file(full, work / "peer.safetensors")
        peer_s = time.perf_counter() - start
        rows[0] = dataclasses.replace(rows[0], peer=peer_s, peer_name="dcp.load + save_file")
        rows.append(Result("peer: dcp.load + save_file", peer_s, None, unit="s", note="holds the whole model in memory"))
        title = (f"bench_convert, {args.layers} x [{args.size}, {args.size}] bf16 = {nbytes / 2 * 1e-9:.2f}B parameters, "
                 f"{nbytes / 1e9:.2f} GB")  # fmt: skip
        report(title, rows, args.json)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
