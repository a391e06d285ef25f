"""Profile: where a TP=2 sequence-parallel TransformerLayer step spends its time, bf16 against FP8.

The layer, inputs and cases are benchmarks/bench/bench_tp_layer.py's (Llama-3-8B's layer, [S=4096, B=2], each rank
holding S/2 rows). After the bench's warmup, each case runs STEPS steps under torch.profiler, each
from an idle GPU (barrier, synchronize) as the bench times them. Per case, rank 0 prints:

- per step, for each rank: wall ms (start to the end of the GPU work), host ms (until step() returns,
  i.e. everything is queued), GPU busy ms (union of this rank's kernels and copies), of which NCCL;
- the top 15 GPU kernels by total time over the profiled steps (rank 0);
- per step (rank 0): NCCL kernels by name, host syncs (cudaStreamSynchronize, cudaDeviceSynchronize,
  cudaEventSynchronize), device-to-host copies, kernel launches, cudaMalloc and cudaFree calls.

Reading it: host ms close to wall ms with GPU busy well below: the host cannot queue the work fast
enough (launch-bound); GPU busy close to wall: the kernels themselves (the top 15 say which); a host
sync per step stalls the host on the GPU; NCCL ms far above what the bytes take: a rank waits in a
collective for the other (the small amax all-reduces show up as AllReduce kernels).

Run on 2 GPUs:  torchrun --nproc-per-node 2 benchmarks/profile/profile_tp_layer.py [--trace-dir DIR]
(from the repository root, PYTHONPATH=.); --trace-dir writes one Chrome trace per case and rank.
Smoke test on CPU (gloo, no GPU events):  torchrun --nproc-per-node 2 benchmarks/profile/profile_tp_layer.py
--device cpu --hidden 64 --heads 4 --groups 2 --ffn 128 --seq 32 --batch 2
"""

from __future__ import annotations

import argparse
import collections
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.bench.bench_tp_layer import CASES, TP, WARMUP, Case, train_step
from benchmarks.harness import environment_line
from torchside.modules import ModuleConfig, TransformerConfig, TransformerLayer
from torchside.modules.rotary import RotaryPositionEmbedding

STEPS = 3
TOP_KERNELS = 15
HOST_SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
ALLOCATIONS = ("cudaMalloc", "cudaFree")
GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto activity types of what a GPU runs
HOST_RANGE, DEVICE_RANGE = "profiled step", "profiled step and its GPU work"


@dataclass
class StepSummary:
    """One profiled step of one rank, in ms."""

    wall: float
    host: float
    gpu_busy: float
    nccl: float


def _layer(args, case: Case, device: torch.device) -> TransformerLayer:
    module_config = ModuleConfig(tp_group=dist.group.WORLD, sequence_parallel=True, fp8_all_gather=case.fp8_all_gather)
    config = TransformerConfig(normalization="RMSNorm", activation="swiglu", bias=False, module_config=module_config)
    torch.manual_seed(0)
    return TransformerLayer(args.hidden, args.ffn, args.heads, num_gqa_groups=args.groups,
                            params_dtype=torch.bfloat16, device=device, config=config)  # fmt: skip


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _profile_case(layer, case: Case, inputs, device: torch.device):
    """(wall ms per step, the profiler's raw events) of STEPS steps after WARMUP unprofiled ones."""
    for _ in range(WARMUP):
        train_step(layer, case, *inputs)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(STEPS):
            dist.barrier()
            _synchronize(device)
            start = time.perf_counter()
            with record_function(DEVICE_RANGE):  # the GPU is idle at its start and done at its end
                with record_function(HOST_RANGE):
                    train_step(layer, case, *inputs)
                _synchronize(device)
            walls.append((time.perf_counter() - start) * 1e3)
    return walls, prof


def _windows(events, name: str) -> list[tuple[int, int]]:
    """The host-side [start, end) of every record_function range `name` (CUDA adds a GPU-side twin: skipped)."""
    return sorted((e.start_ns(), e.end_ns()) for e in events if e.name() == name and e.device_type() == DeviceType.CPU)


def _in_window(event, window: tuple[int, int]) -> bool:
    return window[0] <= event.start_ns() < window[1]


def _is_gpu_work(event) -> bool:
    """A kernel, copy or memset on the GPU (not the GPU-side span of a record_function range)."""
    if event.device_type() != DeviceType.CUDA:
        return False
    kind = getattr(event, "activity_type", None)  # an older torch has none: then skip our ranges by name
    return kind() in GPU_WORK if kind is not None else event.name() not in (HOST_RANGE, DEVICE_RANGE)


def _is_nccl(event) -> bool:
    return "nccl" in event.name().lower()


def _union_ms(intervals: list[tuple[int, int]]) -> float:
    """Total length of the union of [start, end) intervals, in ms."""
    total, reach = 0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total / 1e6


