"""fp8kernels.norm (Triton: interpreted on CPU, compiled with `-m gpu`) and its spec fp8kernels.norm_reference
against float64 torch (F.layer_norm / F.rms_norm and their autograd), and the fused FP8 cast
byte for byte against fp8kernels.reference quantizing the kernel's own fp32 output.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fp8kernels import norm, norm_reference
from fp8kernels import reference as R
from fp8kernels.norm_reference import FusedCast
from tests.fp8kernels.devices import DEVICES

IMPLEMENTATIONS = {"triton": norm, "reference": norm_reference}
# one element, a tail tile, partial 128-blocks, 3-D; on CUDA also the benchmark's row length
SHAPES = [(1, 1), (33, 1023), (7, 300), (2, 5, 96), pytest.param((300, 8192), marks=pytest.mark.gpu)]
FP32_TOLERANCE = 1e-5  # relative to the magnitude of the terms summed (fp32 sums over <= 8192 elements)
BF16_ROUNDING = 2.0**-8  # a bf16 output: half an ulp (2^-9) of rounding, doubled for the error before it
FLOAT64_NOISE = 1e-12  # the float64 reference's own rounding where the exact value is 0
NORM_GRID = [
    pytest.mark.parametrize("device", DEVICES),
    pytest.mark.parametrize("implementation", IMPLEMENTATIONS),
    pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zero-centered"]),
    pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"]),
    pytest.mark.parametrize("kind", ["layer", "rms"]),
    pytest.mark.parametrize("shape", SHAPES, ids=str),
]


def on_norm_grid(test):
    """Run `test` over every device, implementation, gamma form, dtype, norm and shape."""
    for mark in NORM_GRID:
        test = mark(test)
    return test


def _inputs(shape, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    hidden = shape[-1]
    x = torch.randn(shape, generator=generator) * 3 + 0.5  # an offset, so LayerNorm's centering matters
    weight = torch.randn(hidden, generator=generator) * 0.5 + 1
    bias = torch.randn(hidden, generator=generator)
    dy = torch.randn(shape, generator=generator)
    return [t.to(device, dtype) for t in (x, weight, bias, dy)]


def _forward(module, kind, x, weight, bias, **kwargs):
    if kind == "layer":
        return module.layer_norm_forward(x, weight, bias, **kwargs)
    return module.rms_norm_forward(x, weight, **kwargs)


def _backward(module, kind, dy, x, weight, forward, **kwargs):
    if kind == "layer":
        return module.layer_norm_backward(dy, x, weight, forward.mean, forward.rstd, **kwargs)
    return module.rms_norm_backward(dy, x, weight, forward.rstd, **kwargs)


def _float64_norm(kind, x, weight, bias, zero_centered_gamma, eps=1e-5):
    """(y, x, gamma, bias) in float64 with grads enabled: torch's own norms, the independent reference."""
    x64 = x.detach().double().requires_grad_()
    gamma = (weight.double() + (1.0 if zero_centered_gamma else 0.0)).requires_grad_()
    bias64 = bias.detach().double().requires_grad_()
    hidden = (x.shape[-1],)
    y = F.layer_norm(x64, hidden, gamma, bias64, eps) if kind == "layer" else F.rms_norm(x64, hidden, gamma, eps)
    return y, x64, gamma, bias64


def _float64_statistics(kind, x, eps=1e-5):
    """(mean, rstd, xhat as [R, H]) in float64."""
    x2d = x.double().reshape(-1, x.shape[-1])
    mean = x2d.mean(dim=1) if kind == "layer" else torch.zeros_like(x2d[:, 0])
    rstd = torch.rsqrt(((x2d - mean[:, None]) ** 2).mean(dim=1) + eps)
    return mean, rstd, (x2d - mean[:, None]) * rstd[:, None]


def assert_within(got, want, magnitude, tolerance, dtype, what):
    """|got - want| <= tolerance * magnitude (+ bf16 rounding of want) everywhere, nothing non-finite."""
    got, want, magnitude = (t.detach().cpu().double() for t in (got, want, magnitude))
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    rounding = BF16_ROUNDING * want.abs() if dtype == torch.bfloat16 else 0.0
    bound = tolerance * magnitude + FLOAT64_NOISE + rounding
    error = (got - want).abs()
    worst = int((error - bound).flatten().argmax())
    got_worst, want_worst, bound_worst = (t.flatten()[worst].item() for t in (got, want, bound))
    assert (error <= bound).all(), (
        f"{what}: {int((error > bound).sum())} of {error.numel()} outside; worst flat index {worst}: "
        f"got {got_worst} want {want_worst} bound {bound_worst:.3g}"
    )


