"""LayerNorm/RMSNorm on one GPU: time against the bytes-moved floor and torch, measured in the same run.

    PYTHONPATH=. python3 benchmarks/bench/bench_norm.py [--rows 16384] [--hidden 8192] [--no-compile] [--json PATH]

bf16 in and out at 16384 x 8192 (the MLP benchmark's LayerNorm). A case's floor is the bytes it
must move / 4.24 TB/s (benchmarks/harness.py's copy bandwidth); the "bytes" column says what they are
(e = elements). Peers: torch eager F.layer_norm / F.rms_norm and their autograd backward; for
FP8 outputs the unfused eager chain (norm, amax, scale, cast: what a module without fusion runs)
and, unless --no-compile, the same chain under torch.compile. "rel. error" compares our output
(dx for backward) with torch eager's. Times: benchmarks.harness.device_ms (CUDA graph replays).
Output: markdown for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from benchmarks.harness import COPY_BYTES_PER_S, Result, argument_parser, device_ms, report
from bridge.numerics import relative_error
from fp8kernels import norm, quantize
from fp8kernels import reference as R
from fp8kernels.norm_reference import FusedCast

E4M3_MAX = 448.0


def _torch_norm(kind, x, weight, bias):
    hidden = (x.shape[-1],)
    return F.layer_norm(x, hidden, weight, bias, 1e-5) if kind == "layer" else F.rms_norm(x, hidden, weight, 1e-5)


def _eager_norm_amax_cast(kind, x, weight, bias, scale):
    """The unfused chain: norm in bf16, amax of its output, scaled saturating cast to e4m3."""
    y = _torch_norm(kind, x, weight, bias)
    amax = y.abs().amax().float()
    if scale is None:  # current scaling: the scale comes from this amax
        scale = E4M3_MAX / amax
    return (y.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), amax


def _norm_cases(kind, x, weight, bias, dy, compiled):
    """(case, bytes text, floor bytes, [(provider, fn, error or None)]) for one norm kind."""
    name = "LayerNorm" if kind == "layer" else "RMSNorm"
    e, statistics = x.numel(), x.shape[0] * 4 * (2 if kind == "layer" else 1)  # elements; mean/rstd bytes
    bias = bias if kind == "layer" else None
    forward = norm.layer_norm_forward if kind == "layer" else norm.rms_norm_forward

    def ours(**kwargs):
        return forward(x, weight, bias, **kwargs) if kind == "layer" else forward(x, weight, **kwargs)

    def eager():
        return _torch_norm(kind, x, weight, bias)

    def ours_current_scaling():  # the amax must be complete before any byte is cast: two passes
        result = ours(return_amax=True)
        return quantize.quantize_tensorwise(result.out, "e4m3", scale=R.scale_from_amax(result.amax, E4M3_MAX))

    delayed = FusedCast("e4m3", "tensorwise", torch.tensor([E4M3_MAX / 8.0], device=x.device))
    chain_peers = [("eager norm+amax+cast", _eager_norm_amax_cast)]
    if compiled is not None:
        chain_peers.append(("torch.compile norm+amax+cast", compiled))

    def chain(scale):
        return [(provider, lambda fn=fn: fn(kind, x, weight, bias, scale), None) for provider, fn in chain_peers]

    forward_result = ours()
    x_leaf, weight_leaf = x.detach().requires_grad_(), weight.detach().requires_grad_()
    bias_leaf = None if bias is None else bias.detach().requires_grad_()
    y = _torch_norm(kind, x_leaf, weight_leaf, bias_leaf)
    leaves = [t for t in (x_leaf, weight_leaf, bias_leaf) if t is not None]
    stats = (forward_result.mean, forward_result.rstd) if kind == "layer" else (forward_result.rstd,)
    backward = norm.layer_norm_backward if kind == "layer" else norm.rms_norm_backward

    def ours_backward():
        return backward(dy, x, weight, *stats)

    def eager_backward():
        return torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return [
        (f"{name} fwd", "x 2e + out 2e + stats", 4 * e + statistics,
         [("ours", ours, relative_error(ours().out, eager())), ("torch eager", eager, None)]),
        (f"{name} fwd + e4m3, delayed scale", "x 2e + fp8 1e + stats", 3 * e + statistics,
         [("ours, fused", lambda: ours(cast=delayed), None)] + chain(delayed.scale)),
        (f"{name} fwd + e4m3, current scale", "x 2e twice + fp8 1e + stats", 5 * e + statistics,
         [("ours: norm+amax, then cast", ours_current_scaling, None)] + chain(None)),
        (f"{name} fwd + e4m3 1x128", "x 2e + fp8 1e + scales + stats", 3 * e + e // 32 + statistics,
         [("ours, fused", lambda: ours(cast=FusedCast("e4m3", "block1x128")), None),
          ("eager norm, then Triton quantize_blockwise", lambda: quantize.quantize_blockwise(eager(), "e4m3"), None)]),
        (f"{name} bwd", "x 2e + dy 2e + dx 2e + stats", 6 * e + statistics,
         [("ours", ours_backward, relative_error(ours_backward().dx, eager_backward()[0])),
          ("torch eager autograd", eager_backward, None)]),
    ]  # fmt: skip


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--rows", type=int, default=16384)
    parser.add_argument("--hidden", type=int, default=8192)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile peers")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    x, dy = randn(args.rows, args.hidden), randn(args.rows, args.hidden)
    weight, bias = randn(args.hidden), randn(args.hidden)
    compiled = None if args.no_compile else torch.compile(_eager_norm_amax_cast)
    table, summary = [], []
    for kind in ("layer", "rms"):
        for case, bytes_text, floor_bytes, providers in _norm_cases(kind, x, weight, bias, dy, compiled):
            floor_ms = floor_bytes / COPY_BYTES_PER_S * 1e3
            times = {}
            for provider, fn, error in providers:
                extra = {"bytes": bytes_text}
                try:
                    times[provider] = ms = device_ms(fn)
                except Exception as failure:  # a provider this build cannot run: say so, keep going
                    table.append(Result(case, None, floor_ms, provider=provider, extra=extra,
                                        note=f"unavailable: {failure}"[:100]))  # fmt: skip
                    continue
                extra |= {"GB/s of floor bytes": floor_bytes / ms / 1e6, "rel. error": error}
                table.append(Result(case, ms, floor_ms, provider=provider, extra=extra))
            ours_provider = providers[0][0]
            peers = {provider: ms for provider, ms in times.items() if provider != ours_provider}
            if ours_provider in times and peers:
                best = min(peers, key=peers.get)
                ours_ms = times[ours_provider]
                summary.append(
                    f"- {case}: ours {ours_ms:.3f} ms = {floor_ms / ours_ms:.0%} of the floor; "
                    f"{peers[best] / ours_ms:.2f}x the best peer ({best}, {peers[best]:.3f} ms)"
                )

    report(f"bench_norm, {args.rows} x {args.hidden} bf16", table, args.json, summary)


if __name__ == "__main__":
    main()