def _summarize(walls: list[float], prof) -> tuple[list[StepSummary], dict]:
    """Per-step times of this rank, and rank 0's tables (top kernels, per-step counts)."""
    events = prof.profiler.kineto_results.events()
    host_windows, device_windows = _windows(events, HOST_RANGE), _windows(events, DEVICE_RANGE)
    gpu = [e for e in events if _is_gpu_work(e)]
    host = [e for e in events if e.device_type() == DeviceType.CPU]
    steps, counts, kernel_ns = [], collections.Counter(), collections.Counter()
    for wall, host_window, device_window in zip(walls, host_windows, device_windows, strict=True):
        step_gpu = [e for e in gpu if _in_window(e, device_window)]
        nccl = [e for e in step_gpu if _is_nccl(e)]
        steps.append(StepSummary(
            wall=wall,
            host=(host_window[1] - host_window[0]) / 1e6,
            gpu_busy=_union_ms([(e.start_ns(), e.end_ns()) for e in step_gpu]),
            nccl=_union_ms([(e.start_ns(), e.end_ns()) for e in nccl]),
        ))  # fmt: skip
        for e in step_gpu:
            kernel_ns[e.name()] += e.duration_ns()
            if _is_nccl(e):
                counts[f"NCCL kernel {e.name()}"] += 1
            if e.name().startswith("Memcpy DtoH"):
                counts["device-to-host copies"] += 1
        for e in host:
            if e.name() in HOST_SYNCS + LAUNCHES + ALLOCATIONS and _in_window(e, host_window):
                counts["kernel launches" if e.name() in LAUNCHES else e.name()] += 1
    per_step = {name: count / STEPS for name, count in sorted(counts.items())}
    top = [(name, ns / 1e6 / STEPS) for name, ns in kernel_ns.most_common(TOP_KERNELS)]
    return steps, {"per step": per_step, "top kernels": top}


def _print_case(case: Case, steps_by_rank: list[list[StepSummary]], tables: dict) -> None:
    print(f"\n## {case.name}")
    print(f"{'rank':>4} {'step':>4} {'wall ms':>9} {'host ms':>9} {'GPU busy ms':>12} {'NCCL ms':>9}")
    for rank, steps in enumerate(steps_by_rank):
        for i, s in enumerate(steps):
            print(f"{rank:>4} {i:>4} {s.wall:>9.2f} {s.host:>9.2f} {s.gpu_busy:>12.2f} {s.nccl:>9.2f}")
    print(f"top {TOP_KERNELS} GPU kernels of rank 0 (ms per step):")
    for name, ms in tables["top kernels"]:
        print(f"  {ms:8.3f}  {name[:110]}")
    print("rank 0, per step:")
    for name, count in (dict.fromkeys(HOST_SYNCS, 0.0) | tables["per step"]).items():
        print(f"  {count:8.1f}  {name[:110]}")


def main() -> None:
    """Profile every case of bench_tp_layer on this rank; rank 0 prints."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("hidden", 4096), ("heads", 32), ("groups", 8), ("ffn", 14336), ("seq", 4096), ("batch", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--trace-dir", type=Path, default=None, help="write a Chrome trace per case and rank here")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 benchmarks/profile/profile_tp_layer.py")
    rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        if dist.get_world_size() != TP:
            raise SystemExit(f"profile_tp_layer runs TP={TP}: start it with --nproc-per-node {TP}")
        device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
        generator = torch.Generator(device=device).manual_seed(1)
        shape = (args.seq, args.batch, args.hidden)
        x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator).chunk(TP)[rank].contiguous()
        dy = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator).chunk(TP)[rank].contiguous()
        freqs = RotaryPositionEmbedding(args.hidden // args.heads).to(device)(args.seq)
        inputs = (x.requires_grad_(), dy, freqs)
        if rank == 0:
            print(f"# profile_tp_layer, {environment_line()}\n# TransformerLayer H={args.hidden} N={args.heads} G={args.groups} "
                  f"F={args.ffn}, [S={args.seq}, B={args.batch}], TP={TP} sequence parallel; {STEPS} profiled steps "
                  f"after {WARMUP}")  # fmt: skip
        for case in CASES:
            layer = _layer(args, case, device)
            walls, prof = _profile_case(layer, case, inputs, device)
            steps, tables = _summarize(walls, prof)
            if args.trace_dir is not None:
                args.trace_dir.mkdir(parents=True, exist_ok=True)
                slug = "".join(c if c.isalnum() else "_" for c in case.name)
                prof.export_chrome_trace(str(args.trace_dir / f"{slug}.rank{rank}.json"))
            steps_by_rank = [None] * TP
            dist.all_gather_object(steps_by_rank, steps)
            if rank == 0:
                _print_case(case, steps_by_rank, tables)
            del layer, prof
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
