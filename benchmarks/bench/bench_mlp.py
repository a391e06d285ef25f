"""Benchmark: LayerNormMLP forward + backward in bf16 (FP8 off) and under the Hopper-native FP8 recipes.

Shape (DESIGN.md's peer measurement): hidden 8192, ffn 28672, gelu, 16384 tokens, bf16 parameters and
activations. For each case: measured ms (benchmarks.harness.device_ms on the eager steps), speedup over bf16, the
floor (12 * T * H * F flops of the six GEMMs / peak: bf16 788 TFLOP/s, FP8 1425 TFLOP/s, both
measured on the H200: benchmarks/harness.py), the fraction of the floor reached, the peak memory of one step,
and the output's relative error against the bf16 module (same weights). Then the same with FP8
weights (quantized_model_init): memory against bf16. The peer is torchao's Float8Linear
(tensorwise, torch.compile) when `import torchao` works. DESIGN.md measured bf16 eager at 67.8 ms.
Each case runs eagerly, then compiled (provider "compiled": torch.compile(module, fullgraph=True,
mode=--compile-mode), the same module and weights; issue 45's target: no slower than its eager run, the "vs eager"
column); a case that does not compile yet gets a note with the error instead of a row (docs/compile.md).
MXFP8 and NVFP4 are EMULATED on Hopper (no tensor cores for them: fp8kernels.gemm multiplies their
dequantized values on the bf16 ones), so their floor is the bf16 one.

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/bench/bench_mlp.py [--hidden 8192 --ffn 28672 --tokens 16384]
    [--cases off,current,block] [--compile-mode reduce-overhead]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch._dynamo
from torch import nn

from benchmarks.harness import PEAK_FLOPS, Result, argument_parser, device_ms, failure_note, report
from bridge.numerics import relative_error
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import LayerNormMLP
from torchside.quantization import FALLBACK_CALLS
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from torchside.train import COMPILE_MODES

BF16_EXPECTED_MS = 67.8


@dataclass(frozen=True)
class Case:
    key: str  # --cases picks by it
    name: str
    recipe: Recipe | None  # None: FP8 off
    fp8_weights: bool = False  # build under quantized_model_init(recipe)


CASES = [
    Case("off", "bf16 (FP8 off)", None),
    Case("current", "Float8CurrentScaling", Float8CurrentScaling()),
    Case("delayed", "DelayedScaling", DelayedScaling()),
    Case("block", "Float8BlockScaling", Float8BlockScaling()),
    Case("mxfp8", "MXFP8BlockScaling (emulated)", MXFP8BlockScaling()),
    Case("nvfp4", "NVFP4BlockScaling (emulated)", NVFP4BlockScaling()),
    Case("fp8-weights", "Float8CurrentScaling, FP8 weights", Float8CurrentScaling(), fp8_weights=True),
]
CASES_BY_KEY = {case.key: case for case in CASES}


@dataclass
class Measured:
    ms: float
    peak_gib: float
    output: torch.Tensor


def _build(case: Case, args) -> LayerNormMLP:
    torch.manual_seed(0)
    with quantized_model_init(enabled=case.fp8_weights, recipe=case.recipe):
        return LayerNormMLP(args.hidden, args.ffn, params_dtype=torch.bfloat16, device="cuda")


def _measure(module: nn.Module, step, x: torch.Tensor, dy: torch.Tensor) -> Measured:
    params = list(module.parameters())
    # Compiles, autotunes, and gives the output to compare, on the host: a GPU copy would count in later peaks,
    # and a CUDA graph's output (--compile-mode reduce-overhead) is overwritten by its next replay.
    output = step(x, dy).cpu()
    for p in params + [x]:
        p.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step(x, dy)
    torch.cuda.synchronize()
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    ms = device_ms(lambda: step(x, dy), graph=False, grad_to_none=params + [x])
    return Measured(ms, peak_gib, output)


def _fp8_step(module: nn.Module, recipe: Recipe | None):
    def step(x, dy):
        with fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y = module(x)
        y.backward(dy)
        return y.detach()

    return step


def _compile(module: nn.Module, mode: str) -> nn.Module:
    torch._dynamo.reset()  # every module compiles from nothing: no recompile limit, no dynamic shapes
    return torch.compile(module, fullgraph=True, mode=mode)


def _torchao_step(args):
    """torchao's Float8Linear (tensorwise) in a plain MLP, compiled; None when torchao does not import."""
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as error:  # any import failure means no peer on this machine
        print(f"torchao: not available ({type(error).__name__}: {error})")
        return None
    torch.manual_seed(0)
    mlp = nn.Sequential(
        nn.LayerNorm(args.hidden), nn.Linear(args.hidden, args.ffn), nn.GELU(approximate="tanh"),
        nn.Linear(args.ffn, args.hidden),
    ).to("cuda", torch.bfloat16)  # fmt: skip
    torch._dynamo.reset()
    mlp = torch.compile(convert_to_float8_training(mlp), mode=args.compile_mode)

    def step(x, dy):
        y = mlp(x)
        y.backward(dy)
        return y.detach()

    return mlp, step