@on_norm_grid
def test_forward_matches_float64_torch(device, implementation, zero_centered_gamma, dtype, kind, shape):
    x, weight, bias, _ = _inputs(shape, dtype, device)
    result = _forward(IMPLEMENTATIONS[implementation], kind, x, weight, bias, zero_centered_gamma=zero_centered_gamma)
    y64, _, gamma64, bias64 = _float64_norm(kind, x, weight, bias, zero_centered_gamma)
    mean64, rstd64, xhat = _float64_statistics(kind, x)
    assert result.out.dtype == dtype and result.out.shape == x.shape
    terms = (xhat.reshape(shape) * gamma64).abs() + (bias64.abs() if kind == "layer" else 0)
    assert_within(result.out, y64, terms, FP32_TOLERANCE, dtype, "out")
    assert_within(result.rstd, rstd64, rstd64, FP32_TOLERANCE, None, "rstd")
    if kind == "layer":
        x_size = x.double().reshape(-1, shape[-1]).abs().mean(dim=1)
        assert_within(result.mean, mean64, x_size, FP32_TOLERANCE, None, "mean")
    else:
        assert result.mean is None


@on_norm_grid
def test_backward_matches_float64_autograd(device, implementation, zero_centered_gamma, dtype, kind, shape):
    module = IMPLEMENTATIONS[implementation]
    x, weight, bias, dy = _inputs(shape, dtype, device)
    forward = _forward(module, kind, x, weight, bias, zero_centered_gamma=zero_centered_gamma)
    grads = _backward(module, kind, dy, x, weight, forward, zero_centered_gamma=zero_centered_gamma)
    y64, x64, gamma64, bias64 = _float64_norm(kind, x, weight, bias, zero_centered_gamma)
    y64.backward(dy.double())
    _, rstd64, xhat = _float64_statistics(kind, x)
    dy2d = dy.double().reshape(xhat.shape)
    gdy = gamma64.detach() * dy2d
    # dx = rstd * (gdy - xhat * mean(xhat * gdy) - mean(gdy)): bound by the size of its terms
    dx_terms = gdy.abs() + xhat.abs() * (xhat * gdy).abs().mean(1, keepdim=True) + gdy.abs().mean(1, keepdim=True)
    assert grads.dx.dtype == dtype and grads.dweight.dtype == dtype
    assert_within(grads.dx, x64.grad, (rstd64[:, None] * dx_terms).reshape(shape), FP32_TOLERANCE, dtype, "dx")
    assert_within(grads.dweight, gamma64.grad, (dy2d * xhat).abs().sum(0), FP32_TOLERANCE, dtype, "dweight")
    if kind == "layer":
        assert_within(grads.dbias, bias64.grad, dy2d.abs().sum(0), FP32_TOLERANCE, dtype, "dbias")
    else:
        assert grads.dbias is None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32)) or bool((a.isnan() & b.isnan()).all())


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # numpy: fmax / 0 for empty blocks, then replaced
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scheme", ["tensorwise", "block1x128"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_fused_cast_bytes_equal_reference_quantize_of_the_kernels_output_exact(device, scheme, fmt, kind):
    x, weight, bias, _ = _inputs((9, 300), torch.float32, device, seed=3)
    x[4] = float("nan")  # a NaN row: its bytes are the canonical NaN, the amax NaN
    x[6, :] = 0.0  # an all-constant row: y = bias (LayerNorm) or 0
    # a scale that saturates the largest outputs (values past the format's max clamp)
    scale = torch.tensor([R.FORMATS[fmt].max / 2.0], device=device) if scheme == "tensorwise" else None
    cast = FusedCast(fmt, scheme, scale, keep_output=True)
    options = {"zero_centered_gamma": True, "out_dtype": torch.float32}
    fused = _forward(norm, kind, x, weight, bias, cast=cast, **options)
    plain = _forward(norm_reference, kind, x, weight, bias, **options)
    finite = torch.isfinite(plain.out)
    assert torch.equal(finite, torch.isfinite(fused.out))
    assert_within(fused.out[finite], plain.out[finite], plain.out[finite].abs() + 1, FP32_TOLERANCE, None, "out")
    # bit-exact from here: the bytes of the kernel's own fp32 output
    if scheme == "tensorwise":
        expected = R.quantize_tensorwise(fused.out, fmt, scale=scale)
        assert _same_bits(fused.amax, expected.amax) and _same_bits(fused.quantized.amax, expected.amax)
    else:
        expected = R.quantize_blockwise(fused.out, fmt, (1, 128), power_2_scale=True)
    assert fused.quantized.scheme == scheme and fused.quantized.shape == expected.shape
    assert torch.equal(fused.quantized.data, expected.data), (fused.quantized.data != expected.data).nonzero()[:5]
    assert torch.equal(fused.quantized.scale_inv, expected.scale_inv)
    if scheme == "block1x128":  # stored rows-contiguous, as cuBLASLt reads 1x128 scales
        assert fused.quantized.scale_inv.stride() == (1, x.shape[0])
    # without keep_output, or with a bf16 output, the pass writes the same bytes (cast from fp32 y)
    bytes_only = _forward(norm, kind, x, weight, bias, zero_centered_gamma=True, cast=FusedCast(fmt, scheme, scale))
    assert bytes_only.out is None and torch.equal(bytes_only.quantized.data, expected.data)
    with_bf16 = _forward(norm, kind, x, weight, bias, cast=cast, **{**options, "out_dtype": torch.bfloat16})
    assert torch.equal(with_bf16.quantized.data, expected.data)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_return_amax_is_the_stored_outputs_so_current_scaling_casts_in_one_more_pass(device, kind):
    x, weight, bias, _ = _inputs((20, 200), torch.bfloat16, device, seed=4)
    result = _forward(norm, kind, x, weight, bias, return_amax=True)
    assert _same_bits(result.amax, R.tensor_amax(result.out.float()))
    current = R.quantize_tensorwise(result.out, "e4m3")
    from_amax = R.quantize_tensorwise(result.out, "e4m3", scale=R.scale_from_amax(result.amax, 448.0))
    assert torch.equal(current.data, from_amax.data) and torch.equal(current.scale_inv, from_amax.scale_inv)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_past_the_end_of_x_stay_out_of_the_amax(device):
    """A program's tile runs past the last row; there LayerNorm would compute y = bias. Make |bias| >> |y|."""
    x, weight, _, _ = _inputs((1, 200), torch.float32, device, seed=6)
    xhat = (x - x.mean()) * torch.rsqrt(x.var(unbiased=False) + 1e-5)
    bias = -(xhat * weight).reshape(-1)  # y = xhat * weight + bias is about 0
    result = norm.layer_norm_forward(x, weight, bias, return_amax=True)
    assert result.amax.item() < 1e-3 * bias.abs().max().item()
    assert _same_bits(result.amax, R.tensor_amax(result.out))


