"""Profile: where bench_mlp's LayerNormMLP step spends its GPU time, per recipe, kernel by kernel.

The module, inputs and step are benchmarks/bench/bench_mlp.py's (hidden 8192, ffn 28672, 16384 tokens,
forward + backward). After two warm-up steps, STEPS steps run under torch.profiler; per recipe it prints
the GPU time per step (the sum of kernel times: kernels of one stream do not overlap), split into the
GEMMs (cuBLAS/cuBLASLt and our Triton GEMM kernels) and everything else, then the top kernels with
their launches and ms per step. This is the measurement behind a recipe's distance from its GEMM floor.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/profile/profile_mlp.py [--recipes off,current,block]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench.bench_mlp import CASES_BY_KEY, _build, _fp8_step
from benchmarks.harness import environment_line

GEMM_MARKS = ("gemm", "nvjet", "cutlass", "sm90_xmma", "_scaled_mm_kernel")  # cuBLAS(Lt) kernel names, our Triton GEMM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default="off,current,block")
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=14)
    args = parser.parse_args()
    print(f"# profile_mlp, {environment_line()}")
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    x.requires_grad_()
    dy = torch.randn_like(x)
    for name in args.recipes.split(","):
        case = CASES_BY_KEY[name]
        module = _build(case, args)
        step = _fp8_step(module, case.recipe)
        for _ in range(2):  # compile and autotune
            step(x, dy)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                step(x, dy)
            torch.cuda.synchronize()
        per_kernel = collections.defaultdict(lambda: [0, 0.0])  # name -> [launches, us]
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                per_kernel[event.name][0] += 1
                per_kernel[event.name][1] += event.device_time
        total = sum(us for _, us in per_kernel.values()) / args.steps / 1e3
        gemm_us = sum(us for k, (_, us) in per_kernel.items() if any(m in k.lower() for m in GEMM_MARKS))
        gemm = gemm_us / args.steps / 1e3
        launches = sum(n for n, _ in per_kernel.values()) / args.steps
        print(f"\n=== {case.name}: GPU {total:.2f} ms/step in {launches:.0f} kernels; GEMMs {gemm:.2f} ms, "
              f"the rest {total - gemm:.2f} ms")  # fmt: skip
        for kernel, (n, us) in sorted(per_kernel.items(), key=lambda item: -item[1][1])[: args.top]:
            print(f"{us / args.steps / 1e3:8.3f} ms {n / args.steps:5.0f}x  {kernel[:110]}")
        del module, step
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