def main() -> None:
    """Time every case and print the table (the lead copies it into benchmarks/RESULTS.md)."""
    parser = argument_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--ffn", type=int, default=28672)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--cases", default=",".join(CASES_BY_KEY), help="comma-separated, of: %(default)s")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES, help="torch.compile's mode")
    args = parser.parse_args()
    unknown = set(args.cases.split(",")) - set(CASES_BY_KEY)
    if unknown:
        parser.error(f"unknown --cases {sorted(unknown)}; choose from {','.join(CASES_BY_KEY)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench_mlp needs a CUDA device")
    flops = 12 * args.tokens * args.hidden * args.ffn
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    x.requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)

    rows, notes = [], []
    fallbacks_before = sum(FALLBACK_CALLS.values())
    baseline = None
    # FP8 off runs first whatever --cases says: it is every row's peer
    for case in [CASES[0]] + [CASES_BY_KEY[key] for key in args.cases.split(",") if key != "off"]:
        module = _build(case, args)
        peak = PEAK_FLOPS["bf16" if case.recipe is None or "emulated" in case.name else "fp8"]
        eager = _measure(module, _fp8_step(module, case.recipe), x, dy)
        baseline = baseline or eager
        rows.append(_row(case.name, "eager", eager, baseline, flops / peak * 1e3))
        try:
            compiled = _measure(module, _fp8_step(_compile(module, args.compile_mode), case.recipe), x, dy)
        except Exception as error:  # a recipe that does not compile yet: its note, and the other rows still run
            notes.append(failure_note(f"{case.name}, compiled", error))
        else:
            rows.append(_row(case.name, "compiled", compiled, baseline, flops / peak * 1e3, eager=eager))
        del module
        torch.cuda.empty_cache()
    fallbacks = sum(FALLBACK_CALLS.values()) - fallbacks_before
    peer = _torchao_step(args)
    if peer is not None:
        mlp, step = peer
        floor_ms = flops / PEAK_FLOPS["fp8"] * 1e3
        result = _measure(mlp, step, x, dy)  # its own weights: no error against ours
        name = "peer: torchao Float8Linear tensorwise + torch.compile"
        rows.append(_row(name, "compiled", result, baseline, floor_ms, error=False))
    notes += [
        f"QuantizedTensor ops run on dequantized values during the runs: {fallbacks} (must be 0)",
        f"bf16 expected ~{BF16_EXPECTED_MS} ms (DESIGN.md, eager). Floors: 12*T*H*F flops at "
        f"{PEAK_FLOPS['bf16'] / 1e12:.0f} TFLOP/s (bf16) and {PEAK_FLOPS['fp8'] / 1e12:.0f} (FP8 torch._scaled_mm).",
        f"compiled: torch.compile(fullgraph=True, mode={args.compile_mode!r}); vs eager: eager ms / compiled ms",
    ]
    title = (f"bench_mlp, LayerNormMLP H={args.hidden} F={args.ffn} gelu, T={args.tokens}, bf16, forward + backward; "
             f"{flops / 1e12:.1f} TFLOP per step")  # fmt: skip
    report(title, rows, args.json, notes)


def _row(
    name: str, provider: str, result: Measured, baseline: Measured, floor_ms: float, *, error: bool = True,
    eager: Measured | None = None,
) -> Result:  # fmt: skip
    """A case's row; the peer is the bf16 module (FP8 off, eager) of the same run, rel. error against its output;
    `eager`: the same case's eager run, for a compiled row."""
    extra = {"peak GiB": result.peak_gib, "mem vs bf16": f"{result.peak_gib / baseline.peak_gib:.2f}x",
             "rel. error": relative_error(result.output, baseline.output) if error else None,
             "vs eager": None if eager is None else f"{eager.ms / result.ms:.2f}x"}  # fmt: skip
    return Result(name, result.ms, floor_ms, provider=provider, peer=baseline.ms, peer_name="bf16 (FP8 off)",
                  extra=extra)  # fmt: skip


if __name__ == "__main__":
    main()