def test_autotune_pruning_reads_arguments_the_kernels_have():
    """The pruner runs only on CUDA (the interpreter gets one config): check its logic and names here."""
    configs = ["first", "second"]
    assert norm._tune_big_problems_only(configs, {"R": 16, "H": 8192}) == ["first"]
    assert norm._tune_big_problems_only(configs, {"R": 16384, "H": 8192}) == configs
    for kernel in (norm._norm_forward_kernel, norm._norm_backward_kernel):
        assert {"R", "H"} <= set(kernel.arg_names)


def _rms(x=(2, 8), weight=8, **kwargs):
    return norm.rms_norm_forward(torch.zeros(x), torch.ones(weight), **kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: norm.rms_norm_forward(torch.zeros(2, 8).half(), torch.ones(8)), TypeError, "float32 or bfloat16"),
        (lambda: _rms(weight=7), ValueError, r"shape \(8,\)"),
        (lambda: _rms(cast=FusedCast()), ValueError, "return_amax=True"),
        (lambda: _rms(cast=FusedCast(fmt="e2m1", scheme="block1x128")), ValueError, "fmt"),
        (lambda: _rms(x=(1, norm.MAX_HIDDEN + 1), weight=norm.MAX_HIDDEN + 1), ValueError, "split the last dim"),
        (lambda: norm.rms_norm_backward(*torch.zeros(2, 2, 8), torch.ones(8), torch.ones(3)), ValueError, "rstd"),
    ],
    ids=["fp16-input", "weight-shape", "tensorwise-without-scale", "fp4-cast", "too-wide", "rstd-shape"],
)
def test_user_errors_name_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()
