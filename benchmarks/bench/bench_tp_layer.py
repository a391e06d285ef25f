"""Benchmark: a TP=2 sequence-parallel TransformerLayer training step on 2 GPUs, bf16 against FP8.

The layer is Llama-3-8B's (bench_transformer_layer.py's): hidden 4096, 32 heads in 8 KV groups, ffn
14336, SwiGLU, RMSNorm, no bias, causal, bf16 parameters; [S=4096, B=2] tokens, each rank holding
S/2 sequence rows. One step = forward + backward. Collectives per step: all-gather the normalized
tokens before QKV and before fc1, reduce-scatter after proj and fc2, and their backward twins.
Cases (the bf16 case is the peer, measured in the same run):

- bf16 (FP8 off): every collective carries bf16;
- Float8CurrentScaling, FP8 all-gather: each rank casts its tokens (amax all-reduced over TP) and
  the two forward all-gathers carry E4M3 bytes;
- Float8CurrentScaling, bf16 all-gather (`ModuleConfig(fp8_all_gather=False)`): gather bf16, then cast.

Printed per case: the slowest rank's median ms, the floor (GEMM flops per GPU at the measured peak,
attention's at the bf16 peak, plus the bytes the collectives bring to each GPU at benchmarks/harness.py's
~250 GB/s), the fraction of it, the speedup over bf16, and the output's relative error against bf16
(the two FP8 cases must agree exactly: `equal`).

Times: benchmarks.harness.wall_ms of a synchronized step, every rank lined up by a barrier first.

Run on 2 GPUs:  PYTHONPATH=. torchrun --nproc-per-node 2 benchmarks/bench/bench_tp_layer.py [--seq 4096 --batch 2]
(from the repository root)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks.harness import (
    NCCL_ALL_GATHER_BYTES_PER_S, PEAK_FLOPS, Result, argument_parser, report, slowest_rank, wall_ms,
)  # fmt: skip
from bridge.numerics import relative_error
from torchside.autocast import fp8_autocast
from torchside.modules import ModuleConfig, TransformerConfig, TransformerLayer
from torchside.modules.rotary import RotaryPositionEmbedding
from torchside.quantization import FALLBACK_CALLS
from torchside.recipe import Float8CurrentScaling, Recipe

TP = 2
WARMUP, STEPS = 3, 10


@dataclass(frozen=True)
class Case:
    name: str
    recipe: Recipe | None
    fp8_all_gather: bool = True


CASES = [
    Case("bf16 (FP8 off)", None),
    Case("current, FP8 all-gather", Float8CurrentScaling()),
    Case("current, bf16 all-gather", Float8CurrentScaling(), fp8_all_gather=False),
]
SAME_OUTPUT = (1, 2)  # FP8 all-gather on and off: the same arithmetic, equal outputs


def _floor_ms(case: Case, args) -> float:
    """GEMMs at their peak + attention at the bf16 peak + collective bytes at the NCCL rate, per GPU."""
    tokens, d, f = args.seq * args.batch, args.hidden, args.ffn
    head_dim = d // args.heads
    projections = d * (args.heads + 2 * args.groups) * head_dim + args.heads * head_dim * d + 3 * d * f
    gemm_flops = 3 * 2 * tokens * projections / TP
    attention_flops = 3 * 4 * args.batch * args.seq**2 * args.heads * head_dim / 2 / TP  # causal: half
    half = tokens * d / TP  # values the other rank contributes to each collective
    forward_gathers = 2 * half * (1 if case.recipe is not None and case.fp8_all_gather else 2)
    comm_bytes = forward_gathers + 6 * 2 * half  # 2 forward reduce-scatters, 4 backward collectives, bf16
    gemm_peak = PEAK_FLOPS["bf16" if case.recipe is None else "fp8"]
    seconds = gemm_flops / gemm_peak + attention_flops / PEAK_FLOPS["bf16"] + comm_bytes / NCCL_ALL_GATHER_BYTES_PER_S
    return seconds * 1e3


def train_step(layer, case: Case, x, dy, freqs) -> torch.Tensor:
    """One forward + backward of the layer under the case's recipe (gradients dropped); the output."""
    with fp8_autocast(enabled=case.recipe is not None, recipe=case.recipe, amax_reduction_group=dist.group.WORLD):
        y = layer(x, rotary_pos_emb=freqs)
    y.backward(dy)
    for p in layer.parameters():
        p.grad = None
    return y.detach()


