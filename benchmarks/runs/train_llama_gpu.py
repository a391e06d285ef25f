"""Benchmark: the ~125M Llama-style model trained 3000 steps, bf16 and each Hopper-native FP8 recipe.

For each recipe (off = bf16 GEMMs, delayed, current, block) and seed, one `python -m torchside.train`
process on the synthetic corpus: bf16 parameters with fp32 master weights in FusedAdam, the same data
and schedule. Runs go one per GPU at a time (on 2 GPUs two at once), so tokens/s is each run's own;
`--runs-per-gpu K` shares each GPU among K runs (a step of this size keeps an H200 mostly idle between
launches, so K runs finish sooner than K runs in turn; tokens/s is then a shared GPU's, marked so).
Printed per recipe: runs, tokens/s (after the first 100 steps: Triton
compilation and autotuning), wall time, final loss (mean of the last 50 steps; with several seeds
their mean and range), its distance to bf16's, NaN/Inf counts (losses and parameters); then
`curves.png` with every loss curve. Exit code 1 if any run has a non-finite value or a recipe's mean
final loss ends more than 2% above bf16's (issue 15's bar). Why seeds: two block runs of the same
code and seed ended 1.1% and 4.4% above bf16 (a run-dependent kernel order at step 34, amplified by
the early plateau), so one run per recipe cannot decide a 2% bar. MXFP8 and NVFP4 are not run: Hopper
has no tensor cores for them (fp8kernels.gemm emulates them).

Size per step: 8 sequences of 512 tokens (4096 tokens), about 6 * 128M * 4096 = 3.2 TFLOP (plus
attention). At this size the step is bound by kernel launches, not by the GPU's arithmetic.
`--cuda-graphs` replays each run's step as a CUDA graph (torchside.train's flag: the same numbers as
the eager step, several times faster at this size). `--report-only` redraws the table and curves
from the run directories of an earlier call (e.g. when the recipes ran in two device calls).

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/runs/train_llama_gpu.py [--recipes off,delayed --seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import torch

from torchside.recipe import recipe_names
from torchside.train import LOG_NAME, plot_loss_curves

REPORTED_RECIPES = ("off", "delayed", "current", "block")  # the table's rows, beside any other trained now
LOSS_BAR = 0.02  # final loss within 2% of bf16's
SUMMARY_NAME = "summary.json"


@dataclass(frozen=True)
class Run:
    recipe: str
    seed: int
    summary: dict  # torchside.train's summary line, plus wall_s
    losses: list[float]


def _run_dir(root: Path, recipe: str, seed: int) -> Path:
    return root / recipe / f"seed{seed}"


def _command(recipe: str, seed: int, args, out: Path) -> list[str]:
    flags = {
        "--config": "125m", "--steps": args.steps, "--batch-size": args.batch_size, "--seq-len": args.seq_len,
        "--lr": args.lr, "--warmup-steps": min(150, args.steps // 10), "--recipe": recipe, "--dtype": "bf16",
        "--device": "cuda", "--seed": seed, "--out": out, "--log-every": 100,
    }  # fmt: skip
    graphs = ["--cuda-graphs"] if args.cuda_graphs else []
    pairs = (str(x) for pair in flags.items() for x in pair)
    return [sys.executable, "-m", "torchside.train", *pairs, "--no-progress", *graphs]


def train_all(recipes: list[str], seeds: list[int], args, root: Path) -> None:
    """Each (recipe, seed) in its own process, at most `args.runs_per_gpu` per GPU at a time; writes summary.json."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the children get one of the devices this process sees
    gpus = visible.split(",") if visible else [str(g) for g in range(torch.cuda.device_count())]
    waiting, running = [(recipe, seed) for seed in seeds for recipe in recipes], {}
    while waiting or running:
        while waiting and len(running) < len(gpus) * args.runs_per_gpu:
            (recipe, seed), gpu = waiting.pop(0), min(gpus, key=list(running.values()).count)  # the least shared
            out = _run_dir(root, recipe, seed)
            out.mkdir(parents=True, exist_ok=True)
            env = os.environ | {"CUDA_VISIBLE_DEVICES": gpu}
            log = (out / "stdout.log").open("w")
            command = _command(recipe, seed, args, out)
            process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            running[(process, f"{recipe} seed {seed}", out, time.perf_counter())] = gpu
            print(f"started {recipe} seed {seed} on GPU {gpu}", flush=True)
        time.sleep(1)
        for key in [k for k in running if k[0].poll() is not None]:
            process, name, out, started = key
            del running[key]
            lines = (out / "stdout.log").read_text().splitlines()
            summary_line = next((line for line in reversed(lines) if line.startswith("{")), None)
            if summary_line is None:
                print(f"{name}: exit {process.returncode} without a summary; last lines:", *lines[-15:], sep="\n")
                continue
            measured = {"wall_s": time.perf_counter() - started, "runs_per_gpu": args.runs_per_gpu}
            summary = json.loads(summary_line) | measured
            (out / SUMMARY_NAME).write_text(json.dumps(summary))
            print(f"finished {name}: {summary['tokens_per_s']:.0f} tokens/s, {summary['wall_s']:.0f} s", flush=True)


