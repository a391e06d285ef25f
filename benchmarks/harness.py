"""What every benchmark shares: the H200 floors, the timers, the environment line, and the result rows.

Floors are the H200 figures below (PEAK_FLOPS & co.), measured on the device machine. A benchmark prints, per
row: the measured figure, its floor, the fraction of the floor reached, and the peer measured in the
same run, as a markdown table for benchmarks/RESULTS.md and, with --json, as JSON.

Timing. `device_ms` is the one device timer. A Python call that launches kernels costs the host tens
to hundreds of microseconds; timed with triton.testing.do_bench alone, a call whose host time exceeds
its device time measures the host (the H200 runs of 2026-12-01 read 0.35 ms for a current-scaling
quantize whose kernels take 0.21 ms). So by default the call is captured once in a CUDA graph and
do_bench times the graph's replays: the GPU never waits for Python. do_bench clears L2 before each
replay by writing 256 MB; a flush by a read reads 3-8 us lower per kernel (RESULTS.md, 2026-12-01),
and the tables keep the write flush, since after a real producer L2 is dirty too. Calls that cannot
be captured (autograd steps, optimizer steps, anything that syncs with the host) pass graph=False:
do_bench then times the eager calls, events around each, which is what a training step pays (the
host hides only while the GPU is the slower side). `host_us` is what a call costs the CPU, back to
back. `wall_ms` times what no device event can (JAX steps, several processes, the disk): the median
wall time of a call that returns only when its work is done. torch and triton load only when a timer
runs, so the pure parts (rows, fractions, the environment line) work anywhere.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import io
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

# --- floors (measured on one H200) -------------------------------------------------------------------------------
PEAK_FLOPS = {"bf16": 788e12, "fp8": 1425e12}  # flop/s at 8192^3: bf16 matmul, FP8 torch._scaled_mm tensorwise
PEAK_TFLOPS = {name: flops / 1e12 for name, flops in PEAK_FLOPS.items()}
COPY_BYTES_PER_S = 4.24e12  # a device copy, bytes read + written
NCCL_ALL_GATHER_BYTES_PER_S = 250e9  # NCCL all-gather on 2 GPUs
DISK_READ_BYTES_PER_S, DISK_WRITE_BYTES_PER_S = 1.0e9, 1.1e9  # local disk, direct I/O, 8 GiB

# units where less is better (a time); every other unit is a rate (TFLOP/s, GB/s, tokens/s)
TIME_UNITS = {"s", "ms", "us"}


# --- timers ---------------------------------------------------------------------------------------------------
def device_ms(
    fn: Callable[[], object], *, graph: bool = True, grad_to_none: Sequence | None = None, warmup: int = 10,
    rep: int = 100,
) -> float:  # fmt: skip
    """Median device milliseconds of fn(), after one warm call (compile, autotune) outside the timing.

    graph=True: fn is captured in a CUDA graph and do_bench times its replays (fn must be capturable:
    no host synchronization, no CPU reads of device values). graph=False: do_bench times fn's eager
    calls; grad_to_none's .grad are reset before each (a training step that accumulates gradients).
    warmup and rep are do_bench's, in milliseconds of calls.
    """
    import torch
    from triton.testing import do_bench

    fn()
    torch.cuda.synchronize()
    if not graph:
        return do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, return_mode="median")
    cuda_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cuda_graph):
        fn()
    try:
        return do_bench(cuda_graph.replay, warmup=warmup, rep=rep, return_mode="median")
    finally:
        del cuda_graph
        torch.cuda.empty_cache()


def host_us(fn: Callable[[], object], calls: int = 100) -> float:
    """Host microseconds per call of fn(), calls issued back to back (the GPU catches up afterwards)."""
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def wall_ms(
    fn: Callable[[], object], *, repeats: int = 10, warmup: int = 1, before: Callable[[], object] | None = None
) -> float:
    """Median wall milliseconds of fn() over `repeats` calls, after `warmup` untimed ones.

    fn must return only when its work is done (torch.cuda.synchronize, jax.block_until_ready);
    before(), if given, runs untimed ahead of each timed call (a barrier that lines the ranks up).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def slowest_rank(value: float) -> float:
    """The largest of every rank's value (torch.distributed: a step takes as long as its slowest rank)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    largest = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return largest.item()


# --- the page cache -------------------------------------------------------------------------------------------
def drop_from_page_cache(paths: Sequence[Path]) -> None:
    """Write the files' dirty pages back, then ask the kernel to evict them (posix_fadvise DONTNEED).

    The kernel may ignore the advice (tmpfs keeps files in memory by nature): `cached_fraction` says what stayed.
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: Sequence[Path]) -> float:
    """The fraction of the files' pages in the page cache (mincore on a private mapping; touches no page)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        pages = (size + page - 1) // page
        flags = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as file, mmap.mmap(file.fileno(), size, access=mmap.ACCESS_COPY) as mapping:
            anchor = ctypes.c_char.from_buffer(mapping)  # the mapping's address (released before it closes)
            try:
                failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), flags)
            finally:
                del anchor
        if failed:
            raise OSError(ctypes.get_errno(), f"mincore on {path} failed")
        resident += int((np.frombuffer(flags, np.uint8) & 1).sum())
        total += pages
    return resident / total if total else 0.0


def sequential_read_s(paths: Sequence[Path], chunk: int = 64 << 20) -> float:
    """Wall seconds to read the files once, in order, by `chunk`-byte reads into one buffer (the disk floor's probe)."""
    buffer = bytearray(chunk)
    start = time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as file:
            while file.readinto(buffer):
                pass
    return time.perf_counter() - start


# --- the environment line -------------------------------------------------------------------------------------
def versions(packages: Sequence[str] = ("torch", "triton", "jax")) -> dict[str, str]:
    """Installed versions of the packages (from their metadata: nothing is imported); missing ones left out."""
    found = {}
    for package in packages:
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def device_name() -> str:
    """The accelerator as '<count>x <name>': torch's CUDA devices, else JAX's if jax is loaded, else 'no GPU'."""
    if "torch" in sys.modules and sys.modules["torch"].cuda.is_available():
        cuda = sys.modules["torch"].cuda
        return f"{cuda.device_count()}x {cuda.get_device_name()}"
    if "jax" in sys.modules:
        devices = sys.modules["jax"].devices()
        if devices[0].platform == "gpu":
            return f"{len(devices)}x {devices[0].device_kind}"
    return "no GPU"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the device machine's copy
        return ""


def format_environment(
    when: datetime.datetime, device: str, package_versions: dict[str, str], commit: str, argv: Sequence[str]
) -> str:
    """'2026-12-02 05:00 UTC, 1x NVIDIA H200, torch 2.11.0, triton 3.6.0, commit abc1234, `python ...`'."""
    parts = [f"{when:%Y-%m-%d %H:%M} UTC", device, *(f"{name} {version}" for name, version in package_versions.items())]
    parts.append(f"commit {commit or 'unknown'} (+ working tree)")
    return ", ".join(parts) + f", `{' '.join(['python3', *argv])}`"


def environment_line() -> str:
    """Date, GPU, versions, commit and command: the header of a RESULTS.md entry."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return format_environment(now, device_name(), versions(), _commit(), sys.argv)


# --- result rows ----------------------------------------------------------------------------------------------
def fraction_of_floor(measured: float | None, floor: float | None, unit: str) -> float | None:
    """How close `measured` comes to its floor (1.0 at it): floor / measured for a time, measured / floor for a rate."""
    if measured is None or floor is None or measured <= 0 or floor <= 0:
        return None
    return floor / measured if unit in TIME_UNITS else measured / floor


def speedup(measured: float | None, peer: float | None, unit: str) -> float | None:
    """How many times better than the peer: peer / measured for a time, measured / peer for a rate."""
    if measured is None or peer is None or measured <= 0 or peer <= 0:
        return None
    return peer / measured if unit in TIME_UNITS else measured / peer


@dataclass(frozen=True)
class Result:
    """One row: what was measured against its floor and the peer of the same run (None: not available)."""

    case: str
    measured: float | None
    floor: float | None
    unit: str = "ms"
    provider: str = ""  # who ran it, where a case has several rows (ours, cuBLAS, eager...)
    peer: float | None = None  # the peer's figure in the same unit, same run
    peer_name: str = ""
    extra: dict[str, object] = field(default_factory=dict)  # more columns: host us, peak GiB, rel. error...
    note: str = ""

    @property
    def fraction(self) -> float | None:
        return fraction_of_floor(self.measured, self.floor, self.unit)

    @property
    def vs_peer(self) -> float | None:
        return speedup(self.measured, self.peer, self.unit)

    def as_dict(self) -> dict:
        return asdict(self) | {"fraction": self.fraction, "vs_peer": self.vs_peer}


def format_value(value: object) -> str:
    """A cell: floats to 3 significant digits without exponents in the usual ranges; None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, float):
        return str(value)
    if math.isnan(value) or math.isinf(value):
        return str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1e-3 or magnitude == 0:
        return f"{value:.3g}" if magnitude < 1 else f"{value:.{max(0, 2 - int(math.log10(magnitude)))}f}"
    return f"{value:.2e}"


