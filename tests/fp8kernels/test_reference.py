"""The reference quantizers against float64 models: error bounds, scales, layouts, delayed scaling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fp8kernels import reference as R
from tests.fp8kernels.format_models import LAYOUTS, format_max, rne_model

FP32_MAX = float(np.finfo(np.float32).max)


def _random(shape, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-6, 7, shape, generator=generator))
    return x.to(dtype)


def _half_ulp(scaled: np.ndarray, fmt: str) -> np.ndarray:
    """Half the spacing of the format's grid at |scaled| (the subnormal spacing below the normals)."""
    exponent_bits, mantissa_bits, _ = LAYOUTS[fmt]
    min_exponent = 2 - 2 ** (exponent_bits - 1)
    binade = np.floor(np.log2(np.maximum(scaled, 2.0**min_exponent)))
    return 0.5 * 2.0 ** (binade - mantissa_bits)


def _assert_within_bound(x: np.ndarray, dequantized: np.ndarray, encode: np.ndarray, fmt: str, ulps: float = 1.0):
    """|dq - x| <= (half an ulp at x's binade, or the clamp past max) / encode, plus fp32 slack."""
    fmax = format_max(fmt)
    scaled = np.abs(x) * encode
    bound = ulps * _half_ulp(np.minimum(scaled, fmax), fmt) / encode + np.maximum(scaled - fmax, 0) / encode
    bound = bound * (1 + 2.0**-18) + np.abs(x) * 2.0**-20
    error = np.abs(dequantized - x)
    worst = np.argmax(error - bound)
    assert np.all(error <= bound), f"x={x.flat[worst]} dq={dequantized.flat[worst]} bound={bound.flat[worst]}"


def _expand(per_block: np.ndarray, block, shape) -> np.ndarray:
    return np.repeat(np.repeat(per_block, block[0], 0), block[1], 1)[: shape[0], : shape[1]]


def _encode_factors(q: R.Quantized, columnwise: bool, operand_shape) -> np.ndarray:
    """Per element of the operand: the factor that took it onto the element grid (1 / scale_inv)."""
    scale_inv = (q.columnwise_scale_inv if columnwise else q.scale_inv)
    block = R.SCHEME_BLOCKS[q.scheme]
    if q.scheme == "mxfp8":
        per_block = 2.0 ** (127.0 - scale_inv.numpy().astype(np.float64))
    elif q.fmt == "e2m1":
        global_amax = float((q.columnwise_amax if columnwise else q.amax)[0])
        global_encode = 448.0 * 6 / global_amax if global_amax > 0 else 1.0
        per_block = global_encode / R.decode_fp8(scale_inv, "e4m3").double().numpy()
    else:
        per_block = 1.0 / scale_inv.double().numpy()
    if block is None:
        return np.full(operand_shape, per_block.item())
    return _expand(per_block, block, operand_shape)


QUANTIZERS = {
    "tensorwise_e4m3": lambda x: R.quantize_tensorwise(x, "e4m3", rowwise=True, columnwise=True),
    "tensorwise_e5m2_pow2": lambda x: R.quantize_tensorwise(x, "e5m2", power_2_scale=True, columnwise=True),
    "block1x128": lambda x: R.quantize_blockwise(x, "e4m3", (1, 128), columnwise=True),
    "block128x128_fp32scale": lambda x: R.quantize_blockwise(
        x, "e4m3", (128, 128), power_2_scale=False, columnwise=True
    ),
    "mxfp8_up": lambda x: R.quantize_mxfp8(x, "e4m3", columnwise=True),
    "mxfp8_floor_e5m2": lambda x: R.quantize_mxfp8(x, "e5m2", scale_rounding="floor", columnwise=True),
    "nvfp4_1x16": lambda x: R.quantize_nvfp4(x, columnwise=True),
    "nvfp4_16x16": lambda x: R.quantize_nvfp4(x, block=(16, 16), columnwise=True),
}


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_stays_within_half_an_ulp(name, dtype):
    x = _random((96, 160), dtype)
    q = QUANTIZERS[name](x)
    x64 = x.double().numpy()
    for columnwise in (False, True):
        operand = x64.T if columnwise else x64
        dequantized = R.dequantize(q, columnwise=columnwise).double().numpy()
        dequantized = dequantized.T if columnwise else dequantized
        _assert_within_bound(operand, dequantized, _encode_factors(q, columnwise, operand.shape), q.fmt)


