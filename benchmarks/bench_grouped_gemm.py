"""Grouped FP8 GEMM on one GPU: is one grouped launch as fast as the dense kernel on the same total problem?

    PYTHONPATH=. python benchmarks/bench_grouped_gemm.py [--tile 0] [--autotune]

GroupedLinear's problem (benchmarks/bench_transformer_layer.py, Part 2): 8 experts, uneven splits of
16384 tokens, 4096 -> 14336, Float8CurrentScaling's tensorwise e4m3, bf16 out. Two GEMM kinds:

- fprop, split along M: out[g] = x_g @ w_g^T. Grouped with G=1 (exactly the dense problem: the cost of
  the grouping machinery alone) and with the 8 uneven groups (adds ragged tile edges).
- wgrad, split along K: dw_g = dy_g^T @ x_g, each group reducing over its own tokens (the launcher
  pads each K to a multiple of 16 by a copy, inside the timing: it is part of the launch's cost).

Providers: torch._scaled_mm on the dense problem (cuBLASLt), kernels.gemm's Triton kernel on the dense
problem, the grouped Triton launch, and the per-group loop (`scaled_mm_loop`, cuBLASLt per group). The
Triton rows use one fixed tile (`--tile`, an index into kernels.gemm._FP8_TILES) so that dense and
grouped run the same tile code and the run compiles 3 kernels; `--autotune` adds the autotuned
`grouped_scaled_mm` that GroupedLinear calls (6 more compiles). Throughput = 2*T*I*O / time; floor:
DESIGN.md's FP8 peak (1425 TFLOP/s). Every grouped row reports its relative error against the
per-group cuBLASLt loop. Runs in well under 60 s on an H200.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench_gemm import environment_line, print_table, relative_error, time_ms
from benchmarks.bench_transformer_layer import GROUPED_IN, GROUPED_OUT, SPLITS
from benchmarks.floors import PEAK_TFLOPS
from kernels import gemm, gemm_reference, grouped_gemm, reference
from kernels.gemm_reference import gemm_operand

COLUMNS = ["GEMM", "provider", "ms", "TFLOP/s", "floor ms", "of floor", "vs dense Triton", "rel. error", "note"]
BF16 = torch.bfloat16


def _quantized(t: torch.Tensor, columnwise: bool) -> reference.Quantized:
    """Tensorwise e4m3 of t, the copy the GEMM reads (Float8CurrentScaling: the scale from t's own amax)."""
    return reference.quantize_tensorwise(t, "e4m3", rowwise=not columnwise, columnwise=columnwise)


def bench_kind(kind: str, layout: tuple[bool, bool], dense: tuple, groups: tuple, tile: dict, autotune: bool,
               rows: list) -> None:  # fmt: skip
    """One GEMM kind. layout: (a_columnwise, b_columnwise); dense: (A, B) of the whole problem; groups:
    (A list, B list), one pair per expert (Quantized, as the quantizers return them)."""
    a_columnwise, b_columnwise = layout
    a, b = gemm_operand(dense[0], a_columnwise, "a"), gemm_operand(dense[1], b_columnwise, "b")
    a_ops = [gemm_operand(q, a_columnwise, "a") for q in groups[0]]
    b_ops = [gemm_operand(q, b_columnwise, "b") for q in groups[1]]
    flops = 2.0 * sum(a_op.rows * b_op.rows * a_op.k for a_op, b_op in zip(a_ops, b_ops, strict=True))
    floor_ms = flops / PEAK_TFLOPS["fp8"] / 1e9
    want = [gemm_reference.scaled_mm(qa, qb, a_columnwise=a_columnwise, b_columnwise=b_columnwise)
            for qa, qb in zip(*groups, strict=True)]  # fmt: skip
    outs = [torch.empty(a_op.rows, b_op.rows, device="cuda", dtype=BF16) for a_op, b_op in zip(a_ops, b_ops)]
    dense_triton_ms = None

    def measure(provider, fn, got=None, note=""):
        nonlocal dense_triton_ms
        fn()  # compiles (and autotunes) outside the timing
        ms = time_ms(fn)
        dense_triton_ms = dense_triton_ms or (ms if provider == "dense Triton kernel" else None)
        errors = [relative_error(o, w) for o, w in zip(got or [], want, strict=False) if w.numel()]
        error = max(errors) if errors else "-"
        vs = f"{dense_triton_ms / ms:.2f}x" if dense_triton_ms else "-"
        rows.append([kind, provider, ms, flops / ms / 1e9, floor_ms, floor_ms / ms, vs, error, note])

    measure("dense torch._scaled_mm (cuBLASLt)", lambda: gemm._torch_scaled_mm(a, b, BF16, None))
    measure("dense Triton kernel", lambda: gemm._scaled_mm_triton(a, b, BF16, None, tile))
    if kind.startswith("fprop"):  # G=1: exactly the dense problem, through the grouped launch
        one = [torch.empty(a.rows, b.rows, device="cuda", dtype=BF16)]
        measure("grouped launch, G=1", lambda: grouped_gemm._grouped_triton([a], [b], BF16, None, one, tile),
                note="the dense problem")  # fmt: skip
    groups_name = f"grouped launch, G={len(a_ops)}"
    measure(groups_name, lambda: grouped_gemm._grouped_triton(a_ops, b_ops, BF16, None, outs, tile), outs)
    if autotune:
        tuned = [torch.empty_like(o) for o in outs]
        run = lambda: grouped_gemm._grouped_triton(a_ops, b_ops, BF16, None, tuned)  # noqa: E731
        measure(groups_name + ", autotuned", run, tuned, "what GroupedLinear runs")
    if all(gemm._torch_scaled_mm_takes(a_op, b_op, BF16, None) for a_op, b_op in zip(a_ops, b_ops)):
        loop = [None] * len(a_ops)

        def per_group():
            loop[:] = [gemm._torch_scaled_mm(a_op, b_op, BF16, None) for a_op, b_op in zip(a_ops, b_ops)]

        measure(f"loop: {len(a_ops)} x torch._scaled_mm", per_group, loop, f"{len(a_ops)} launches")
    else:
        rows.append([kind, f"loop: {len(a_ops)} x torch._scaled_mm", "-", "-", floor_ms, "-", "-", "-",
                     "cuBLASLt needs K % 16 == 0; the token counts are not"])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tile", type=int, default=0, help="index into kernels.gemm._FP8_TILES for the Triton rows")
    parser.add_argument("--autotune", action="store_true", help="also time the autotuned grouped launch")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_grouped_gemm needs a CUDA device")
    start = time.perf_counter()
    tile = gemm._FP8_TILES[args.tile]
    generator = torch.Generator(device="cuda").manual_seed(0)

    def sample(*shape):
        return torch.randn(*shape, device="cuda", dtype=BF16, generator=generator)

    x, dy = sample(sum(SPLITS), GROUPED_IN), sample(sum(SPLITS), GROUPED_OUT)
    weights = [sample(GROUPED_OUT, GROUPED_IN) for _ in SPLITS]
    rows: list[list] = []
    # fprop: A = x rowwise [T, I], split along T; B = w_g rowwise [O, I]. Dense: all tokens through weight 0.
    dense = (_quantized(x, False), _quantized(weights[0], False))
    groups = ([_quantized(part, False) for part in x.split(SPLITS)], [_quantized(w, False) for w in weights])
    bench_kind("fprop (M split)", (False, False), dense, groups, tile, args.autotune, rows)
    # wgrad: A = dy columnwise [O, T], B = x columnwise [I, T]: the groups split K (the tokens)
    dense = (_quantized(dy, True), _quantized(x, True))
    groups = tuple([_quantized(part, True) for part in t.split(SPLITS)] for t in (dy, x))
    bench_kind("wgrad (K split)", (True, True), dense, groups, tile, args.autotune, rows)

    print(f"## bench_grouped_gemm, {len(SPLITS)} groups {SPLITS}, {GROUPED_IN} -> {GROUPED_OUT}, tensorwise e4m3, "
          f"bf16 out, Triton tile {tile}\n\n{environment_line()}\n")  # fmt: skip
    print_table(COLUMNS, rows)
    print(f"\n{time.perf_counter() - start:.0f} s in all, compiles included")


if __name__ == "__main__":
    main()
