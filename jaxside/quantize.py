"""The quantizers of fp8kernels/reference.py in jnp: the same functions, arguments and bytes.

docs/quantization.md is the contract, fp8kernels/reference.py the spec. Vocabulary as there: `x` is
viewed as a matrix [M, K]; the rowwise copy quantizes x, the columnwise copy quantizes x.T ([K, M]).

Each quantizer checks its arguments in Python (the same errors as the torch side), converts x to
fp32 (exactly), and runs a core that is jitted once per shape and static arguments (format, block,
flags). It also runs inside a caller's `jax.jit` when those arguments are static; scales and
stochastic-rounding seeds may be traced. Results are `Quantized`, a pytree of jnp arrays.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from jaxside._checks import check_global_amax, check_scale_or_amax, check_seed, matrix_view
from jaxside._fp32 import INF_BITS, divide, is_finite, max_magnitude, multiply, to_bits
from jaxside.formats import (
    decode_e2m1,
    decode_fp8,
    e8m0_encode_multiplier,
    e8m0_from_amax,
    encode_e2m1,
    encode_fp8,
    pack_fp4,
    random_hadamard_transform,
    scale_from_amax,
    stochastic_rounding_bits,
    unpack_fp4,
)
from twinspec.checks import check_block, check_divisible, check_roles, element_format
from twinspec.formats import FORMATS, FP8_FORMATS, FP32_MAX, NVFP4_GLOBAL_MAX, SCHEME_BLOCKS

BUFFERS = ("data", "scale_inv", "columnwise_data", "columnwise_scale_inv", "amax", "columnwise_amax")


@dataclass
class Quantized:
    """The bytes of one quantized tensor; `scale_inv` is the stored scale (x ~ q * scale_inv)."""

    scheme: str  # a key of SCHEME_BLOCKS
    fmt: str  # "e4m3" | "e5m2" | "e2m1"
    shape: tuple[int, ...]  # logical shape of the input
    data: Array | None  # rowwise bytes, uint8 [M, K] (nvfp4: [M, K // 2])
    scale_inv: Array | None
    columnwise_data: Array | None  # rowwise quantization of x.T: uint8 [K, M] (nvfp4: [K, M // 2])
    columnwise_scale_inv: Array | None
    amax: Array | None  # fp32 (1,): amax of x (tensorwise), the rowwise global amax (nvfp4)
    columnwise_amax: Array | None = None  # nvfp4: global amax of the columnwise operand (after the RHT)
    hadamard: bool = False  # nvfp4: the columnwise operand is random_hadamard_transform(x.T)


jax.tree_util.register_dataclass(
    Quantized, data_fields=list(BUFFERS), meta_fields=["scheme", "fmt", "shape", "hadamard"]
)

# ----------------------------------------------------------------------------- amax and blocks


def tensor_amax(x2d) -> Array:
    """max |x| as fp32 (1,); NaN if any element is NaN; 0 for an empty array."""
    return max_magnitude(x2d).reshape(1)


def block_amax(operand, block: tuple[int, int]) -> Array:
    """max |x| per block [rows, cols] of the operand (partial edge blocks allowed), NaN-propagating."""
    rows, cols = operand.shape
    block_rows, block_cols = block
    row_blocks, col_blocks = -(-rows // block_rows), -(-cols // block_cols)
    padded = jnp.pad(operand, ((0, row_blocks * block_rows - rows), (0, col_blocks * block_cols - cols)))
    return max_magnitude(padded.reshape(row_blocks, block_rows, col_blocks, block_cols), axis=(1, 3))


def expand_blocks(per_block, block: tuple[int, int], shape: tuple[int, int]) -> Array:
    """One value per block -> one per element of an operand of `shape`."""
    full = jnp.repeat(jnp.repeat(per_block, block[0], axis=0), block[1], axis=1)
    return full[: shape[0], : shape[1]]


def nvfp4_global_encode(global_amax) -> Array:
    """(448 * 6) / global_amax in fp32; 1 for amax 0/inf/NaN, fp32 max on overflow."""
    return scale_from_amax(global_amax, NVFP4_GLOBAL_MAX)


# ----------------------------------------------------------------------------- cores (jitted)


def scaled_for_cast(x, scale) -> Array:
    """x * scale rounded as IEEE fp32 does, for a cast to FP8 right after (only a clip between them).

    On the CPU, XLA flushes subnormals, so the product is computed with integer operations
    (_fp32.multiply). XLA:GPU keeps subnormals and rounds a float multiply to nearest even, so on CUDA
    the hardware's multiply gives the same bits in one instruction (the integer product costs the FP8
    step several milliseconds); no add follows it here, so it cannot be contracted into an FMA.
    """
    return lax.platform_dependent(x, scale, cuda=jnp.multiply, default=multiply)


def _roles(rowwise: bool, columnwise: bool, rowwise_pair, columnwise_pair) -> tuple:
    """(data, scale_inv, columnwise_data, columnwise_scale_inv) with None for a copy not asked for."""
    return (*(rowwise_pair if rowwise else (None, None)), *(columnwise_pair if columnwise else (None, None)))


@partial(jax.jit, static_argnames=("fmt", "power_2_scale", "amax_epsilon", "rowwise", "columnwise"))
def _tensorwise_core(x2d, scale, given_amax, *, fmt, power_2_scale, amax_epsilon, rowwise, columnwise):
    amax = tensor_amax(x2d)  # measured in every mode: delayed scaling records it in the history
    if scale is None:
        from_amax = amax if given_amax is None else given_amax
        scale = scale_from_amax(from_amax, FORMATS[fmt].max, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon)
    scale_inv = divide(1.0, scale)
    codes = encode_fp8(scaled_for_cast(x2d, scale), fmt)  # elementwise, so the columnwise copy is its transpose
    return *_roles(rowwise, columnwise, (codes, scale_inv), (codes.T, scale_inv)), amax


def _blockwise_operand(operand, fmt: str, block: tuple[int, int], power_2_scale: bool) -> tuple[Array, Array]:
    """(codes, fp32 scale_inv per block) of one operand."""
    scale = scale_from_amax(block_amax(operand, block), FORMATS[fmt].max, power_2_scale=power_2_scale)
    codes = encode_fp8(scaled_for_cast(operand, expand_blocks(scale, block, operand.shape)), fmt)
    return codes, divide(1.0, scale)


@partial(jax.jit, static_argnames=("fmt", "block", "power_2_scale", "rowwise", "columnwise"))
def _blockwise_core(x2d, *, fmt, block, power_2_scale, rowwise, columnwise):
    rowwise_pair = _blockwise_operand(x2d, fmt, block, power_2_scale) if rowwise else None
    columnwise_pair = _blockwise_operand(x2d.T, fmt, block, power_2_scale) if columnwise else None
    return _roles(rowwise, columnwise, rowwise_pair, columnwise_pair)


def _mxfp8_operand(operand, fmt: str, scale_rounding: str) -> tuple[Array, Array]:
    """(codes, e8m0 scale per 32 elements) of one operand."""
    exponent = e8m0_from_amax(block_amax(operand, (1, 32)), fmt, scale_rounding)
    multiplier = e8m0_encode_multiplier(exponent, scale_rounding)
    return encode_fp8(scaled_for_cast(operand, expand_blocks(multiplier, (1, 32), operand.shape)), fmt), exponent


@partial(jax.jit, static_argnames=("fmt", "scale_rounding", "rowwise", "columnwise"))
def _mxfp8_core(x2d, *, fmt, scale_rounding, rowwise, columnwise):
    rowwise_pair = _mxfp8_operand(x2d, fmt, scale_rounding) if rowwise else None
    columnwise_pair = _mxfp8_operand(x2d.T, fmt, scale_rounding) if columnwise else None
    return _roles(rowwise, columnwise, rowwise_pair, columnwise_pair)


def _nvfp4_operand(operand, global_amax, block: tuple[int, int], seed) -> tuple[Array, Array]:
    """(packed e2m1 bytes, e4m3 scale per block) of one operand."""
    global_encode = nvfp4_global_encode(global_amax)
    per_element_max = divide(block_amax(operand, block), FORMATS["e2m1"].max)
    block_scale = encode_fp8(multiply(per_element_max, global_encode), "e4m3")
    block_scale_f32 = decode_fp8(block_scale, "e4m3")
    encode = jnp.where(block_scale_f32 == 0, 0.0, divide(global_encode, block_scale_f32))
    values = multiply(operand, expand_blocks(encode, block, operand.shape))
    random_bits = None
    if seed is not None:
        rows, cols = operand.shape  # index = row * C + col, mod 2^32
        index = jnp.arange(rows, dtype=jnp.uint32)[:, None] * np.uint32(cols) + jnp.arange(cols, dtype=jnp.uint32)
        random_bits = stochastic_rounding_bits(seed, index)
    return pack_fp4(encode_e2m1(values, random_bits)), block_scale


@partial(jax.jit, static_argnames=("block", "hadamard", "rowwise", "columnwise"))
def _nvfp4_core(x2d, seed, global_amax, *, block, hadamard, rowwise, columnwise):
    amax = tensor_amax(x2d) if global_amax is None else global_amax
    rowwise_pair = _nvfp4_operand(x2d, amax, block, seed) if rowwise else None
    columnwise_pair, columnwise_amax = None, None
    if columnwise:
        operand = random_hadamard_transform(x2d.T) if hadamard else x2d.T
        columnwise_amax = tensor_amax(operand) if hadamard else amax  # x.T's amax is x's (or the given one)
        columnwise_pair = _nvfp4_operand(operand, columnwise_amax, block, seed)
    return *_roles(rowwise, columnwise, rowwise_pair, columnwise_pair), amax, columnwise_amax


# ----------------------------------------------------------------------------- quantizers


def quantize_tensorwise(
    x,
    fmt: str = "e4m3",
    scale=None,
    *,
    amax=None,
    power_2_scale: bool = False,
    amax_epsilon: float = 0.0,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Quantized:
    """One fp32 scale for the tensor: current scaling (scale=None) or a given delayed-scaling scale.

    Current scaling scales from x's amax, or from a given `amax` (fp32, one element: that of all the
    shards x is one of, so that each casts as the whole tensor would). The result's amax is x's own.
    """
    element_format(fmt, FP8_FORMATS)
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    scale, amax = check_scale_or_amax(scale, amax, power_2_scale, amax_epsilon)
    buffers = _tensorwise_core(
        x2d,
        scale,
        amax,
        fmt=fmt,
        power_2_scale=power_2_scale,
        amax_epsilon=float(amax_epsilon),
        rowwise=rowwise,
        columnwise=columnwise,
    )
    return Quantized("tensorwise", fmt, shape, *buffers)


def quantize_blockwise(
    x,
    fmt: str = "e4m3",
    block: tuple[int, int] = (1, 128),
    *,
    power_2_scale: bool = True,
    rowwise: bool = True,
    columnwise: bool = False,
) -> Quantized:
    """fp32 scale per 1x128 (activations, grads) or 128x128 (weights) block; edge blocks may be partial."""
    element_format(fmt, FP8_FORMATS)
    block = check_block(block, ((1, 128), (128, 128)), "quantize_blockwise")
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    buffers = _blockwise_core(
        x2d, fmt=fmt, block=block, power_2_scale=power_2_scale, rowwise=rowwise, columnwise=columnwise
    )
    return Quantized(f"block{block[0]}x{block[1]}", fmt, shape, *buffers, amax=None)


def quantize_mxfp8(
    x, fmt: str = "e4m3", *, scale_rounding: str = "up", rowwise: bool = True, columnwise: bool = False
) -> Quantized:
    """E8M0 scale per 32 consecutive elements of an operand row (OCP MX)."""
    element_format(fmt, FP8_FORMATS)
    if scale_rounding not in ("up", "floor"):
        raise ValueError(f"scale_rounding={scale_rounding!r}: use 'up' (TransformerEngine, JAX) or 'floor' (OCP MX)")
    check_roles(rowwise, columnwise)
    x2d, shape = matrix_view(x)
    if rowwise:
        check_divisible(x2d.shape[1], 32, "mxfp8", "rowwise")
    if columnwise:
        check_divisible(x2d.shape[0], 32, "mxfp8", "columnwise")
    buffers = _mxfp8_core(x2d, fmt=fmt, scale_rounding=scale_rounding, rowwise=rowwise, columnwise=columnwise)
    return Quantized("mxfp8", fmt, shape, *buffers, amax=None)


def quantize_nvfp4(
    x,
    *,
    block: tuple[int, int] = (1, 16),
    hadamard: bool = False,
    stochastic_seed=None,
    rowwise: bool = True,
    columnwise: bool = False,
    global_amax=None,
) -> Quantized:
    """E2M1 values, an e4m3 scale per 1x16 or 16x16 block and an fp32 global scale from the operand's amax.

    stochastic_seed: an int, or an integer jax scalar (traced seeds do not recompile).
    `global_amax` (fp32, one element) replaces x's own amax: that of the whole tensor when x is one
    shard of it, so every shard casts as the whole tensor would. It cannot stand for the amax of a
    Hadamard-rotated columnwise copy.
    """
    block = check_block(block, ((1, 16), (16, 16)), "quantize_nvfp4")
    check_roles(rowwise, columnwise)
    seed = check_seed(stochastic_seed)
    global_amax = check_global_amax(global_amax, hadamard and columnwise)
    x2d, shape = matrix_view(x)
    if rowwise:
        check_divisible(x2d.shape[1], 16, "nvfp4", "rowwise")
    if columnwise:
        check_divisible(x2d.shape[0], 16, "nvfp4", "columnwise")
    buffers = _nvfp4_core(
        x2d, seed, global_amax, block=block, hadamard=hadamard, rowwise=rowwise, columnwise=columnwise
    )
    return Quantized(f"nvfp4_{block[0]}x{block[1]}", "e2m1", shape, *buffers, hadamard=hadamard)


QUANTIZERS = {
    "quantize_tensorwise": quantize_tensorwise,
    "quantize_blockwise": quantize_blockwise,
    "quantize_mxfp8": quantize_mxfp8,
    "quantize_nvfp4": quantize_nvfp4,
}


def quantize_numpy(x: np.ndarray, function: str, **kwargs) -> dict[str, np.ndarray]:
    """Run one quantizer (by name, with its keyword arguments) on a numpy array; its buffers as numpy.

    For `shardbridge quantize --compare`: the keys are the torch Quantized's buffer names, present
    where produced. x may be float32, float16 or ml_dtypes.bfloat16; `scale`, `amax` and `global_amax`
    any fp32 array-like.
    """
    if function not in QUANTIZERS:
        raise ValueError(f"function={function!r} is not a quantizer; use one of {sorted(QUANTIZERS)}")
    for given in ("scale", "amax", "global_amax"):
        if kwargs.get(given) is not None:
            kwargs[given] = np.asarray(kwargs[given])
    q = QUANTIZERS[function](np.asarray(x), **kwargs)
    return {name: np.asarray(getattr(q, name)) for name in BUFFERS if getattr(q, name) is not None}


# ----------------------------------------------------------------------------- dequantize


@partial(jax.jit, static_argnames=("dtype", "columnwise"))
def _dequantize_core(q: Quantized, *, dtype, columnwise):
    data = q.columnwise_data if columnwise else q.data
    scale_inv = q.columnwise_scale_inv if columnwise else q.scale_inv
    block = SCHEME_BLOCKS[q.scheme]
    if q.fmt == "e2m1":
        global_amax = q.columnwise_amax if columnwise else q.amax
        values = decode_e2m1(unpack_fp4(data))
        values = multiply(values, expand_blocks(decode_fp8(scale_inv, "e4m3"), block, values.shape))
        values = divide(values, nvfp4_global_encode(global_amax))
        if columnwise and q.hadamard:
            values = random_hadamard_transform(values, inverse=True)
    elif q.scheme == "mxfp8":
        values = multiply(decode_fp8(data, q.fmt), expand_blocks(decode_fp8(scale_inv, "e8m0"), block, data.shape))
    elif block is None:
        values = multiply(decode_fp8(data, q.fmt), scale_inv)
    else:
        values = multiply(decode_fp8(data, q.fmt), expand_blocks(scale_inv, block, data.shape))
    if columnwise:
        values = values.T
    return values.reshape(q.shape).astype(dtype)


def dequantize(q: Quantized, dtype=jnp.float32, *, columnwise: bool = False) -> Array:
    """Values of the rowwise (or columnwise) copy, in x's shape; a Hadamard-rotated copy is rotated back."""
    if (q.columnwise_data if columnwise else q.data) is None:
        raise ValueError(f"this Quantized has no {'columnwise' if columnwise else 'rowwise'} copy; quantize with it")
    return _dequantize_core(q, dtype=np.dtype(dtype), columnwise=columnwise)


