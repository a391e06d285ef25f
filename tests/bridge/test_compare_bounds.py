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
