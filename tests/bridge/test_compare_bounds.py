"""bridge.numerics' derived bounds for bridge.compare against what the arithmetic does: two summation orders of
random data stay within `rounding_error`, and FP8 casts of perturbed values flip no more codes than `flip_error`
allows."""

from __future__ import annotations

import math

import numpy as np
import torch

from bridge.numerics import FP32_U, MANTISSA_BITS, Reduction, chain_bound, flip_error, rounding_error


def test_two_summation_orders_stay_within_the_rounding_bound():
    rng = np.random.default_rng(0)
    for k in (16, 256, 1024):
        a = rng.standard_normal((64, k)).astype(np.float32)
        b = rng.standard_normal((k, 32)).astype(np.float32)
        forward = np.zeros((64, 32), np.float32)
        for i in range(k):  # one order: left to right, in fp32
            forward += np.outer(a[:, i], b[i])
        backward = np.zeros((64, 32), np.float32)
        for i in reversed(range(k)):  # the other: right to left
            backward += np.outer(a[:, i], b[i])
        relative = np.linalg.norm(forward - backward) / np.linalg.norm(backward)
        bound = rounding_error(k, forward.size, FP32_U, positive=False)
        assert 0 < relative <= bound, (k, relative, bound)


def test_fp8_flips_stay_within_the_flip_bound():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, generator=generator) * 8
    for delta in (1e-6, 1e-4, 1e-2):
        moved = x * (1 + delta * torch.randn(4096, generator=generator).clamp(-1, 1))  # each |dx| <= delta |x|
        a, b = x.to(torch.float8_e4m3fn).float(), moved.to(torch.float8_e4m3fn).float()
        relative = float((a - b).norm() / a.norm())
        assert relative <= flip_error(delta, x.numel(), MANTISSA_BITS["e4m3"]), (delta, relative)


def test_a_leaf_fp8_gemm_on_exact_inputs_keeps_the_fp32_bound():
    gemm = Reduction("gemm", 256, (64, 128), 128 * 64, 128 * 256, FP32_U)
    off = chain_bound([gemm], mantissa_bits=None)
    fp8 = chain_bound([gemm], mantissa_bits=(3, 2))
    assert fp8[0] == off[0]  # its input and weight are exact: the same codes on both sides
    assert fp8[1] > off[1]  # its backward casts gradients that differ
    two = chain_bound([gemm, gemm], mantissa_bits=(3, 2))[0]
    assert two > 2 * off[0] and math.isfinite(two)  # the second cast sees a perturbed input


def test_flips_after_16_bit_roundings_stay_within_the_bound_on_the_unrounded_delta():
    """Values apart by delta before r bf16 roundings (each an inexact multiply) flip at most what
    flip_error allows for delta (1 + 2r): the roundings themselves add no delta of their own."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 16, generator=generator) * 8
    factors = [1 + torch.rand(x.numel(), generator=generator) for _ in range(3)]
    for delta in (1e-6, 1e-4):
        moved = x * (1 + delta * torch.randn(x.numel(), generator=generator).clamp(-1, 1))
        for r in range(3):
            a, b = x.bfloat16(), moved.bfloat16()
            for factor in factors[:r]:  # each product rounds to bf16 again
                a, b = (a.float() * factor).bfloat16(), (b.float() * factor).bfloat16()
            codes_a, codes_b = a.to(torch.float8_e4m3fn).float(), b.to(torch.float8_e4m3fn).float()
            relative = float((codes_a - codes_b).norm() / codes_a.norm())
            bound = flip_error(delta * (1 + 2 * (r + 1)), x.numel(), MANTISSA_BITS["e4m3"])  # + the first rounding
            assert relative <= bound, (delta, r, relative, bound)
            assert bound < flip_error(delta + 2 * 2.0**-8, x.numel(), MANTISSA_BITS["e4m3"])  # tighter than before


def test_the_recorder_counts_16_bit_roundings_and_takes_an_amax_for_exact():
    from bridge.model_compare.recorder import Call, _ReductionRecorder

    a, w = torch.randn(8, 16), torch.randn(16, 4)
    call = Call("block", (), {}, None)
    with _ReductionRecorder([call]):
        h = (a @ w).bfloat16()  # a narrowing copy: one rounding
        h = torch.nn.functional.silu(h) * h.abs()  # silu and the product round, abs is exact
        torch.linalg.vector_norm(h, float("inf"))  # an FP8 cast's amax: a max, no sum
        h.float() @ w.T
    assert [(r.kind, r.roundings) for r in call.reductions] == [("gemm", 0), ("gemm", 3)]