def test_stochastic_nvfp4_stays_within_one_ulp():
    x = _random((32, 64))
    q = R.quantize_nvfp4(x, stochastic_seed=99)
    encode = _encode_factors(q, False, x.shape)
    _assert_within_bound(x.double().numpy(), R.dequantize(q).double().numpy(), encode, "e2m1", ulps=2.0)


def test_hadamard_copy_is_within_bound_in_the_rotated_domain():
    x = _random((64, 48))
    q = R.quantize_nvfp4(x, columnwise=True, hadamard=True)
    assert q.hadamard and q.columnwise_amax is not None
    rotated = R.random_hadamard_transform(x.T.contiguous())
    np.testing.assert_allclose(float(q.columnwise_amax[0]), float(rotated.abs().max()), rtol=0)
    # Rotate the dequantized copy forward again; per 16-tile the rotation keeps the l2 error.
    stored = R.random_hadamard_transform(R.dequantize(q, columnwise=True).T.contiguous()).double().numpy()
    encode = _encode_factors(q, True, rotated.shape)
    fmax = 6.0
    scaled = np.abs(rotated.double().numpy()) * encode
    bound = (_half_ulp(np.minimum(scaled, fmax), "e2m1") + np.maximum(scaled - fmax, 0)) / encode
    tile_error = np.linalg.norm((stored - rotated.double().numpy()).reshape(-1, 16), axis=1)
    tile_bound = np.linalg.norm(bound.reshape(-1, 16), axis=1) * 1.001 + 1e-5
    assert np.all(tile_error <= tile_bound)


# ----------------------------------------------------------------------------- scales and bytes vs models


def test_tensorwise_current_scaling_bytes_match_the_model():
    x = _random((40, 72), torch.bfloat16)
    q = R.quantize_tensorwise(x, "e4m3", columnwise=True)
    x32 = x.float().numpy()
    amax = float(np.abs(x32).max())
    scale = np.float32(448.0 / amax)
    assert float(q.amax[0]) == amax
    assert float(q.scale_inv[0]) == float(np.float32(1.0 / float(scale)))
    np.testing.assert_array_equal(q.data.numpy(), rne_model(x32 * scale, "e4m3"))
    assert torch.equal(q.columnwise_data, q.data.T) and torch.equal(q.columnwise_scale_inv, q.scale_inv)


def test_delayed_tensorwise_uses_the_given_scale_and_still_measures_amax():
    x = _random((8, 24))
    scale = torch.tensor([3.5])
    q = R.quantize_tensorwise(x, "e5m2", scale)
    np.testing.assert_array_equal(q.data.numpy(), rne_model(x.numpy() * np.float32(3.5), "e5m2"))
    assert float(q.scale_inv[0]) == float(np.float32(1 / 3.5)) and float(q.amax[0]) == float(x.abs().max())
    with pytest.raises(ValueError, match="given scale"):
        R.quantize_tensorwise(x, "e4m3", scale, power_2_scale=True)
    with pytest.raises(TypeError, match="fp32 tensor of one element"):
        R.quantize_tensorwise(x, "e4m3", torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match="move the scale"):
        R.quantize_tensorwise(x, "e4m3", torch.tensor([1.0], device="meta"))


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_block_scales_match_the_model_with_partial_edge_blocks(block):
    x = _random((130, 200))
    x[129, 150:] = 0  # the last row's second block is all zero: scale 1
    q = R.quantize_blockwise(x, "e4m3", block, columnwise=True)
    x64 = np.abs(x.double().numpy())
    rows, cols = -(-130 // block[0]), -(-200 // block[1])
    expected = np.ones((rows, cols))
    for i in range(rows):
        for j in range(cols):
            amax = x64[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].max()
            if amax > 0:
                expected[i, j] = 1.0 / 2.0 ** math.floor(math.log2(448.0 / amax))
    np.testing.assert_array_equal(q.scale_inv.double().numpy(), expected)
    if block == (128, 128):
        assert torch.equal(q.columnwise_data, q.data.T) and torch.equal(q.columnwise_scale_inv, q.scale_inv.T)
    else:
        assert q.columnwise_scale_inv.shape == (200, 2)


def test_mxfp8_bytes_match_the_model():
    x = _random((32, 64), torch.bfloat16)
    q = R.quantize_mxfp8(x, "e4m3", scale_rounding="floor")
    multiplier = _expand(2.0 ** (127.0 - q.scale_inv.numpy().astype(np.float64)), (1, 32), x.shape)
    np.testing.assert_array_equal(q.data.numpy(), rne_model(x.float().numpy() * multiplier, "e4m3"))


def test_nvfp4_2d_columnwise_is_the_transpose_and_nibbles_follow_elements():
    x = _random((48, 32))
    q = R.quantize_nvfp4(x, block=(16, 16), columnwise=True)
    assert torch.equal(R.unpack_fp4(q.columnwise_data), R.unpack_fp4(q.data).T)
    assert torch.equal(q.columnwise_scale_inv, q.scale_inv.T)
    assert torch.equal(q.amax, q.columnwise_amax)


def test_empty_and_high_rank_inputs():
    q = R.quantize_tensorwise(torch.zeros(0, 16), columnwise=True)
    assert q.data.shape == (0, 16) and q.columnwise_data.shape == (16, 0) and float(q.scale_inv[0]) == 1.0
    x = _random((2, 3, 32))
    assert R.dequantize(R.quantize_mxfp8(x)).shape == (2, 3, 32)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: R.quantize_mxfp8(x[:, :48]), ValueError, "multiple of 32"),
        (lambda x: R.quantize_mxfp8(x[:40], columnwise=True, rowwise=False), ValueError, r"row count \(M"),
        (lambda x: R.quantize_nvfp4(x[:, :24]), ValueError, "multiple of 16"),
        (lambda x: R.quantize_blockwise(x, block=(1, 64)), ValueError, "block=.1, 64."),
        (lambda x: R.quantize_tensorwise(x, "e2m1"), ValueError, "fmt='e2m1'"),
        (lambda x: R.quantize_tensorwise(x, rowwise=False), ValueError, "ask for at least one"),
        (lambda x: R.quantize_mxfp8(x, scale_rounding="down"), ValueError, "scale_rounding='down'"),
        (lambda x: R.quantize_tensorwise(x.int()), TypeError, "torch.int32"),
        (lambda x: R.quantize_tensorwise(x[0, 0]), ValueError, "0-d"),
        (lambda x: R.quantize_nvfp4(x, stochastic_seed=1.5), TypeError, "stochastic_seed"),
    ],
)
def test_bad_arguments_say_what_to_do(call, error, match):
    with pytest.raises(error, match=match):
        call(_random((64, 64)))


