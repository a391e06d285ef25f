"""Benchmark: a TransformerLayer training step with FP8 off and on; GroupedLinear against one dense FP8 GEMM.

Part 1 (issue 5: Float8CurrentScaling >= 1.2x FP8 off). Llama-3-8B's layer: hidden 4096, 32 heads,
8 KV groups, ffn 14336, SwiGLU, RMSNorm, no bias, RoPE, causal; seq 4096 x batch 2, bf16 parameters
and activations; one step = forward + backward. Floor: the four projections' GEMM flops
(2 * T * in * out each, x3 for forward + backward) at the GEMM peak (bf16 788 TFLOP/s, FP8 1425, both
measured on the H200: benchmarks/harness.py) plus attention's (4 * B * S^2 * N * H, halved by the causal mask,
x3; flash recomputes more) at the bf16 peak: attention stays bf16 in every case. Peers: the same block
in plain torch (nn.Linear, nn.RMSNorm, SDPA; our apply_rotary_pos_emb) in bf16, and with torchao's
Float8Linear (tensorwise, torch.compile) when `import torchao` works. Every case also runs compiled (issue 45):
ours and the plain block by torch.compile(fullgraph=True, mode=--compile-mode), the same module and weights;
targets: compiled current scaling >= 1.55x bf16 eager and >= 1.05x torchao, compiled block scaling >= 1.4x bf16
eager. A module x recipe that does not compile yet gets a note with its error instead of a row.

Part 2 (issue 5: GroupedLinear within 15% of one dense FP8 GEMM of the same total size). 8 groups,
uneven splits of 16384 tokens, 4096 -> 14336, bf16, Float8CurrentScaling: GroupedLinear's forward (its
casts and one grouped GEMM: the target) against Linear's on all tokens, then both forward + backward
(GroupedLinear's three GEMMs go through grouped_scaled_mm, which runs cuBLASLt per group here; its wgrad
writes one weight gradient per group); then the fprop GEMM alone: grouped_scaled_mm against one dense scaled_mm
(cuBLASLt), and with fp8kernels.gemm's Triton kernels instead of cuBLASLt (its measured switch, which
grouped_scaled_mm follows: then one grouped launch) against the dense Triton kernel (the same tile
code, so the gap between those two is the cost of grouping). Floor: 2 * T * in * out (x3 for a step)
at 1425 TFLOP/s.

Times: benchmarks.harness.device_ms on the steps, eager or compiled (graph=False: CUDA events around each
call). One table: the "case" column names the part, "provider" what ran; "peer" is the part's baseline (bf16
layer, eager; dense Linear or GEMM).

Run on a CUDA machine:  PYTHONPATH=. python3 benchmarks/bench/bench_transformer_layer.py [--seq 4096 --batch 2]
    [--parts layer] [--compile-mode reduce-overhead]
"""

from __future__ import annotations

import contextlib

import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

from benchmarks.harness import PEAK_FLOPS, Result, argument_parser, device_ms, failure_note, report
from fp8kernels import gemm
from fp8kernels.grouped_gemm import grouped_scaled_mm
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import Linear
from torchside.modules.grouped_linear import GroupedLinear
from torchside.modules.rotary import RotaryPositionEmbedding, apply_rotary_pos_emb
from torchside.modules.transformer_config import TransformerConfig
from torchside.modules.transformer_layer import TransformerLayer
from torchside.quantization import FALLBACK_CALLS, Quantizer
from torchside.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from torchside.train import COMPILE_MODES

LAYER_CASES = {
    "bf16 (FP8 off)": None,
    "Float8CurrentScaling": Float8CurrentScaling(),
    "DelayedScaling": DelayedScaling(),
    "Float8BlockScaling": Float8BlockScaling(),
}
TORCHAO = "peer: torchao Float8Linear tensorwise + compile"
SPLITS = [2861, 1024, 3517, 611, 2290, 1999, 3077, 1005]  # 16384 tokens over 8 experts, uneven on purpose
GROUPED_IN, GROUPED_OUT = 4096, 14336


def _ms(step, grads) -> float:
    return device_ms(step, graph=False, grad_to_none=grads)  # its warm call compiles and autotunes


def _rows(part: str, baseline: str, rows: list[Result]):
    """An `add(name, ms, baseline_ms, floor_ms, note)` that appends the part's rows to `rows`."""

    def add(name: str, ms: float, baseline_ms: float, floor_ms: float, note: str = "") -> None:
        rows.append(Result(part, ms, floor_ms, provider=name, peer=baseline_ms, peer_name=baseline, note=note))

    return add


