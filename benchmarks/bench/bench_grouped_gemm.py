"""Grouped FP8 GEMM on one GPU: is one grouped launch as fast as the dense kernel on the same total problem?

    PYTHONPATH=. python3 benchmarks/bench/bench_grouped_gemm.py [--tile 0] [--autotune] [--json PATH]

GroupedLinear's problem (benchmarks/bench/bench_transformer_layer.py, Part 2): 8 experts, uneven splits of
16384 tokens, 4096 -> 14336, Float8CurrentScaling's tensorwise e4m3, bf16 out. Two GEMM kinds:

- fprop, split along M: out[g] = x_g @ w_g^T. Grouped with G=1 (exactly the dense problem: the cost of
  the grouping machinery alone) and with the 8 uneven groups (adds ragged tile edges).
- wgrad, split along K: dw_g = dy_g^T @ x_g, each group reducing over its own tokens (grouped_scaled_mm
  pads each K to a multiple of 16 by a copy, inside the timing: it is part of the grouped GEMM's cost).

Providers: torch._scaled_mm on the dense problem (cuBLASLt), fp8kernels.gemm's Triton kernel on the dense
problem, the one grouped Triton launch, a loop of torch._scaled_mm per group (where K allows it), and
`grouped_scaled_mm`, the dispatching entry point GroupedLinear calls (cuBLASLt per group where it takes
every group, else the autotuned launch; its note says which ran). The Triton launch rows use one fixed
tile (`--tile`, an index into fp8kernels.gemm._FP8_TILES) so that dense and grouped run the same tile code;
`--autotune` adds the autotuned launch (6 more compiles). Throughput = 2*T*I*O / time; floor: benchmarks/harness.py's
FP8 peak (1425 TFLOP/s); "vs peer" (the dense cuBLASLt GEMM) is issue 5's target (>= 0.87x: within 15%). Every grouped
row reports its relative error against the reference GEMM per group. Times: benchmarks.harness.device_ms
(CUDA graph replays). Runs in well under 60 s on an H200.
"""

from __future__ import annotations

import time

import torch

from benchmarks.bench.bench_transformer_layer import GROUPED_IN, GROUPED_OUT, SPLITS
from benchmarks.harness import PEAK_TFLOPS, Result, argument_parser, device_ms, report
from bridge.numerics import relative_error
from fp8kernels import gemm, gemm_reference, grouped_gemm, reference
from fp8kernels.gemm_reference import gemm_operand

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
    baselines = {}  # provider -> ms, for the "vs" columns

    def aligned():  # grouped_scaled_mm's zero codes appended to K (a copy per operand in wgrad), timed with the GEMM
        return map(list, zip(*(grouped_gemm._aligned_k(a_op, b_op) for a_op, b_op in zip(a_ops, b_ops))))

    def measure(provider, fn, got=None, note=""):
        ms = baselines[provider] = device_ms(fn)  # its warm call compiles (and autotunes) outside the timing
        errors = [relative_error(o, w) for o, w in zip(got or [], want, strict=False) if w.numel()]
        cublas_ms, triton_ms = (baselines.get(name) for name in ("dense cuBLASLt", "dense Triton kernel"))
        extra = {"TFLOP/s": flops / ms / 1e9, "vs dense Triton": f"{triton_ms / ms:.2f}x" if triton_ms else None,
                 "rel. error": max(errors) if errors else None}  # fmt: skip
        rows.append(Result(kind, ms, floor_ms, provider=provider, peer=cublas_ms, peer_name="dense cuBLASLt",
                           extra=extra, note=note))  # fmt: skip

    measure("dense cuBLASLt", lambda: gemm._torch_scaled_mm(a, b, BF16, None), note="torch._scaled_mm")
    measure("dense Triton kernel", lambda: gemm._scaled_mm_triton(a, b, BF16, None, tile))
    if kind.startswith("fprop"):  # G=1: exactly the dense problem, through the grouped launch
        one = [torch.empty(a.rows, b.rows, device="cuda", dtype=BF16)]
        measure("grouped launch, G=1", lambda: grouped_gemm._grouped_triton([a], [b], BF16, None, one, tile),
                note="the dense problem")  # fmt: skip
    groups_name = f"grouped launch, G={len(a_ops)}"
    measure(groups_name, lambda: grouped_gemm._grouped_triton(*aligned(), BF16, None, outs, tile), outs)
    if autotune:
        tuned = [torch.empty_like(o) for o in outs]
        run = lambda: grouped_gemm._grouped_triton(*aligned(), BF16, None, tuned)  # noqa: E731
        measure(groups_name + ", autotuned", run, tuned)
    dispatched = [torch.empty_like(o) for o in outs]
    path = "cuBLASLt per group" if grouped_gemm._cublas_takes_every_group(*aligned(), BF16, None) else "one launch"
    layout_kwargs = {"a_columnwise": a_columnwise, "b_columnwise": b_columnwise}
    run = lambda: grouped_gemm.grouped_scaled_mm(*groups, **layout_kwargs, out=dispatched)  # noqa: E731
    measure("grouped_scaled_mm", run, dispatched, f"what GroupedLinear runs: {path}")
    if all(gemm._torch_scaled_mm_takes(a_op, b_op, BF16, None) for a_op, b_op in zip(a_ops, b_ops)):
        loop = [None] * len(a_ops)

        def per_group():
            loop[:] = [gemm._torch_scaled_mm(a_op, b_op, BF16, None) for a_op, b_op in zip(a_ops, b_ops)]

        measure(f"loop: {len(a_ops)} x torch._scaled_mm", per_group, loop, f"{len(a_ops)} launches")
    else:
        rows.append(Result(kind, None, floor_ms, provider=f"loop: {len(a_ops)} x torch._scaled_mm",
                           note="cuBLASLt needs K % 16 == 0; the token counts are not (grouped_scaled_mm pads them)"))  # fmt: skip


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--tile", type=int, default=0, help="index into fp8kernels.gemm._FP8_TILES for the Triton rows")
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
    rows: list[Result] = []
    # fprop: A = x rowwise [T, I], split along T; B = w_g rowwise [O, I]. Dense: all tokens through weight 0.
    dense = (_quantized(x, False), _quantized(weights[0], False))
    groups = ([_quantized(part, False) for part in x.split(SPLITS)], [_quantized(w, False) for w in weights])
    bench_kind("fprop (M split)", (False, False), dense, groups, tile, args.autotune, rows)
    # wgrad: A = dy columnwise [O, T], B = x columnwise [I, T]: the groups split K (the tokens)
    dense = (_quantized(dy, True), _quantized(x, True))
    groups = tuple([_quantized(part, True) for part in t.split(SPLITS)] for t in (dy, x))
    bench_kind("wgrad (K split)", (True, True), dense, groups, tile, args.autotune, rows)

    title = (f"bench_grouped_gemm, {len(SPLITS)} groups {SPLITS}, {GROUPED_IN} -> {GROUPED_OUT}, tensorwise e4m3, "
             f"bf16 out, Triton tile {tile}")  # fmt: skip
    report(title, rows, args.json, [f"{time.perf_counter() - start:.0f} s in all, compiles included"])


if __name__ == "__main__":
    main()