def load_runs(recipes: list[str], root: Path) -> dict[str, list[Run]]:
    """recipe -> its finished runs (every seed directory with a summary), in seed order."""
    runs: dict[str, list[Run]] = {}
    for recipe in recipes:
        for summary_path in sorted((root / recipe).glob(f"seed*/{SUMMARY_NAME}"), key=lambda p: int(p.parent.name[4:])):
            records = [json.loads(line) for line in (summary_path.parent / LOG_NAME).read_text().splitlines() if line]
            seed = int(summary_path.parent.name[4:])
            runs.setdefault(recipe, []).append(
                Run(recipe, seed, json.loads(summary_path.read_text()), [r["loss"] for r in records])
            )
    return runs


def report(runs: dict[str, list[Run]], recipes: list[str], root: Path) -> int:
    """Print the table, draw the curves; 1 if a recipe is missing, non-finite or misses the loss bar."""
    finals = {recipe: [run.summary["final_loss"] for run in recipe_runs] for recipe, recipe_runs in runs.items()}
    baseline = fmean(finals["off"]) if "off" in finals else None
    print(f"{'recipe':8} {'runs':>4} {'steps':>6} {'tokens/s':>10} {'per GPU':>7} {'wall s':>7} {'final loss':>10} "
          f"{'range':>15} {'vs bf16':>8} {'NaN/Inf':>8}")  # fmt: skip
    failed = False
    for recipe in recipes:
        if recipe not in runs:
            print(f"{recipe:8} did not finish")
            failed = True
            continue
        recipe_runs, final = runs[recipe], fmean(finals[recipe])
        relative = (final - baseline) / baseline if baseline else float("nan")
        nonfinite = sum(run.summary["nonfinite_losses"] + run.summary["nonfinite_params"] for run in recipe_runs)
        failed |= nonfinite > 0 or (recipe != "off" and not relative <= LOSS_BAR)
        spread = f"{min(finals[recipe]):.4f}-{max(finals[recipe]):.4f}"
        print(
            f"{recipe:8} {len(recipe_runs):4d} {min(len(run.losses) for run in recipe_runs):6d} "
            f"{fmean([run.summary['tokens_per_s'] for run in recipe_runs]):10.0f} "
            f"{max(run.summary.get('runs_per_gpu', 1) for run in recipe_runs):7d} "
            f"{fmean([run.summary['wall_s'] for run in recipe_runs]):7.1f} {final:10.4f} {spread:>15} "
            f"{relative:+8.2%} {nonfinite:8d}"
        )
    if runs:
        floor = next(iter(runs.values()))[0].summary["loss_floor"]
        curves = {
            f"{'bf16' if run.recipe == 'off' else run.recipe} seed {run.seed}": run.losses
            for recipe_runs in runs.values() for run in recipe_runs
        }  # fmt: skip
        plot_loss_curves(curves, root / "curves.png", floor=floor)
        print(f"corpus loss floor {floor:.4f}; curves in {root / 'curves.png'}")
    print(f"verdict {'FAIL' if failed else 'PASS'} (bar: no NaN/Inf, mean final loss within {LOSS_BAR:.0%} of bf16's)")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1.5e-3)
    parser.add_argument("--recipes", default=",".join(REPORTED_RECIPES), help="comma-separated recipes to train now")
    parser.add_argument("--seeds", default="0", help="comma-separated seeds: each recipe trains once per seed")
    parser.add_argument("--runs-per-gpu", type=int, default=1, help="runs sharing one GPU (tokens/s then shared)")
    parser.add_argument("--cuda-graphs", action="store_true", help="replay each run's step as a CUDA graph")
    parser.add_argument("--report-only", action="store_true", help="only report the runs already in --out")
    parser.add_argument("--out", default="runs/train_llama_gpu")
    args = parser.parse_args()
    root, recipes = Path(args.out), args.recipes.split(",")
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds {args.seeds!r}: pass comma-separated integers, e.g. 0,1,2")
    if args.runs_per_gpu < 1:
        parser.error(f"--runs-per-gpu {args.runs_per_gpu}: pass 1 or more")
    unknown = sorted(set(recipes) - set(recipe_names()))
    if unknown:
        parser.error(f"--recipes: unknown {unknown}; pick from {', '.join(recipe_names())}")
    if not args.report_only:
        if not torch.cuda.is_available():
            parser.error("no CUDA device: run on a GPU machine, or pass --report-only")
        device = f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}"
        print(f"{datetime.date.today()}  {device}  torch {torch.__version__}")
        train_all(recipes, seeds, args, root)
    reported = list(dict.fromkeys([*REPORTED_RECIPES, *recipes]))
    return report(load_runs(reported, root), reported, root)


if __name__ == "__main__":
    raise SystemExit(main())
