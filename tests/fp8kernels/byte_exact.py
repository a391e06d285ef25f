"""Byte-exact comparison of a Triton quantizer's result with fp8kernels.reference's, and the seeded inputs of
the quantizer tests (test_quantize_exact, test_quantize_split_exact)."""

from __future__ import annotations

import torch

from fp8kernels import reference

FIELDS = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t's values in row-major order (1x128 scales are stored rows-contiguous by the Triton quantizers)."""
    return t.contiguous().view(torch.uint8)


def _describe_difference(field: str, got: torch.Tensor, expected: torch.Tensor, x: torch.Tensor) -> str:
    """The first differing positions with both bytes and, for data, the input element(s) they encode."""
    got_bytes, expected_bytes = _bytes(got).cpu(), _bytes(expected).cpu()
    if got_bytes.shape != expected_bytes.shape:
        return f"{field}: shape {tuple(got_bytes.shape)} != reference {tuple(expected_bytes.shape)}"
    differing = (got_bytes != expected_bytes).nonzero()[:5].tolist()
    x2d = x.reshape(-1, x.shape[-1]).float().cpu()
    operand = x2d.T if field.startswith("columnwise") else x2d
    packed = got.shape[-1] * 2 == operand.shape[-1]  # nvfp4: two elements per byte
    lines = [f"{field}: {int((got_bytes != expected_bytes).sum())} of {got_bytes.numel()} bytes differ"]
    for index in differing:
        where = tuple(index)
        if field.endswith("data"):
            i, j = index[0], index[1] if got_bytes.dim() > 1 else 0
            elements = operand[i, 2 * j : 2 * j + 2].tolist() if packed else [float(operand[i, j])]
            where = f"{where} x={elements}"
        both = f"triton {got_bytes[tuple(index)].tolist()} reference {expected_bytes[tuple(index)].tolist()}"
        lines.append(f"  at {where}: {both}")
    return "\n".join(lines)


def assert_same_bytes(got: reference.Quantized, expected: reference.Quantized, x: torch.Tensor) -> None:
    """Data and scale bytes equal (torch.equal on uint8 views); amaxes equal with NaN == NaN."""
    for field in FIELDS:
        a, b = getattr(got, field), getattr(expected, field)
        assert (a is None) == (b is None), f"{field}: triton has it: {a is not None}, the reference: {b is not None}"
        if a is not None:
            assert torch.equal(_bytes(a), _bytes(b)), _describe_difference(field, a, b, x)
    for field in ("amax", "columnwise_amax"):
        a, b = getattr(got, field), getattr(expected, field)
        assert (a is None) == (b is None), field
        if a is not None:
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    def layout(q):
        return q.scheme, q.fmt, q.shape, q.hadamard

    assert layout(got) == layout(expected)


def random_input(shape, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp2(torch.randint(-8, 9, shape, generator=generator).float())
    return (torch.randn(shape, generator=generator) * magnitudes).to(dtype).to(device)
