"""How far each per-tensor FP8 GEMM provider's sums are from exact, and how many codes that flips downstream.

`shardbridge verify` holds recipes whose two sides cast with the same scales (DelayedScaling's first
step, block scaling) to the "same scales" bound u/2 of bridge/numerics.py, whose premise is that the
two frameworks' values before a cast differ by fp32 summation-order noise only. This script measures
that premise on the device at verify's GEMM shapes (2-layer TransformerLayer, hidden 256, 64 tokens
per rank); on the H200 it fails for FP8 tensor-core GEMMs, which is why bridge/numerics.py gives
those recipes 2u on CUDA. For the same FP8 operands (scale 1, as delayed's first step casts them),
each provider's output against float64:

- rel: ||out - exact|| / ||exact||;
- log2 err/sum|ab|: the largest |out - exact| over sum_k |a_k b_k|, as a power of 2 (an fp32
  accumulation gives about -23; Hopper's FP8 tensor-core accumulator keeps ~14 bits);
- flips: the fraction of the output's E4M3 codes (cast at scale 1, as the next layer's input cast
  does) that differ from the codes of the exact output: what a second framework's cast then sees.

Providers: torch._scaled_mm (cuBLASLt, what torchside runs on CUDA), fp8kernels.gemm's Triton kernel
(promotes to fp32 every K tile), the JAX twin's FP8 dot_general (XLA), the JAX twin's dot on
dequantized fp32 values at HIGHEST precision.

Run:  PYTHONPATH=. python3 benchmarks/diagnose/diagnose_fp8_gemm_noise.py [--device cuda]
"""

from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch

from benchmarks.harness import environment_line
from bridge.numerics import relative_error
import jaxside.quantize as jq
import fp8kernels.gemm
from jaxside.modules import functions as jax_functions
from fp8kernels import reference

# (what, A format, M, N, K): fprop x @ W^T, dgrad dy @ W, wgrad dy^T @ x (K = tokens)
CASES = [
    ("fprop qkv", "e4m3", 64, 768, 256),
    ("fprop fc1", "e4m3", 64, 1024, 256),
    ("fprop fc2", "e4m3", 64, 256, 1024),
    ("dgrad fc2", "e5m2", 64, 1024, 256),
    ("dgrad fc1", "e5m2", 64, 256, 1024),
    ("wgrad fc1", "e5m2", 1024, 256, 64),
    ("subnormal", "e4m3", 64, 256, 256),  # B's codes all E4M3 subnormals (|b| < 2^-6), A's ~N(0, 1)
]


def _quantized(values: torch.Tensor, fmt: str, device: str):
    one = torch.ones(1, dtype=torch.float32)
    q = reference.quantize_tensorwise(values.to(device), fmt, one.to(device))
    qj = jq.quantize_tensorwise(jnp.asarray(values.numpy()), fmt, jnp.asarray(one.numpy()))
    assert np.array_equal(np.asarray(qj.data), q.data.cpu().numpy()), "the two quantizers disagree"
    return q, qj


def _e4m3_codes(x: torch.Tensor) -> torch.Tensor:
    return reference.quantize_tensorwise(x.float().cpu(), "e4m3", torch.ones(1)).data


def _torch_provider(tensorwise_cublas: bool):
    def run(a, b, a_j, b_j):
        fp8kernels.gemm.CUDA_PATHS["tensorwise"] = "cublaslt" if tensorwise_cublas else "triton"
        try:
            return fp8kernels.gemm.scaled_mm(a, b, out_dtype=torch.float32).cpu().double()
        finally:
            fp8kernels.gemm.CUDA_PATHS["tensorwise"] = "cublaslt"

    return run


def _jax_provider(dequantized: bool):
    def gemm(a_j, b_j):
        if dequantized:
            a_v, b_v = jq.dequantize(a_j), jq.dequantize(b_j)
            return jax.lax.dot_general(
                a_v, b_v, (((1,), (1,)), ((), ())), precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            )  # fmt: skip
        return jax_functions._scaled_mm(a_j, b_j, jnp.float32)

    jitted = jax.jit(gemm)

    def run(a, b, a_j, b_j):
        return torch.from_numpy(np.asarray(jitted(a_j, b_j))).double()

    return run


PROVIDERS = {
    "torch._scaled_mm (cuBLASLt)": _torch_provider(True),
    "fp8kernels.gemm Triton": _torch_provider(False),
    "JAX FP8 dot_general (XLA)": _jax_provider(False),
    "JAX fp32 dot, HIGHEST": _jax_provider(True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    print(f"# diagnose_fp8_gemm_noise, {environment_line()}\ndevice {args.device}, jax {jax.devices()[0].platform}")
    print(f"{'case':10s} {'provider':30s} {'rel':>9s} {'log2 err/sum|ab|':>17s} {'flips':>8s}")
    for what, a_fmt, m, n, k in CASES:
        a_values = torch.randn(m, k, generator=generator)
        b_scale = {"wgrad": 1.0, "subnormal": 2.0**-9}.get(what.split()[0], 0.05)
        b_values = torch.randn(n, k, generator=generator) * b_scale
        (a, a_j), (b, b_j) = _quantized(a_values, a_fmt, args.device), _quantized(b_values, "e4m3", args.device)
        a64, b64 = reference.dequantize(a).cpu().double(), reference.dequantize(b).cpu().double()
        exact, magnitude = a64 @ b64.T, a64.abs() @ b64.abs().T
        exact_codes = _e4m3_codes(exact)
        for provider, run in PROVIDERS.items():
            if provider.startswith(("torch", "fp8kernels")) and args.device == "cpu":
                continue
            out = run(a, b, a_j, b_j)
            error = (out - exact).abs()
            relative = relative_error(out, exact)
            worst = (error / magnitude.clamp_min(1e-300)).max().item()
            flips = (_e4m3_codes(out) != exact_codes).float().mean().item()
            log2 = math.log2(worst) if worst > 0 else -math.inf
            print(f"{what:10s} {provider:30s} {relative:9.2e} {log2:17.1f} {flips:8.2%}")


if __name__ == "__main__":
    main()
