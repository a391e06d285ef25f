"""Sweep: launch configurations of each quantize kernel on a 16384x8192 bf16 tensor, to set the autotune lists.

For every case of bench_quantize (the same table), each configuration below is forced as the only
one its kernel may take, checked byte-for-byte against fp8kernels.reference, and timed; the table
gives ms and the fraction of the as-run floor (bench_quantize.floors_ms) at the copy bandwidth
measured in the same run. The fp8 cases also time their best configuration with the bit-operation
cast on in-range tiles (HARDWARE_CAST off), which shows what the GPU's cvt buys. The kernels have
no loops, so num_stages changes nothing and is not swept; register caps (maxnreg) are.
Stops starting new configurations after --budget-s seconds (compiles dominate: ~1-3 s each).

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/sweep/sweep_quantize.py [--cases tensorwise,mxfp8] [--budget-s 100]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time
from unittest import mock

import torch
import triton

from benchmarks.bench.bench_quantize import Case, cases, floors_ms, identical
from benchmarks.harness import device_ms, environment_line
from fp8kernels import quantize as triton_quantize
from fp8kernels import reference
from fp8kernels._backend import autotune_configs
from fp8kernels.quantize import configs


# kernel name -> the configurations swept. Tensorwise keeps PACK4's four row repeats per thread
# (BLOCK_M = 16 * num_warps at BLOCK_K 128, 32 * num_warps at 64).
GRIDS = {
    "amax": configs((64, 256, 4), (128, 256, 8), (64, 512, 8), (32, 256, 2), (128, 128, 4), (32, 512, 4), (256, 256, 16), (64, 1024, 8)),
    "tensorwise": configs((64, 128, 4), (128, 128, 8), (128, 64, 4), (32, 128, 2), (256, 128, 16)),
    "blockwise": [
        {"BLOCK": 128, "num_warps": w, **cap}
        for w, cap in ((8, {}), (16, {}), (8, {"maxnreg": 128}), (16, {"maxnreg": 64}), (4, {}),
                       (8, {"maxnreg": 96}), (8, {"maxnreg": 80}), (4, {"maxnreg": 168}), (4, {"maxnreg": 128}))
    ],
    "mxfp8": configs((64, 64, 4), (128, 128, 16), (128, 128, 8), (64, 128, 4), (128, 64, 4), (32, 64, 2)),
    "nvfp4": configs(
        (64, 64, 4), (128, 128, 16), (128, 128, 8), (64, 128, 4), (128, 64, 4), (32, 64, 2), (64, 64, 8), (128, 64, 8),
        (64, 128, 8), (64, 64, 4, 72), (64, 64, 4, 64), (128, 64, 4, 96), (128, 64, 4, 80), (64, 128, 4, 96),
        (64, 128, 4, 80),
    ),
}
_KERNEL_OF = {
    "quantize_tensorwise": "tensorwise", "quantize_blockwise": "blockwise", "quantize_mxfp8": "mxfp8",
    "quantize_nvfp4": "nvfp4",
}
_FP8 = ("tensorwise", "blockwise", "mxfp8")  # the kernels with a HARDWARE_CAST switch


@functools.cache
def _forced(name: str, config: tuple) -> object:
    """Kernel `name` autotuned over the one configuration `config` (a sorted item tuple)."""
    kernel, _, key = triton_quantize._KERNELS[name]
    return triton.autotune(configs=autotune_configs([dict(config)]), key=key)(kernel)


@contextlib.contextmanager
def _configured(name: str, config: dict, hardware_cast: bool | None = None):
    """Within: kernel `name` launches with `config` only (the other kernels autotune as usual), and
    the fp8 kernels cast in-range tiles with the GPU's cvt or not (None: as fp8kernels.quantize decides)."""
    default_kernel = triton_quantize._kernel
    forced = _forced(name, tuple(sorted(config.items())))

    def kernel(kernel_name: str, tuned: bool):
        return (forced, {}) if kernel_name == name else default_kernel(kernel_name, tuned)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(triton_quantize, "_kernel", kernel))
        if hardware_cast is not None:
            stack.enter_context(mock.patch.object(triton_quantize, "_hardware_cast", lambda _: hardware_cast))
        yield