class PlainBlock(nn.Module):
    """The same block in plain torch: the peer for FP8 off (and, converted by torchao, for FP8)."""

    def __init__(self, args) -> None:
        super().__init__()
        d, h, n, g, f = args.hidden, args.hidden // args.heads, args.heads, args.groups, args.ffn
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.qkv = nn.Linear(d, (n + 2 * g) * h, bias=False)
        self.proj = nn.Linear(n * h, d, bias=False)
        self.fc1, self.fc2 = nn.Linear(d, 2 * f, bias=False), nn.Linear(f, d, bias=False)
        self.split, self.shape = (n * h, g * h, g * h), (n, g, h)

    def forward(self, x_SBD, freqs):
        n, g, h = self.shape
        q, k, v = self.qkv(self.norm1(x_SBD)).split(self.split, dim=-1)
        q = apply_rotary_pos_emb(q.unflatten(-1, (n, h)), freqs)
        k = apply_rotary_pos_emb(k.unflatten(-1, (g, h)), freqs)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v.unflatten(-1, (g, h))))
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x_SBD = x_SBD + self.proj(context.permute(2, 0, 1, 3).flatten(2))
        gate, linear = self.fc1(self.norm2(x_SBD)).chunk(2, dim=-1)
        return x_SBD + self.fc2(F.silu(gate) * linear)


def bench_layer(args, rows: list[Result]) -> list[str]:
    """Part 1's rows into `rows`; its notes returned."""
    tokens, head_dim = args.seq * args.batch, args.hidden // args.heads
    qkv_out = (args.heads + 2 * args.groups) * head_dim
    linear_flops = 3 * 2 * tokens * args.hidden * (qkv_out + args.hidden + 2 * args.ffn + args.ffn)
    attention_flops = 3 * 4 * args.batch * args.seq**2 * args.heads * head_dim / 2
    floors = {
        "bf16": (linear_flops + attention_flops) / PEAK_FLOPS["bf16"] * 1e3,
        "fp8": (linear_flops / PEAK_FLOPS["fp8"] + attention_flops / PEAK_FLOPS["bf16"]) * 1e3,
    }
    total_tflop = (linear_flops + attention_flops) / 1e12
    notes = [f"Part 1: TransformerLayer H={args.hidden} heads={args.heads} groups={args.groups} F={args.ffn} (SwiGLU, "
             f"RMSNorm, RoPE), S={args.seq} B={args.batch}, bf16: {total_tflop:.1f} TFLOP per step, forward + backward "
             "(target: Float8CurrentScaling >= 1.2x bf16)",
             f"compiled: torch.compile(fullgraph=True, mode={args.compile_mode!r}) of the whole layer (torchao: "
             "without fullgraph), each from an empty Dynamo cache"]  # fmt: skip
    config = TransformerConfig(normalization="RMSNorm", activation="swiglu", bias=False)
    freqs = RotaryPositionEmbedding(head_dim)(args.seq).cuda()
    generator = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(args.seq, args.batch, args.hidden, device="cuda", dtype=torch.bfloat16, generator=generator)
    x.requires_grad_()
    dy = torch.randn(x.shape, device="cuda", dtype=torch.bfloat16, generator=generator)
    torch.manual_seed(0)
    layer = TransformerLayer(args.hidden, args.ffn, args.heads, num_gqa_groups=args.groups,
                             params_dtype=torch.bfloat16, device="cuda", config=config)  # fmt: skip
    grads = list(layer.parameters()) + [x]
    fallbacks = sum(FALLBACK_CALLS.values())
    ours: dict[str, tuple[float | None, float]] = {}  # provider -> (ms, floor ms)
    for name, recipe in LAYER_CASES.items():

        def step(forward, recipe=recipe):
            with fp8_autocast(enabled=recipe is not None, recipe=recipe):
                y = forward(x, rotary_pos_emb=freqs)
            y.backward(dy)

        floor_ms = floors["bf16" if recipe is None else "fp8"]
        compiled = _compile(layer, args.compile_mode, fullgraph=True)
        ours[name] = (_ms(lambda step=step: step(layer), grads), floor_ms)
        ours[f"{name}, compiled"] = (_compiled_ms(lambda step=step: step(compiled), grads, name, notes), floor_ms)
    fallbacks = sum(FALLBACK_CALLS.values()) - fallbacks
    notes.append(f"QuantizedTensor ops run on dequantized values: {fallbacks} (must be 0)")
    del layer, compiled, grads
    torch.cuda.empty_cache()
    peers = _bench_layer_peers(args, x, dy, freqs, floors, notes)
    baseline_ms = ours["bf16 (FP8 off)"][0]
    add_row = _rows("layer step", "bf16 (FP8 off)", rows)
    for provider, (ms, floor_ms) in {**ours, **peers}.items():
        if ms is not None:
            add_row(provider, ms, baseline_ms, floor_ms, _target_note(provider, ms, baseline_ms, peers))
    return notes


