"""Benchmark: Llama training tokens/s, eager, CUDA-graphed and compiled steps, bf16 and FP8 recipes, in one call.

Each (config, recipe, mode) is one `torchside.train.train` run in this process, as `python -m torchside.train
--config C --recipe R --dtype bf16 --device cuda [--cuda-graphs | --compile]` runs it: synthetic corpus, batch
8 x 512 tokens, FusedAdam with fp32 masters, losses flushed every --log-every steps. tokens/s is train's own:
the steps after the first --log-every (Triton compilation, autotuning, torch.compile's compilation and,
graphed, the 3 warm-up steps and the capture are before). Eager steps use train_step; graphed ones
GraphedTrainStep (capturable FusedAdam, the lr on the device, the whole step one graph replay, issue 32);
compiled ones train_step with each TransformerLayer compiled by torch.compile (fullgraph, `--compile-mode`;
issue 45), the embedding, head, loss and optimizer eager. Each compiled run starts from an empty Dynamo cache.

Floor: the GEMM flops only, 6 x parameters per token (forward + backward; attention's S^2 term and the
embedding lookup left out) at the bf16 peak for bf16 and the FP8 peak for FP8 recipes (benchmarks/harness.py's H200
figures), so a launch-bound step shows as a small fraction. Peer: bf16 in the same mode (eager, graphed or compiled):
"vs peer" is the FP8 speed-up. Extra columns: "vs eager", tokens/s of a graphed or compiled run over the eager
run of the same recipe, and the final loss (mean of the last 50 steps; the modes of a recipe train the same way,
not to the bit: tests/torchside/test_cuda_graphs.py checks graphed against eager bitwise, and
tests/torchside/test_compile_train.py compiled against eager, with the aot_eager backend).

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/bench/bench_train_step.py [--configs 125m,1b --steps 60]
"""

from __future__ import annotations

import gc

import torch
import torch._dynamo

from benchmarks.harness import PEAK_FLOPS, Result, argument_parser, report
from torchside.models.llama import LLAMA_CONFIGS
from torchside.recipe import recipe_names
from torchside.train import COMPILE_MODES, TrainOptions, train

MODES = ("eager", "graphed", "compiled")


def run(config: str, recipe: str, mode: str, args) -> dict:
    flags = {"graphed": {"cuda_graphs": True}, "compiled": {"compile": True, "compile_mode": args.compile_mode}}
    options = TrainOptions(
        config=config, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        warmup_steps=min(10, args.steps), recipe=recipe, dtype="bf16", device="cuda", log_every=args.log_every,
        progress=False, **flags.get(mode, {}),
    )  # fmt: skip
    torch._dynamo.reset()  # every compiled run compiles its own graphs: no recompile limit, no dynamic shapes
    summary = train(options)
    print(f"{config} {recipe} {mode}: {summary.tokens_per_s:.0f} tokens/s, final loss {summary.final_loss:.4f}", flush=True)
    gc.collect()
    torch.cuda.empty_cache()
    return {"tokens_per_s": summary.tokens_per_s, "final_loss": summary.final_loss,
            "nonfinite": summary.nonfinite_losses + summary.nonfinite_params}  # fmt: skip


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--configs", default="125m", help="comma-separated torchside.models LLAMA_CONFIGS names")
    parser.add_argument("--recipes", default="off,current,block", help="comma-separated; off = bf16 GEMMs")
    parser.add_argument("--modes", default="eager,graphed,compiled", help="comma-separated, of: %(default)s")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES, help="torch.compile's mode")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    args = parser.parse_args()
    configs, recipes, modes = args.configs.split(","), args.recipes.split(","), args.modes.split(",")
    for name, chosen, allowed in (("configs", configs, LLAMA_CONFIGS), ("recipes", recipes, recipe_names()),
                                  ("modes", modes, MODES)):  # fmt: skip
        if set(chosen) - set(allowed):
            parser.error(f"--{name}: unknown {sorted(set(chosen) - set(allowed))}; pick from {', '.join(allowed)}")
    if args.steps <= args.log_every:
        parser.error(f"--steps {args.steps} must exceed --log-every {args.log_every}: the first ones are not timed")
    if not torch.cuda.is_available():
        raise SystemExit("bench_train_step needs a CUDA device")
    rows = []
    for config in configs:
        flop_per_token = 6 * LLAMA_CONFIGS[config].num_parameters()
        measured = {(recipe, mode): run(config, recipe, mode, args) for recipe in recipes for mode in modes}
        for (recipe, mode), m in measured.items():
            peak = PEAK_FLOPS["bf16" if recipe == "off" else "fp8"]
            peer = measured.get(("off", mode), {}).get("tokens_per_s") if recipe != "off" else None
            eager = measured.get((recipe, "eager"), {}).get("tokens_per_s")
            vs_eager = m["tokens_per_s"] / eager if mode != "eager" and eager else None
            rows.append(Result(
                f"{config} {'bf16' if recipe == 'off' else recipe}", m["tokens_per_s"], peak / flop_per_token,
                unit="tokens/s", provider=mode, peer=peer, peer_name=f"bf16 {mode}" if peer else "",
                extra={"vs eager": vs_eager, "final loss": m["final_loss"], "NaN/Inf": m["nonfinite"]},
            ))  # fmt: skip
    tokens = args.batch_size * args.seq_len
    note = (f"batch {args.batch_size} x {args.seq_len} = {tokens} tokens/step, {args.steps} steps, timed after "
            f"{args.log_every}; floor = GEMM flops (6 x params per token) at the bf16 / FP8 peak")  # fmt: skip
    notes = [note]
    if "compiled" in modes:
        notes.append(f"compiled: each TransformerLayer by torch.compile(fullgraph=True, mode={args.compile_mode!r})")
    report("bench_train_step", rows, args.json, notes)


if __name__ == "__main__":
    main()