def table_rows(results: Sequence[Result]) -> tuple[list[str], list[list[str]]]:
    """(columns, cells) of the results' table; a column that is empty in every row is left out."""
    unit = results[0].unit if len({r.unit for r in results}) == 1 else ""
    suffix = f" {unit}" if unit else ""
    extra_names = list(dict.fromkeys(name for r in results for name in r.extra))
    columns = {
        "case": [r.case for r in results],
        "provider": [r.provider or None for r in results],
        f"measured{suffix}": [r.measured if unit else _with_unit(r.measured, r.unit) for r in results],
        f"floor{suffix}": [r.floor if unit else _with_unit(r.floor, r.unit) for r in results],
        "of floor": [None if r.fraction is None else f"{r.fraction:.0%}" for r in results],
        f"peer{suffix}": [r.peer if unit else _with_unit(r.peer, r.unit) for r in results],
        "peer is": [r.peer_name or None for r in results],
        "vs peer": [None if r.vs_peer is None else f"{r.vs_peer:.2f}x" for r in results],
        **{name: [r.extra.get(name) for r in results] for name in extra_names},
        "note": [r.note or None for r in results],
    }
    kept = {name: cells for name, cells in columns.items() if name == "case" or any(c is not None for c in cells)}
    return list(kept), [[format_value(cells[i]) for cells in kept.values()] for i in range(len(results))]


