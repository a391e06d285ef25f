"""FP8 GEMM on one GPU: measured TFLOP/s against the tensor-core floor and the peers of the same run.

    PYTHONPATH=. python3 benchmarks/bench/bench_gemm.py [--size 8192] [--json PATH]

Throughput = 2*M*N*K / time. Floors are benchmarks/harness.py's H200 peaks: bf16 788 TFLOP/s, FP8 1425
(torch._scaled_mm tensorwise). Rows:

- tensorwise e4m3: fp8kernels.gemm's Triton kernel, torch._scaled_mm (cuBLASLt), and `scaled_mm`
  (the path gemm.CUDA_PATHS picks); the faster of the first two decides that table's entry.
- block-scaled 1x128 x 128x128 and 1x128 x 1x128 (wgrad): our Triton kernel, `scaled_mm` (cuBLASLt
  through torch where it takes the pair), torch._scaled_mm rowwise (the nearest cuBLAS FP8 peer).
- MXFP8 and NVFP4: EMULATED (Hopper has no MXFP8/NVFP4 tensor cores), so their floor is the bf16
  peak: our fused Triton kernel (dequantize in the prologue, bf16 dots), the dequantize path
  (bf16 copies, cuBLAS, one epilogue launch), `scaled_mm`; peer: dequantize + bf16 torch.matmul, eager.

Every row also reports its relative error against fp8kernels.gemm_reference (fp32 matmul of the
dequantized operands), so a fast wrong kernel cannot pass unnoticed. Times: benchmarks.harness.device_ms
(CUDA graph replays). Output: markdown for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import torch

from benchmarks.harness import PEAK_TFLOPS, Result, argument_parser, device_ms, report
from bridge.numerics import relative_error
from fp8kernels import gemm, gemm_reference, quantize, reference  # reference: the Triton quantizers' bytes, in plain torch


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--size", type=int, default=8192, help="M = N = K")
    args = parser.parse_args()
    size = args.size
    flops = 2.0 * size**3
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = torch.randn(size, size, device="cuda", dtype=torch.bfloat16, generator=generator)
    rows = []

    def measure(case, provider, fn, floor, want=None, note="", graph=True):
        try:
            ms = device_ms(fn, graph=graph)
        except Exception as error:  # a peer this torch build does not run: say so, keep going
            note = f"unavailable: {str(error).splitlines()[0][:80]}"
            rows.append(Result(case, None, floor, "TFLOP/s", provider, note=note))
            return None
        tflops = flops / ms / 1e9
        error = relative_error(fn(), want) if want is not None else None
        rows.append(Result(case, tflops, floor, "TFLOP/s", provider, extra={"ms": ms, "rel. error": error}, note=note))
        return tflops

    bf16_peak, fp8_peak, bf16_out = PEAK_TFLOPS["bf16"], PEAK_TFLOPS["fp8"], torch.bfloat16
    bf16 = measure("bf16", "torch.matmul", lambda: x @ w.T, bf16_peak)

    # tensorwise: our kernel alone, cuBLASLt alone, and the dispatching entry point
    case = "tensorwise e4m3"
    qx, qw = reference.quantize_tensorwise(x, "e4m3"), reference.quantize_tensorwise(w, "e4m3")
    a, b = gemm_reference.gemm_operand(qx, False, "a"), gemm_reference.gemm_operand(qw, False, "b")
    want = gemm_reference.scaled_mm(qx, qw)
    ours = measure(case, "ours (Triton)", lambda: gemm._scaled_mm_triton(a, b, bf16_out, None), fp8_peak, want)
    cublas = measure(case, "torch._scaled_mm", lambda: gemm._torch_scaled_mm(a, b, bf16_out, None), fp8_peak, want)
    measure(case, "gemm.scaled_mm", lambda: gemm.scaled_mm(qx, qw), fp8_peak, want, _path(qx, qw))

    # block-scaled: ours; cuBLAS rowwise (the nearest finer-than-tensor peer) and, where wired up, blockwise
    case = "block 1x128 x 128x128"
    # the Triton quantizers, as the modules call them: their 1x128 scales come rows-contiguous, as cuBLASLt reads them
    qx, qw = quantize.quantize_blockwise(x, "e4m3", (1, 128)), quantize.quantize_blockwise(w, "e4m3", (128, 128))
    want = gemm_reference.scaled_mm(qx, qw)
    block_a, block_b = gemm_reference.gemm_operand(qx, False, "a"), gemm_reference.gemm_operand(qw, False, "b")
    block = measure(case, "ours (Triton)", lambda: gemm._scaled_mm_triton(block_a, block_b, bf16_out, None), fp8_peak, want)
    measure(case, "gemm.scaled_mm", lambda: gemm.scaled_mm(qx, qw), fp8_peak, want, _path(qx, qw))
    x_rows = x.float().abs().amax(dim=1, keepdim=True) / 448.0
    w_rows = w.float().abs().amax(dim=1, keepdim=True).t().contiguous() / 448.0
    x_fp8, w_fp8 = (x / x_rows).to(torch.float8_e4m3fn), (w / w_rows.t()).to(torch.float8_e4m3fn)

    def rowwise():
        return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_rows, scale_b=w_rows, out_dtype=bf16_out)

    measure(case, "torch._scaled_mm rowwise (peer)", rowwise, fp8_peak, note="rowwise scales, not 1x128")
    x_codes, w_codes = qx.data.view(torch.float8_e4m3fn), qw.data.view(torch.float8_e4m3fn)
    x_scale = qx.scale_inv  # M-major, as cuBLAS reads 1x128 scales

    def blockwise():
        return torch._scaled_mm(x_codes, w_codes.t(), scale_a=x_scale, scale_b=qw.scale_inv.t(), out_dtype=bf16_out)

    measure(case, "torch._scaled_mm blockwise (peer)", blockwise, fp8_peak, want)

    # wgrad's pair: 1x128 by 1x128 (both operands scaled along K): ours, and cuBLASLt where torch takes it
    case = "block 1x128 x 1x128"
    qw = quantize.quantize_blockwise(w, "e4m3", (1, 128))
    want = gemm_reference.scaled_mm(qx, qw)
    block_b = gemm_reference.gemm_operand(qw, False, "b")
    wgrad = measure(case, "ours (Triton)", lambda: gemm._scaled_mm_triton(block_a, block_b, bf16_out, None), fp8_peak,
                    want)  # fmt: skip
    wgrad_picked = measure(case, "gemm.scaled_mm", lambda: gemm.scaled_mm(qx, qw), fp8_peak, want, _path(qx, qw))
    rx, rw = reference.quantize_blockwise(x, "e4m3", (1, 128)), reference.quantize_blockwise(w, "e4m3", (1, 128))
    measure(case, "gemm.scaled_mm, row-major scales", lambda: gemm.scaled_mm(rx, rw), fp8_peak, want,
            "the reference's layout: two scale relayouts a call")  # fmt: skip

    # emulated: the floor is the bf16 peak; the peer dequantizes, then multiplies in bf16
    emulated = {}
    note = "EMULATED: no MXFP8/NVFP4 tensor cores on Hopper"
    for case, quantizer in (("mxfp8 e4m3", reference.quantize_mxfp8), ("nvfp4 1x16", reference.quantize_nvfp4)):
        qx, qw = quantizer(x), quantizer(w)
        want = gemm_reference.scaled_mm(qx, qw)
        a, b = gemm_reference.gemm_operand(qx, False, "a"), gemm_reference.gemm_operand(qw, False, "b")
        fused = measure(case, "ours (Triton, fused)", lambda: gemm._scaled_mm_triton(a, b, bf16_out, None), bf16_peak,
                        want, note)  # fmt: skip
        split = measure(case, "ours (dequantize + cuBLAS bf16)", lambda: gemm._scaled_mm_dequantized(a, b, bf16_out, None),
                        bf16_peak, want, note)  # fmt: skip
        emulated[case] = (fused, split)
        measure(case, "gemm.scaled_mm", lambda: gemm.scaled_mm(qx, qw), bf16_peak, want, _path(qx, qw))

        def unfused():
            return reference.dequantize(qx, bf16_out) @ reference.dequantize(qw, bf16_out).T

        # eager calls, as the peer is: NVFP4's dequantize reads a host scalar, which a CUDA graph cannot capture
        measure(case, "dequantize + torch.matmul (peer)", unfused, bf16_peak, want, "eager, unfused", graph=False)

    notes = []
    if ours and cublas:
        faster = "cublaslt" if cublas >= ours else "triton"
        notes.append(f"- tensorwise: Triton {ours:.0f} vs torch._scaled_mm {cublas:.0f} TFLOP/s ({ours / cublas:.1%}); "
                     f"faster: {faster}; gemm.CUDA_PATHS says {gemm.CUDA_PATHS['tensorwise']}.")  # fmt: skip
    if block and bf16:
        notes.append(f"- block 1x128 x 128x128, our Triton kernel: {block:.0f} TFLOP/s = {block / bf16:.2f}x this run's "
                     f"bf16 matmul.")  # fmt: skip
    if wgrad and wgrad_picked:
        notes.append(f"- block 1x128 x 1x128 (wgrad): scaled_mm {wgrad_picked:.0f} TFLOP/s (target >= 1000), "
                     f"our Triton kernel {wgrad:.0f}.")  # fmt: skip
    for name, (fused, split) in emulated.items():
        if fused and split:
            faster = "dequantize" if split >= fused else "triton"
            notes.append(f"- {name} (emulated): dequantize + cuBLAS {split:.0f} TFLOP/s, fused Triton {fused:.0f}; "
                         f"faster: {faster}; gemm.CUDA_PATHS says {gemm.CUDA_PATHS[name.split()[0]]}.")  # fmt: skip
    report(f"bench_gemm, {size}^3, bf16 out", rows, args.json, notes)


def _path(qa, qb) -> str:
    a, b = gemm_reference.gemm_operand(qa, False, "a"), gemm_reference.gemm_operand(qb, False, "b")
    return f"runs {gemm.cuda_path(a, b, torch.bfloat16, None)}"


if __name__ == "__main__":
    main()