# ----------------------------------------------------------------------------- delayed scaling


@partial(jax.jit, static_argnames=("fmax", "margin", "algo"))
def _delayed_scaling_core(amax_history, scale, *, fmax, margin, algo):
    accepted = is_finite(amax_history[0])  # a non-finite step amax is refused: recorded as 0, the scale kept
    history = amax_history.at[0].set(jnp.where(accepted, amax_history[0], 0.0))
    amax = max_magnitude(history, axis=0) if algo == "max" else history[0]
    new_scale = divide(divide(fmax, amax), np.float32(2.0**margin))
    new_scale = jnp.where(jnp.isinf(new_scale), jnp.float32(FP32_MAX), new_scale)
    amax_bits = to_bits(amax)
    positive_and_finite = (amax_bits != 0) & (amax_bits < INF_BITS)  # on the bits: XLA CPU reads subnormals as 0
    new_scale = jnp.where(positive_and_finite & accepted, new_scale, scale)
    new_history = jnp.roll(history, -1, axis=0).at[0].set(0.0)
    return new_history, new_scale


def delayed_scaling_update(
    amax_history, scale, fmax: float, *, margin: float = 0, algo: str = "max"
) -> tuple[Array, Array]:
    """One delayed-scaling step: a new scale from the history, then the history rolled (row 0 zeroed).

    amax_history is fp32 [history_len, ...] of amaxes (>= 0) with row 0 the slot the next
    quantizations write; scale is fp32 [...]. Returns new arrays. A non-finite amax in row 0 is
    refused: the scale stays and the history records 0 in its place (fp8kernels.reference's rule).
    """
    if algo not in ("max", "most_recent"):
        raise ValueError(f"amax_compute_algo={algo!r}: use 'max' or 'most_recent'")
    history = jnp.asarray(amax_history, jnp.float32)
    return _delayed_scaling_core(
        history, jnp.asarray(scale, jnp.float32), fmax=float(fmax), margin=float(margin), algo=algo
    )