def _with_unit(value: float | None, unit: str) -> str | None:
    return None if value is None else f"{format_value(value)} {unit}"


def markdown_table(results: Sequence[Result]) -> str:
    """The results as a markdown table, drawn by rich (wide enough never to wrap; blank edge lines dropped)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    columns, cells = table_rows(results)
    table = Table(*columns, box=box.MARKDOWN)
    for row in cells:
        table.add_row(*row)
    buffer = io.StringIO()
    width = sum(max(len(text) for text in (name, *column)) + 3 for name, column in zip(columns, zip(*cells))) + 1
    Console(file=buffer, width=width, highlight=False).print(table)
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines() if line.strip())


def failure_note(what: str, error: BaseException) -> str:
    """A note for a row that could not run: `what` and the innermost error's first line (torch.compile wraps the
    exception our code raised in pages of its own)."""
    while error.__cause__ is not None:
        error = error.__cause__
    first_line = str(error).partition("\n")[0]
    return f"{what}: failed ({type(error).__name__}: {first_line})"


def report(title: str, results: Sequence[Result], json_path: str | None = None, notes: Sequence[str] = ()) -> None:
    """Print the title, the environment line, the results as a markdown table (rich) and the notes; with
    json_path, also write them there as JSON (title, environment, rows with fraction and vs_peer)."""
    environment = environment_line()
    print(f"## {title}\n\n{environment}\n\n{markdown_table(results)}")
    if notes:
        print("\n" + "\n".join(notes))
    if json_path:
        document = {"title": title, "environment": environment, "results": [r.as_dict() for r in results]}
        Path(json_path).write_text(json.dumps(document, indent=1, default=str) + "\n")


def argument_parser(doc: str | None) -> argparse.ArgumentParser:
    """The script's parser: its docstring's first line as description, and --json PATH for report()."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    parser.add_argument("--json", metavar="PATH", help="also write the result rows to PATH as JSON")
    return parser