def _target_note(provider: str, ms: float, baseline_ms: float, peers: dict) -> str:
    """The row's targets: issue 5's for eager current scaling, issue 45's for the compiled FP8 rows."""
    torchao_ms = peers.get(TORCHAO, (None,))[0]
    targets = {  # provider -> (a baseline's name and ms, the speed-up to reach)
        "Float8CurrentScaling": [("bf16", baseline_ms, 1.2)],
        "Float8CurrentScaling, compiled": [("bf16", baseline_ms, 1.55), ("torchao compiled", torchao_ms, 1.05)],
        "Float8BlockScaling, compiled": [("bf16", baseline_ms, 1.4)],
    }
    verdicts = [f"{speedup}x {peer}: " + ("met" if peer_ms / ms >= speedup else "NOT met")
                for peer, peer_ms, speedup in targets.get(provider, []) if peer_ms is not None]  # fmt: skip
    return "target " + ", ".join(verdicts) if verdicts else ""


def _compile(module: nn.Module, mode: str, *, fullgraph: bool) -> nn.Module:
    torch._dynamo.reset()  # every module compiles from nothing: no recompile limit, no dynamic shapes
    return torch.compile(module, fullgraph=fullgraph, mode=mode)


def _compiled_ms(step, grads, what: str, notes: list[str]) -> float | None:
    """_ms of a step through a compiled module; None, with a note, for a module x recipe that does not compile."""
    try:
        return _ms(step, grads)
    except Exception as error:  # not compiling yet (docs/compile.md) must not stop the other rows
        notes.append(failure_note(f"{what}, compiled", error))
        return None


def _bench_layer_peers(args, x, dy, freqs, floors: dict, notes: list[str]) -> dict[str, tuple[float | None, float]]:
    """{provider: (ms, floor ms)} of the plain torch block, eager and compiled, and torchao's FP8 block."""
    torch.manual_seed(0)
    plain = PlainBlock(args).to("cuda", torch.bfloat16)
    grads = list(plain.parameters()) + [x]

    def plain_step(model):
        model(x, freqs).backward(dy)

    compiled = _compile(plain, args.compile_mode, fullgraph=True)
    peers = {
        "peer: plain torch block, bf16 eager": (_ms(lambda: plain_step(plain), grads), floors["bf16"]),
        "peer: plain torch block, bf16 compiled": (
            _compiled_ms(lambda: plain_step(compiled), grads, "plain torch block", notes), floors["bf16"],
        ),
    }  # fmt: skip
    try:
        from torchao.float8 import convert_to_float8_training
    except Exception as error:  # any import failure means no FP8 peer on this machine
        notes.append(f"peer torchao: not available ({type(error).__name__}: {error})")
        return peers
    torchao = _compile(convert_to_float8_training(plain), args.compile_mode, fullgraph=False)
    peers[TORCHAO] = (_compiled_ms(lambda: plain_step(torchao), grads, "torchao", notes), floors["fp8"])
    return peers


@contextlib.contextmanager
def _triton_tensorwise_gemm():
    """fp8kernels.gemm's Triton kernel for tensorwise GEMMs instead of cuBLASLt (a measured switch in fp8kernels.gemm;
    grouped_scaled_mm follows it: one grouped Triton launch instead of cuBLASLt per group)."""
    saved = gemm.CUDA_PATHS["tensorwise"]
    gemm.CUDA_PATHS["tensorwise"] = "triton"
    try:
        yield
    finally:
        gemm.CUDA_PATHS["tensorwise"] = saved


