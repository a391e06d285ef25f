"""Benchmark: a TP=2 sequence-parallel LayerNormMLP step on 2 GPUs, FP8 all-gather on vs off.

Each of 2 processes (spawned here, NCCL, no torchrun) holds half the tokens of a [S, B, H] bf16
input and half of fc1/fc2 (column/row parallel). One step = forward + backward: all-gather the
normalized tokens before fc1, reduce-scatter after fc2, and the reverse in backward. Cases:

- bf16 (FP8 off): the activation all-gather carries bf16 (the peer, measured in the same run);
- FP8, all-gather in FP8: each rank casts its tokens (Float8CurrentScaling: amax all-reduced over
  TP; DelayedScaling: the region's world amax) and gathers the E4M3 bytes (1 byte per value);
- FP8, all-gather in bf16 (`ModuleConfig(fp8_all_gather=False)`): gather bf16, then cast everything.

Printed per case: the slowest rank's median ms, the floor (the step's GEMM flops per GPU at the
measured peak, plus the bytes its collectives move per GPU at benchmarks/harness.py's ~250 GB/s NCCL
all-gather rate), the fraction of it, and the output's relative error against the bf16 case
(FP8 all-gather on and off must agree exactly: `equal`).

Times: benchmarks.harness.wall_ms of a synchronized step, every rank lined up by a barrier first.

Run on a 2-GPU machine:  PYTHONPATH=. python3 benchmarks/bench/bench_tp.py [--hidden 8192 --ffn 28672 --seq 8192 --batch 2]
Smoke-test the script on CPU:  PYTHONPATH=. python3 benchmarks/bench/bench_tp.py --device cpu --hidden 64 --ffn 128 --seq 32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.harness import (
    NCCL_ALL_GATHER_BYTES_PER_S, PEAK_FLOPS, Result, argument_parser, report, slowest_rank, wall_ms,
)  # fmt: skip
from bridge.numerics import relative_error
from torchside.autocast import fp8_autocast
from torchside.modules import LayerNormMLP, ModuleConfig
from torchside.quantization import FALLBACK_CALLS
from torchside.recipe import DelayedScaling, Float8CurrentScaling, Recipe

TP = 2
WARMUP, STEPS = 5, 20


@dataclass(frozen=True)
class Case:
    name: str
    recipe: Recipe | None
    fp8_all_gather: bool = True


CASES = [
    Case("bf16 (FP8 off)", None),
    Case("current, FP8 all-gather", Float8CurrentScaling()),
    Case("current, bf16 all-gather", Float8CurrentScaling(), fp8_all_gather=False),
    Case("delayed, FP8 all-gather", DelayedScaling()),
    Case("delayed, bf16 all-gather", DelayedScaling(), fp8_all_gather=False),
]
SAME_OUTPUT = ((1, 2), (3, 4))  # (FP8 all-gather, bf16 all-gather) pairs: the same arithmetic, equal outputs


def _comm_bytes(case: Case, tokens: int, hidden: int) -> float:
    """Bytes one GPU receives per step: the fc1 input gather, fc2's reduce-scatter, and their backward twins."""
    half = tokens * hidden / TP  # values another rank contributes to each collective
    gathered = half * (1 if case.recipe is not None and case.fp8_all_gather else 2)
    return gathered + 3 * 2 * half  # forward gather; fwd reduce-scatter, bwd gather, bwd reduce-scatter in bf16


def _step_ms(module, case: Case, x, dy, group) -> tuple[float, torch.Tensor]:
    """Median wall time of one synchronized step (every rank starts together), and the step's output."""

    def step():
        with fp8_autocast(enabled=case.recipe is not None, recipe=case.recipe, amax_reduction_group=group):
            y = module(x)
        y.backward(dy)
        for p in module.parameters():
            p.grad = None
        return y.detach()

    for _ in range(WARMUP):
        output = step()
    ms = wall_ms(lambda: (step(), _synchronize(x.device)), repeats=STEPS, warmup=0,
                 before=lambda: (dist.barrier(), _synchronize(x.device)))  # fmt: skip
    return ms, output


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(rank: int, port: int, args, results) -> None:
    device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=TP)
    try:
        group = dist.group.WORLD
        generator = torch.Generator(device=device).manual_seed(1)
        shape = (args.seq, args.batch, args.hidden)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        x = torch.randn(shape, device=device, dtype=dtype, generator=generator).chunk(TP)[rank].contiguous()
        dy = torch.randn(shape, device=device, dtype=dtype, generator=generator).chunk(TP)[rank].contiguous()
        x.requires_grad_()
        rows, outputs = [], []
        for case in CASES:
            config = ModuleConfig(tp_group=group, sequence_parallel=True, fp8_all_gather=case.fp8_all_gather)
            torch.manual_seed(0)  # every rank draws the same init: the same shards in every case
            module = LayerNormMLP(args.hidden, args.ffn, params_dtype=dtype, device=device, config=config)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            ms, output = _step_ms(module, case, x, dy, group)
            slowest = slowest_rank(ms)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            outputs.append(output)
            rows.append([slowest, peak, relative_error(output, outputs[0])])
            del module
        same = [torch.equal(outputs[on], outputs[off]) for on, off in SAME_OUTPUT]
        if rank == 0:
            results.put((rows, same, sum(FALLBACK_CALLS.values())))
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Spawn 2 ranks, time every case and print the table (the lead copies it into benchmarks/RESULTS.md)."""
    parser = argument_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--port", type=int, default=29511)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a gloo smoke run of the script")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < TP:
        raise SystemExit(f"bench_tp needs {TP} CUDA devices, found {torch.cuda.device_count()}")
    context = mp.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=_rank_main, args=(r, args.port, args, results)) for r in range(TP)]
    for p in processes:
        p.start()
    rows, same, fallbacks = results.get()
    for p in processes:
        p.join()
        if p.exitcode:
            raise SystemExit(f"a rank exited with code {p.exitcode}")
    tokens = args.seq * args.batch
    flops_per_gpu = 12 * tokens * args.hidden * args.ffn / TP
    baseline_ms = rows[0][0]
    results = []
    for case, (ms, peak, error) in zip(CASES, rows, strict=True):
        comm = _comm_bytes(case, tokens, args.hidden)
        flops_floor = flops_per_gpu / PEAK_FLOPS["bf16" if case.recipe is None else "fp8"]
        floor_ms = (flops_floor + comm / NCCL_ALL_GATHER_BYTES_PER_S) * 1e3
        extra = {"comm MB": comm / 1e6, "peak GiB": peak, "rel. error": error}
        results.append(Result(case.name, ms, floor_ms, peer=baseline_ms, peer_name="bf16 (FP8 off)", extra=extra))
    notes = [f"{CASES[on].name} vs {CASES[off].name}: outputs {'equal' if equal else 'DIFFER'}"
             for (on, off), equal in zip(SAME_OUTPUT, same, strict=True)]  # fmt: skip
    notes.append(f"QuantizedTensor ops run on dequantized values: {fallbacks} (must be 0)")
    where = "" if args.device == "cuda" else ", CPU (gloo smoke run)"
    title = (f"bench_tp{where}, LayerNormMLP H={args.hidden} F={args.ffn} gelu, [S={args.seq}, B={args.batch}] tokens, "
             f"TP={TP} sequence parallel, forward + backward")  # fmt: skip
    report(title, results, args.json, notes)


if __name__ == "__main__":
    main()
