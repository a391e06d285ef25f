"""Where the JAX twin's TransformerLayer step spends its GPU time, beside the plain-JAX bf16 peer.

Issue 46: the twin's FP8 step is slower than plain JAX's bf16 one. This runs bench_jax_layer's steps
(the twin under each recipe, the peer) under jax.profiler with a Perfetto trace, sums each GPU kernel's
time over the traced steps and prints the top kernels per step, grouped by kind (GEMM, FP8 GEMM,
fusion, copy/transpose, reduction...), and writes each step's optimized HLO beside the traces so a
kernel can be traced back to its fusion.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/profile/profile_jax_layer.py [--recipes current,block]
    [--out DIR] [--top 25]    (bench_jax_layer's shape options apply: --seq 2048 --batch 4 ...)
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib

import jax

from benchmarks.bench.bench_jax_layer import build_plain_step, build_step, compile_step
from benchmarks.harness import argument_parser
from twinspec.recipe import recipe_from_name

STEPS = 3


def kernel_times(trace_dir: pathlib.Path) -> dict[str, float]:
    """Microseconds per GPU kernel name summed over the trace (complete events on device threads)."""
    (trace,) = trace_dir.rglob("perfetto_trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))
    events = events["traceEvents"] if isinstance(events, dict) else events
    device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
                   and "/device:GPU" in str(e.get("args", {}).get("name", ""))}  # fmt: skip
    totals: dict[str, float] = collections.defaultdict(float)
    for event in events:
        if event.get("ph") == "X" and event.get("pid") in device_pids:
            totals[event["name"]] += float(event.get("dur", 0))
    return totals


def kind(name: str) -> str:
    lowered = name.lower()
    if "f8" in lowered or "e4m3" in lowered or "fp8" in lowered:
        return "FP8 GEMM" if any(k in lowered for k in ("gemm", "xmma", "cutlass", "matmul", "sm90")) else "fp8 other"
    if any(k in lowered for k in ("gemm", "xmma", "cutlass", "matmul", "cublas", "sm90")):
        return "GEMM"
    if "transpose" in lowered or "copy" in lowered:
        return "copy/transpose"
    if "reduce" in lowered:
        return "reduction"
    if "fusion" in lowered or "loop" in lowered or "triton" in lowered:
        return "fusion"
    return "other"


def profile(name: str, step, arguments, out: pathlib.Path, top: int) -> None:
    compiled = compile_step(name, step, arguments)
    slug = name.replace(" ", "_").replace(",", "").replace(":", "")
    (out / f"{slug}.hlo.txt").write_text(compiled.as_text())
    jax.block_until_ready(compiled(*arguments))
    trace_dir = out / f"trace_{slug}"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(STEPS):
            jax.block_until_ready(compiled(*arguments))
    totals = kernel_times(trace_dir)
    per_step = sum(totals.values()) / STEPS / 1e3
    by_kind: dict[str, float] = collections.defaultdict(float)
    for kernel, us in totals.items():
        by_kind[kind(kernel)] += us / STEPS / 1e3
    print(f"\n## {name}: {per_step:.2f} ms of GPU kernels per step")
    print("| kind | ms/step | share |\n|---|---|---|")
    for k, ms in sorted(by_kind.items(), key=lambda item: -item[1]):
        print(f"| {k} | {ms:.2f} | {ms / per_step:.0%} |")
    print("| kernel | kind | ms/step |\n|---|---|---|")
    for kernel, us in sorted(totals.items(), key=lambda item: -item[1])[:top]:
        print(f"| {kernel[:90]} | {kind(kernel)} | {us / STEPS / 1e3:.3f} |")


def main() -> None:
    parser = argument_parser(__doc__)
    for name, default in (("hidden", 4096), ("heads", 32), ("groups", 8), ("ffn", 14336), ("seq", 2048), ("batch", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--recipes", default="current,block", help="comma-separated recipe names for the twin")
    parser.add_argument("--out", default="out/profile_jax_layer", help="traces and optimized HLO go here")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for recipe in args.recipes.split(","):
        profile(f"twin {recipe}", *build_step(args, recipe_from_name(recipe)), out, args.top)
    profile("peer plain JAX bf16", *build_plain_step(args), out, args.top)


if __name__ == "__main__":
    main()