def bench_grouped(args, rows: list[Result]) -> list[str]:
    """Part 2's rows into `rows`; its notes returned."""
    tokens, recipe = sum(SPLITS), Float8CurrentScaling()
    step_floor = 3 * 2 * tokens * GROUPED_IN * GROUPED_OUT / PEAK_FLOPS["fp8"] * 1e3
    generator = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(tokens, GROUPED_IN, device="cuda", dtype=torch.bfloat16, generator=generator).requires_grad_()
    dy = torch.randn(tokens, GROUPED_OUT, device="cuda", dtype=torch.bfloat16, generator=generator)
    torch.manual_seed(0)
    options = {"bias": False, "params_dtype": torch.bfloat16, "device": "cuda"}
    grouped = GroupedLinear(len(SPLITS), GROUPED_IN, GROUPED_OUT, **options)
    dense = Linear(GROUPED_IN, GROUPED_OUT, **options)
    notes = [f"Part 2: GroupedLinear {len(SPLITS)} groups {SPLITS}, {GROUPED_IN} -> {GROUPED_OUT}, "
             "Float8CurrentScaling (target: forward within 15% of dense)"]  # fmt: skip
    add_row = _rows("grouped", "dense", rows)

    def module_forward(module, *extra):
        with torch.no_grad(), fp8_autocast(recipe=recipe):
            module(x, *extra)

    def module_step(module, *extra):
        with fp8_autocast(recipe=recipe):
            y = module(x, *extra)
        y.backward(dy)

    # The forward: one grouped GEMM with its casts against one dense GEMM of the same size. With bf16
    # weights GroupedLinear casts 8 full weights per forward (8x Linear's weight bytes); with FP8 weights
    # (quantized_model_init) only the tokens are cast. A training step is shown too; its wgrad must
    # write 8 weight gradients from 8 short-K GEMMs.
    with quantized_model_init(recipe=recipe):
        grouped_fp8 = GroupedLinear(len(SPLITS), GROUPED_IN, GROUPED_OUT, **options)
        dense_fp8 = Linear(GROUPED_IN, GROUPED_OUT, **options)
    for weights, d, g in (("bf16", dense, grouped), ("FP8", dense_fp8, grouped_fp8)):
        dense_forward_ms = _ms(lambda d=d: module_forward(d), None)
        grouped_forward_ms = _ms(lambda g=g: module_forward(g, SPLITS), None)
        verdict = "met" if grouped_forward_ms <= 1.15 * dense_forward_ms else "NOT met"
        add_row(f"Linear (dense), forward, {weights} weights", dense_forward_ms, dense_forward_ms, step_floor / 3)
        add_row(f"GroupedLinear, forward, {weights} weights", grouped_forward_ms, dense_forward_ms, step_floor / 3,
             f"<= 1.15x dense: {verdict}")  # fmt: skip
    del grouped_fp8, dense_fp8
    dense_ms = _ms(lambda: module_step(dense), list(dense.parameters()) + [x])
    grouped_ms = _ms(lambda: module_step(grouped, SPLITS), list(grouped.parameters()) + [x])
    add_row("Linear (dense), forward + backward", dense_ms, dense_ms, step_floor)
    add_row("GroupedLinear, forward + backward", grouped_ms, dense_ms, step_floor, "wgrad: 8 weight gradients")

    def quantized(t):  # rowwise only: what the fprop GEMM reads
        return Quantizer(recipe, "input", columnwise=False, device="cuda").quantize(t).quantized_storage.to_quantized()

    x_parts = [quantized(part) for part in x.detach().split(SPLITS)]
    w_parts = [quantized(getattr(grouped, f"weight{g}").detach()) for g in range(len(SPLITS))]
    x_all, w_all = quantized(x.detach()), quantized(dense.weight.detach())
    y = torch.empty(tokens, GROUPED_OUT, device="cuda", dtype=torch.bfloat16)
    gemm_floor = step_floor / 3
    y_parts = list(y.split(SPLITS))
    cublas_ms = _ms(lambda: gemm.scaled_mm(x_all, w_all), None)
    grouped_gemm_ms = _ms(lambda: grouped_scaled_mm(x_parts, w_parts, out=y_parts), None)
    with _triton_tensorwise_gemm():
        triton_ms = _ms(lambda: gemm.scaled_mm(x_all, w_all), None)
        one_launch_ms = _ms(lambda: grouped_scaled_mm(x_parts, w_parts, out=y_parts), None)
    add_row("fprop GEMM: dense scaled_mm (cuBLASLt)", cublas_ms, cublas_ms, gemm_floor)
    add_row("fprop GEMM: grouped_scaled_mm (cuBLASLt)", grouped_gemm_ms, cublas_ms, gemm_floor, "one call per group")
    add_row("fprop GEMM: dense fp8kernels.gemm Triton kernel", triton_ms, cublas_ms, gemm_floor)
    add_row("fprop GEMM: grouped_scaled_mm, one launch", one_launch_ms, cublas_ms, gemm_floor,
         f"{one_launch_ms / triton_ms:.2f}x the same kernel ungrouped")  # fmt: skip
    return notes


def main() -> None:
    """Print both parts (the lead copies them into benchmarks/RESULTS.md)."""
    parser = argument_parser(__doc__)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--ffn", type=int, default=14336)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--parts", default="layer,grouped", help="which parts to run: layer, grouped or both")
    parser.add_argument("--compile-mode", default="default", choices=COMPILE_MODES, help="torch.compile's (layer)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if not parts or parts - {"layer", "grouped"}:
        parser.error(f"--parts {args.parts!r}: pass layer, grouped or layer,grouped")
    if not torch.cuda.is_available():
        raise SystemExit("bench_transformer_layer needs a CUDA device")
    rows, notes = [], []
    if "layer" in parts:
        notes += bench_layer(args, rows)
    if "grouped" in parts:
        notes += bench_grouped(args, rows)
    report("bench_transformer_layer", rows, args.json, notes)


if __name__ == "__main__":
    main()
