"""Benchmark: Triton quantizers (fp8kernels.quantize) on a 16384x8192 bf16 tensor, against the copy floor.

For each scheme: the device time (benchmarks.harness.device_ms: CUDA graph replays, so Python
never holds the GPU back), the host time a call costs, the floor (bytes that one pass must move
/ 4.24 TB/s, the H200 copy bandwidth in benchmarks/harness.py), the fraction of the floor reached, the floor
for the bytes the kernels really move (current scaling and NVFP4 read x twice: the global amax
must be known before the first cast), and the peer measured in the same run: torch eager doing
the same math (a plain amax + scale + cast + transpose for tensorwise, fp8kernels.reference
otherwise). Every Triton result is also checked byte-for-byte against the reference. Two-pass
cases also show the global-amax launch alone ("amax ms"); the tile each kernel's autotuner kept
closes the table.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/bench/bench_quantize.py [--rows 16384 --cols 8192] [--json PATH]
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from benchmarks.harness import COPY_BYTES_PER_S, Result, argument_parser, device_ms, host_us, report
from fp8kernels import quantize as triton_quantize
from fp8kernels import reference


@dataclass(frozen=True)
class Case:
    name: str
    function: str  # the same name in fp8kernels.quantize and fp8kernels.reference
    kwargs: dict = field(default_factory=dict)
    passes_over_x: int = 1  # 2 where a global amax is needed before the cast
    target: float = 0.70  # fraction of the one-pass floor the issue asks for


def cases(device: torch.device) -> list[Case]:
    """The timed cases (benchmarks/sweep/sweep_quantize.py sweeps the same ones)."""
    delayed_scale = torch.tensor([0.37], device=device)
    both = {"rowwise": True, "columnwise": True}
    return [
        Case("tensorwise e4m3 current", "quantize_tensorwise", both, passes_over_x=2, target=0.85),
        Case("tensorwise e4m3 delayed", "quantize_tensorwise", {"scale": delayed_scale, **both}, target=0.85),
        Case("block 1x128 e4m3", "quantize_blockwise", {"block": (1, 128), **both}),
        Case("block 128x128 e4m3", "quantize_blockwise", {"block": (128, 128), **both}),
        Case("mxfp8 e4m3", "quantize_mxfp8", both),
        Case("nvfp4 1x16", "quantize_nvfp4", both, passes_over_x=2),
        Case("nvfp4 16x16 (weights)", "quantize_nvfp4", {"block": (16, 16), **both}, passes_over_x=2),
        Case(
            "nvfp4 1x16 RHT+SR (grads)", "quantize_nvfp4", {"hadamard": True, "stochastic_seed": 7, **both},
            passes_over_x=2,
        ),
    ]


def _eager_tensorwise(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The unfused torch peer of DESIGN.md: amax, scale, cast, transpose, each its own kernel."""
    amax = x.abs().amax().float()
    scale = 448.0 / amax if scale is None else scale
    data = (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data, data.t().contiguous(), amax


_PEER_NAMES = {"quantize_tensorwise": "eager amax, scale, cast, transpose"}  # the others: fp8kernels.reference


def _peer(case: Case, x: torch.Tensor) -> Callable[[], object]:
    if case.function == "quantize_tensorwise":
        return lambda: _eager_tensorwise(x, case.kwargs.get("scale"))
    return lambda: getattr(reference, case.function)(x, **case.kwargs)


def _peer_reference(case: Case, x: torch.Tensor) -> reference.Quantized:
    return getattr(reference, case.function)(x, **case.kwargs)


def _amax_ms(case: Case, x: torch.Tensor) -> float:
    """The first launch of a two-pass case alone: the global amax (of RHT(x.T) too for the wgrad case)."""
    hadamard = bool(case.kwargs.get("hadamard"))
    return device_ms(lambda: triton_quantize._global_amax(x, hadamard=hadamard))


def _output_bytes(q: reference.Quantized) -> int:
    buffers = (q.data, q.scale_inv, q.columnwise_data, q.columnwise_scale_inv)
    return sum(b.numel() * b.element_size() for b in buffers if b is not None)


def floors_ms(
    case: Case, x: torch.Tensor, q: reference.Quantized, bytes_per_s: float = COPY_BYTES_PER_S
) -> tuple[float, float]:
    """(floor, floor as run) in ms at bytes_per_s: one read of x plus q's outputs; as run, the case's reads of x."""
    input_bytes = x.numel() * x.element_size()
    one_pass = (input_bytes + _output_bytes(q)) / bytes_per_s * 1e3
    return one_pass, one_pass + (case.passes_over_x - 1) * input_bytes / bytes_per_s * 1e3


def identical(a: reference.Quantized, b: reference.Quantized) -> bool:
    fields = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv")
    return all(torch.equal(getattr(a, f).view(torch.uint8), getattr(b, f).view(torch.uint8)) for f in fields)


def main() -> None:
    """Time every case and print the table (the lead copies it into benchmarks/RESULTS.md)."""
    parser = argument_parser(__doc__)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--cols", type=int, default=8192)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_quantize needs a CUDA device (it times compiled Triton kernels)")
    device = torch.device("cuda")
    x = torch.randn(args.rows, args.cols, device=device, dtype=torch.bfloat16)
    input_bytes = x.numel() * x.element_size()
    copy_ms = device_ms(lambda: x.clone())
    copy_bytes_per_s = 2 * input_bytes / copy_ms * 1e3
    rows = [Result("torch copy (x.clone)", copy_ms, 2 * input_bytes / COPY_BYTES_PER_S * 1e3,
                   extra={"TB/s": 2 * input_bytes / copy_ms / 1e9})]  # fmt: skip
    for case in cases(device):
        run = functools.partial(getattr(triton_quantize, case.function), x, **case.kwargs)
        q = run()  # compiles and autotunes before timing
        exact = identical(q, _peer_reference(case, x))
        ms, host = device_ms(run), host_us(run)
        peer_ms = device_ms(_peer(case, x), graph=False)  # eager torch, as a user would run it
        floor_ms, as_run_ms = floors_ms(case, x, q)
        as_run_at_copy_ms = floors_ms(case, x, q, copy_bytes_per_s)[1]
        extra = {"host us": host, "target": f"{case.target:.0%}", "floor as run": as_run_ms,
                 "of that": f"{as_run_ms / ms:.0%}", "of copy": f"{as_run_at_copy_ms / ms:.0%}",
                 "amax ms": None if case.passes_over_x == 1 else _amax_ms(case, x),
                 "exact": "yes" if exact else "NO"}  # fmt: skip
        peer_name = _PEER_NAMES.get(case.function, "fp8kernels.reference, eager")
        rows.append(Result(case.name, ms, floor_ms, peer=peer_ms, peer_name=peer_name, extra=extra))
        torch.cuda.empty_cache()
    notes = [
        "ms: device time; host us: the host's time per call, calls back to back. floor: one read of x plus the "
        "outputs at 4.24 TB/s; 'floor as run' counts the second read of x that current scaling and NVFP4 make for "
        "their global amax; 'of copy': that floor at the copy bandwidth measured above (the first row). Hopper has "
        "no MXFP8/NVFP4 tensor cores: only the quantization is timed here."
    ]
    for name in triton_quantize._KERNELS:  # the config each kernel's autotuner kept, per autotune key
        for key, config in triton_quantize._kernel(name, tuned=True)[0].kept.items():
            notes.append(f"# {name} {[k for k in key if not str(k).startswith('torch.')]}: {config}")
    report(f"bench_quantize, x {args.rows}x{args.cols} bf16, rowwise + columnwise outputs", rows, args.json, notes)


if __name__ == "__main__":
    main()