def _step_ms(layer, case: Case, x, dy, freqs) -> tuple[float, torch.Tensor]:
    """Median wall time of one synchronized step (every rank starts together), and the step's output."""
    for _ in range(WARMUP):
        output = train_step(layer, case, x, dy, freqs)
    ms = wall_ms(lambda: (train_step(layer, case, x, dy, freqs), torch.cuda.synchronize()), repeats=STEPS, warmup=0,
                 before=lambda: (dist.barrier(), torch.cuda.synchronize()))  # fmt: skip
    return ms, output


def main() -> None:
    """Time every case on this rank; rank 0 prints the table (the lead copies it into benchmarks/RESULTS.md)."""
    parser = argument_parser(__doc__)
    for name, default in (("hidden", 4096), ("heads", 32), ("groups", 8), ("ffn", 14336), ("seq", 4096), ("batch", 2)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc-per-node 2 benchmarks/bench/bench_tp_layer.py")
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    try:
        if dist.get_world_size() != TP:
            raise SystemExit(f"bench_tp_layer runs TP={TP}: start it with --nproc-per-node {TP}")
        device = torch.device("cuda", rank)
        generator = torch.Generator(device=device).manual_seed(1)
        shape = (args.seq, args.batch, args.hidden)
        x = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator).chunk(TP)[rank].contiguous()
        dy = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=generator).chunk(TP)[rank].contiguous()
        x.requires_grad_()
        freqs = RotaryPositionEmbedding(args.hidden // args.heads).to(device)(args.seq)
        rows, outputs = [], []
        for case in CASES:
            module_config = ModuleConfig(tp_group=dist.group.WORLD, sequence_parallel=True,
                                         fp8_all_gather=case.fp8_all_gather)  # fmt: skip
            config = TransformerConfig(normalization="RMSNorm", activation="swiglu", bias=False,
                                       module_config=module_config)  # fmt: skip
            torch.manual_seed(0)  # every rank draws the same init: the same shards in every case
            layer = TransformerLayer(args.hidden, args.ffn, args.heads, num_gqa_groups=args.groups,
                                     params_dtype=torch.bfloat16, device=device, config=config)  # fmt: skip
            torch.cuda.reset_peak_memory_stats()
            ms, output = _step_ms(layer, case, x, dy, freqs)
            slowest = slowest_rank(ms)
            outputs.append(output)
            peak = torch.cuda.max_memory_allocated() / 2**30
            rows.append((slowest, peak, relative_error(output, outputs[0])))
            del layer
        same = torch.equal(outputs[SAME_OUTPUT[0]], outputs[SAME_OUTPUT[1]])
        if rank == 0:
            _print(args, rows, same)
    finally:
        dist.destroy_process_group()


def _print(args, rows, same: bool) -> None:
    baseline_ms = rows[0][0]
    results = [
        Result(case.name, ms, _floor_ms(case, args), peer=baseline_ms, peer_name="bf16 (FP8 off)",
               extra={"peak GiB": peak, "rel. error": error})
        for case, (ms, peak, error) in zip(CASES, rows, strict=True)
    ]  # fmt: skip
    first, second = (CASES[i].name for i in SAME_OUTPUT)
    notes = [f"{first} vs {second}: outputs {'equal' if same else 'DIFFER'}",
             f"QuantizedTensor ops run on dequantized values: {sum(FALLBACK_CALLS.values())} (must be 0)"]  # fmt: skip
    title = (f"bench_tp_layer, TransformerLayer H={args.hidden} N={args.heads} G={args.groups} F={args.ffn} swiglu "
             f"RMSNorm, [S={args.seq}, B={args.batch}], TP={TP} sequence parallel, bf16 params, forward + backward")  # fmt: skip
    report(title, results, args.json, notes)


if __name__ == "__main__":
    main()