# ----------------------------------------------------------------------------- delayed scaling


def _delayed_model(history: list[list[float]], scale: list[float], fmax: float, margin: int, algo: str):
    """One step in float64 with explicit fp32 roundings, as TransformerEngine's formula reads; a non-finite
    step amax (row 0) is refused: recorded as 0, the scale kept."""
    columns = range(len(scale))
    refused = [not math.isfinite(history[0][j]) for j in columns]
    history = [[0.0 if refused[j] else a for j, a in enumerate(history[0])]] + history[1:]
    new_scale = []
    for j in columns:
        column = [row[j] for row in history]
        amax = (math.nan if any(map(math.isnan, column)) else max(column)) if algo == "max" else column[0]
        if amax > 0 and math.isfinite(amax) and not refused[j]:
            with np.errstate(over="ignore"):
                value = float(np.float32(float(np.float32(fmax / amax)) / 2.0**margin))
            new_scale.append(min(value, FP32_MAX))
        else:
            new_scale.append(scale[j])
    rolled = history[1:] + history[:1]
    rolled[0] = [0.0 for _ in columns]
    return rolled, new_scale


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1])
def test_delayed_scaling_matches_float64_model_over_50_steps(algo, margin):
    generator = torch.Generator().manual_seed(3)
    steps = torch.exp2(torch.rand(50, 2, generator=generator) * 40 - 20)
    steps[7, 0], steps[8, 1], steps[20, 0], steps[21, :] = 0.0, math.inf, 1e-40, math.nan
    steps[30:33, 1] = 0.0
    history = torch.zeros(6, 2)
    scale = torch.ones(2)
    model_history, model_scale = history.tolist(), scale.tolist()
    for amax in steps:
        history[0] = amax  # what the quantizations of one step write into slot 0
        model_history[0] = [float(a) for a in amax]
        history, scale = R.delayed_scaling_update(history, scale, 57344.0, margin=margin, algo=algo)
        model_history, model_scale = _delayed_model(model_history, model_scale, 57344.0, margin, algo)
        np.testing.assert_array_equal(history.double().numpy(), np.array(model_history))
        assert scale.double().tolist() == model_scale
    with pytest.raises(ValueError, match="amax_compute_algo"):
        R.delayed_scaling_update(history, scale, 448.0, algo="mean")