def _bench(fn) -> float:
    return device_ms(fn, rep=40)


def _describe(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


class _Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    def spent(self) -> bool:
        return time.monotonic() - self.start > self.seconds


def _sweep_amax(x: torch.Tensor, copy_bytes_per_s: float, budget: _Budget) -> None:
    """The global-amax launch of current scaling and NVFP4 alone: a pure read of x (floor: x at copy speed)."""
    floor_ms = x.numel() * x.element_size() / copy_bytes_per_s * 1e3
    expected = x.abs().amax().float().item()
    print(f"\n## amax (the first launch of current scaling and NVFP4; floor: one read of x, {floor_ms:.3f} ms)")
    for config in GRIDS["amax"]:
        if budget.spent():
            print(f"   {_describe(config):<44} skipped: --budget-s spent")
            continue
        with _configured("amax", config):
            run = functools.partial(triton_quantize._global_amax, x, hadamard=False)
            exact = run()[:1].view(torch.float32).item() == expected
            ms = _bench(run)
        print(f"   {_describe(config):<44}{ms:>8.3f} ms{floor_ms / ms:>6.0%}  {'exact' if exact else 'AMAX DIFFERS'}")


def _sweep_case(case: Case, x: torch.Tensor, copy_bytes_per_s: float, budget: _Budget) -> str | None:
    """Time every configuration of the case's kernel; the best one's summary line."""
    name = _KERNEL_OF[case.function]
    expected = getattr(reference, case.function)(x, **case.kwargs)
    quantize = functools.partial(getattr(triton_quantize, case.function), x, **case.kwargs)
    results = []
    print(f"\n## {case.name} ({name}; 'of copy': the as-run floor at the measured copy bandwidth / ms)")
    for config in GRIDS[name]:
        if budget.spent():
            print(f"   {_describe(config):<44} skipped: --budget-s spent")
            continue
        with _configured(name, config):
            q = quantize()
            exact = identical(q, expected)
            ms = _bench(quantize)
        of_copy = floors_ms(case, x, q, copy_bytes_per_s)[1] / ms
        results.append((ms, of_copy, config))
        print(f"   {_describe(config):<44}{ms:>8.3f} ms{of_copy:>6.0%}  {'exact' if exact else 'BYTES DIFFER'}")
    torch.cuda.empty_cache()
    if not results:
        return None
    ms, of_copy, config = min(results, key=lambda r: r[0])
    line = f"{case.name:<28}{ms:>8.3f} ms{of_copy:>6.0%} of copy (target {case.target:.0%})  {_describe(config)}"
    if name in _FP8 and not budget.spent():
        with _configured(name, config, hardware_cast=False):
            quantize()
            bit_ms = _bench(quantize)
        line += f"  | bit-op casts: {bit_ms:.3f} ms"
    return line


def main() -> None:
    """Sweep every case (or --cases, matched against case and kernel names) and print the best per case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case or kernel names (amax too)")
    parser.add_argument("--budget-s", type=float, default=100.0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sweep_quantize needs a CUDA device (it times compiled Triton kernels)")
    budget = _Budget(args.budget_s)
    x = torch.randn(args.rows, args.cols, device="cuda", dtype=torch.bfloat16)
    copy_ms = _bench(lambda: x.clone())
    copy_bytes_per_s = 2 * x.numel() * x.element_size() / copy_ms * 1e3
    print(f"# sweep_quantize, {environment_line()}\n# x {args.rows}x{args.cols} bf16; "
          f"copy {copy_ms:.3f} ms = {copy_bytes_per_s / 1e12:.2f} TB/s")
    wanted = [w for w in args.cases.split(",") if w]
    if not wanted or "amax" in wanted:
        _sweep_amax(x, copy_bytes_per_s, budget)
    best = []
    for case in cases(x.device):
        if not wanted or any(w in case.name or w == _KERNEL_OF[case.function] for w in wanted):
            best.append(_sweep_case(case, x, copy_bytes_per_s, budget))
    print("\n# best per case (fp8 cases: then the same config with the bit-operation casts on in-range tiles)")
    print("\n".join(line for line in best if line))
    print(f"# {time.monotonic() - budget.start:.0f} s")


if __name__ == "__main__":
    main()
