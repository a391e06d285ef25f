"""Where a training step's time goes on the host: the Llama model's step per recipe, host vs GPU.

For each recipe: the step's wall time (synchronized), the host time to issue it (no sync: when the
host takes as long as the wall, the step is launch-bound and the GPU waits), the host-device syncs
one step makes (torch.cuda.set_sync_debug_mode), and cProfile's top functions by own time over a
few steps. The model and data are torchside.train's (125m: 12 layers, 4096 tokens per step).

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/profile/profile_step.py [--recipes off,current --config 125m]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import pstats
import time
import warnings

import torch

from benchmarks.harness import environment_line
from torchside.corpus import SyntheticCorpus
from torchside.models.llama import LLAMA_CONFIGS
from torchside.recipe import recipe_from_name
from torchside.train import TrainOptions, build_model, build_optimizer, train_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="off,delayed,current,block")
    parser.add_argument("--config", default="125m")
    parser.add_argument("--top", type=int, default=22)
    parser.add_argument("--sort", default="tottime", help="pstats orders, comma-separated (e.g. tottime,cumulative)")
    args = parser.parse_args()
    print(f"# profile_step, {environment_line()}")
    for name in args.recipes.split(","):
        options = TrainOptions(config=args.config, batch_size=8, seq_len=512, recipe=name, dtype="bf16", device="cuda")
        model, _ = build_model(options)
        optimizer = build_optimizer(model, options)
        corpus = SyntheticCorpus(LLAMA_CONFIGS[options.config].vocab_size, seed=0)
        recipe = recipe_from_name(name)

        step = functools.partial(train_step, model, optimizer, corpus, options, None, recipe)  # the loop's own step

        for i in range(8):  # compile and autotune
            step(i)
        torch.cuda.synchronize()
        n, host = 10, 0.0
        started = time.perf_counter()
        for i in range(n):
            t = time.perf_counter()
            step(i)
            host += time.perf_counter() - t
        torch.cuda.synchronize()
        wall_ms, host_ms = (time.perf_counter() - started) * 1e3 / n, host * 1e3 / n
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            step(0)
            torch.cuda.set_sync_debug_mode(0)
        syncs = sorted({str(w.message).splitlines()[0][:100] for w in caught})
        profiler = cProfile.Profile()
        profiler.enable()
        for i in range(5):
            step(i)
        torch.cuda.synchronize()
        profiler.disable()
        print(f"\n=== {name}: wall {wall_ms:.1f} ms/step, host {host_ms:.1f} ms/step issuing it; "
              f"{len(caught)} host-device syncs in one step {syncs}")
        for order in args.sort.split(","):
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(args.top)
            print(f"--- by {order}")
            print("\n".join(line for line in text.getvalue().splitlines() if line.strip())[-6000:])
        del model, optimizer, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
