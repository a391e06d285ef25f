"""Checkpoint save/load throughput of a ~1B-parameter FP8 model on one GPU, against the disk.

Model: 8 LayerNormMLP(4096, 16384) blocks built under quantized_model_init(Float8CurrentScaling):
1.07B parameters, FP8 weights (1 byte each on disk: the transposed columnwise copy is rebuilt, not
saved) plus bf16 norms and biases with FusedAdam states. Throughput = checkpoint bytes on disk /
wall time. Floor: the disk, measured in the same run (2 GiB written with fsync; read back after
dropping it from the page cache). The checkpoint files are dropped from the page cache before each
load, so a load reads the disk. Also: the blocking time of an async save (thread and process:
what the training loop waits for) and its total time, and a load without the CRC32 pass.

Usage (repository root, CUDA machine): PYTHONPATH=. python3 benchmarks/bench/bench_checkpoint.py [--dir /local/disk/tmp]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import Result, argument_parser, drop_from_page_cache, report
from torchside.autocast import quantized_model_init
from torchside.checkpoint import load, save
from torchside.modules import LayerNormMLP
from torchside.optim import FusedAdam
from torchside.quantization import QuantizedTensor
from torchside.recipe import Float8CurrentScaling

BLOCKS, HIDDEN, FFN = 8, 4096, 16384
DISK_PROBE_BYTES = 2 << 30


def _drop_from_page_cache(directory: Path) -> None:
    drop_from_page_cache([path for path in directory.rglob("*") if path.is_file()])


def _disk_gbps(directory: Path) -> tuple[float, float]:
    """(write, read) GB/s of one 2 GiB file, fsynced, read back from the disk (not the page cache)."""
    path = directory / "disk_probe.bin"
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(DISK_PROBE_BYTES // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = DISK_PROBE_BYTES / (time.perf_counter() - start) / 1e9
    _drop_from_page_cache(directory)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    read = DISK_PROBE_BYTES / (time.perf_counter() - start) / 1e9
    path.unlink()
    return write, read


def _model() -> tuple[torch.nn.Module, FusedAdam]:
    with quantized_model_init(recipe=Float8CurrentScaling()):
        model = torch.nn.Sequential(
            *[LayerNormMLP(HIDDEN, FFN, params_dtype=torch.bfloat16, device="cuda") for _ in range(BLOCKS)]
        )
    high_precision = [p for p in model.parameters() if not isinstance(p, QuantizedTensor)]
    optimizer = FusedAdam(high_precision, lr=1e-4, master_weights=True)
    for p in high_precision:
        p.grad = torch.zeros_like(p)
    optimizer.step()  # creates the states
    return model, optimizer


def _bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def _row(operation: str, seconds: float, size: int, disk_gbps: float) -> Result:
    """Checkpoint bytes over wall time against the disk's rate measured in the same run."""
    return Result(operation, size / seconds / 1e9, disk_gbps, unit="GB/s", extra={"seconds": seconds})


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench_checkpoint_", dir=args.dir))
    if not dist.is_initialized():  # an async "process" save's daemon joins the default group
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        write_gbps, read_gbps = _disk_gbps(root)
        model, optimizer = _model()
        params = sum(p.numel() for p in model.parameters())
        rows = []
        torch.cuda.synchronize()
        start = time.perf_counter()
        path = save(root / "sync", model, optimizer, step=1).path
        seconds = time.perf_counter() - start
        size = _bytes(path)
        rows.append(_row("save (sync)", seconds, size, write_gbps))
        for mode in ("thread", "process"):
            start = time.perf_counter()
            handle = save(root / mode, model, optimizer, step=1, async_mode=mode)
            blocked = time.perf_counter() - start
            handle.wait()
            total = time.perf_counter() - start
            rows.append(_row(f"save ({mode}) blocking", blocked, size, write_gbps))
            rows.append(_row(f"save ({mode}) total", total, size, write_gbps))
        for verify in (True, False):
            _drop_from_page_cache(root / "sync")
            torch.cuda.synchronize()
            start = time.perf_counter()
            load(root / "sync", model, optimizer, verify=verify)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            label = "load (CRC32 checked)" if verify else "load (verify=False)"
            rows.append(_row(label, seconds, size, read_gbps))
        notes = [f"disk: write {write_gbps:.2f} GB/s, read {read_gbps:.2f} GB/s (2 GiB, fsync, page cache dropped): "
                 "the floor of each row"]  # fmt: skip
        title = f"bench_checkpoint, {params / 1e9:.2f}B parameters, checkpoint {size / 1e9:.2f} GB"
        report(title, rows, args.json, notes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
