"""The modules' differentiable functions: the FP8 linear (a jax.custom_vjp), the high-precision linear, the norms.

Shape legend: T tokens (all leading dims of the input, flattened), I in features, O out features.
A Flax kernel is [I, O]. The FP8 math quantizes w_OI = kernel.T, the torch weight, so every operand
is the matrix torchside quantizes, with the same blocks and therefore the same bytes:

    fprop  y_TO       = x rowwise [T, I] @ (w rowwise [O, I])^T          (+ bias, in fp32)
    dgrad  dx_TI      = dy rowwise [T, O] @ w columnwise [O, I]
    wgrad  dkernel_IO = (x columnwise [T, I])^T @ dy columnwise [T, O]

(a columnwise copy is the quantized transpose, stored [cols, rows]). Every GEMM takes its operands as
fp8kernels.gemm does, both with K last: fprop (x rowwise, w rowwise), dgrad (dy rowwise, w columnwise),
wgrad (x columnwise, dy columnwise), which gives dkernel_IO directly. Per-tensor operands (delayed and
current scaling) are multiplied as FP8 codes in one `dot_general` with fp32 accumulation, then scaled
by the rank-0 scale_inv_a * scale_inv_b: XLA:GPU lowers that to a cuBLASLt FP8 GEMM and folds the
scalar scale into it (a dequantize-then-dot in fp32 would stay an fp32 GEMM there). With power-of-2
scales and no bias the dot writes the output dtype itself (bf16(acc) * 2^k is exact, so that is the
one rounding) and cuBLASLt writes bf16 with no fp32 copy of the output. Block-scaled operands (no
FP8 tensor-core GEMM on Hopper) are dequantized and multiplied with fp32 accumulation: to bf16 when
the recipe's scales are powers of two (an FP8 code times 2^k is exact in bf16, whose exponent range
is fp32's; a bf16 x bf16 product is exact in fp32: the tensor cores' bf16 GEMM), else to fp32 at
HIGHEST precision. Either way the bias is added in fp32 and the result rounded once: y and dx to
the activation dtype, dkernel to the kernel's; the bias grad is summed in fp32. The forward keeps
only the columnwise copies the backward reads.

Data parallelism: on a make_mesh mesh whose data axes hold G > 1 shards, and with the input's
batch dim known (jaxside.modules.tokens), the tokens are grouped [G, T / G, ...] as the G ranks hold
them (each group flattened in the rank's own order) and every activation operand (x, dy) is cast per
group, with that group's amax and blocks, as each torch rank casts its tokens: the GEMMs run per group
(jax.vmap), the groups' dkernels (each rounded to the kernel's dtype, as a rank's dw) are summed, as
FSDP reduce-scatters them. The weight is cast once. A delayed-scaling amax is the max over the groups:
the value torchside's region-end all-reduce records. The group axis lies on the data axes, so XLA
never gathers the batch. Without such a mesh (G = 1) the math is the single-device one.

DelayedScaling state crosses the custom_vjp as arrays: `scales` (input, weight, grad) are read, the
forward returns the amaxes of x and w for the history, and the grad's amax leaves the backward as
the cotangent of `grad_amax_sink` ([amax, 1]: the 1 counts the backward pass), since a cotangent is
the only value a backward can return.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax
from jax.sharding import PartitionSpec

from jaxside.formats import DTYPES
from jaxside.quantize import (
    Quantized,
    dequantize,
    quantize_blockwise,
    quantize_mxfp8,
    quantize_nvfp4,
    quantize_tensorwise,
)
from twinspec.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
    Recipe,
)
from jaxside.modules.tokens import forced_data_parallel_groups
from jaxside.sharding import constrain, data_parallel_size
from twinspec.mesh import DP_REPLICATE, DP_SHARD

ACTIVATION_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))  # what the GEMMs and norms write


def quantize_operand(x2d, recipe: Recipe, role: str, *, scale=None, seed=None, columnwise: bool = True) -> Quantized:
    """x2d quantized as torchside's Quantizer(recipe, role) does: rowwise, and columnwise when asked.

    scale: the DelayedScaling scale, fp32 (1,); seed: the stochastic-rounding seed of NVFP4 grads.
    """
    usage = {"rowwise": True, "columnwise": columnwise}
    if isinstance(recipe, NVFP4BlockScaling):
        return quantize_nvfp4(
            x2d,
            block=recipe.block_for(role),
            hadamard=recipe.hadamard_for(role),
            stochastic_seed=seed if recipe.stochastic_for(role) else None,
            **usage,
        )
    fmt = recipe.fp8_format.for_role(role)
    if isinstance(recipe, DelayedScaling):
        if scale is None:
            raise ValueError("DelayedScaling quantizes with a given scale: pass the module's scale for this role")
        return quantize_tensorwise(x2d, fmt, scale, **usage)
    if isinstance(recipe, Float8CurrentScaling):
        return quantize_tensorwise(
            x2d, fmt, power_2_scale=recipe.power_2_scale, amax_epsilon=recipe.amax_epsilon, **usage
        )
    if isinstance(recipe, Float8BlockScaling):
        return quantize_blockwise(x2d, fmt, recipe.block_for(role), power_2_scale=recipe.power_2_scale, **usage)
    if isinstance(recipe, MXFP8BlockScaling):
        return quantize_mxfp8(x2d, fmt, scale_rounding=recipe.scale_rounding, **usage)
    raise TypeError(f"recipe={recipe!r} is not a twinspec.recipe recipe")


def _gemm_values(q: Quantized, columnwise: bool, dtype) -> Array:
    """A copy's values in `dtype` as the GEMM operand [rows, K] (a Hadamard-rotated copy comes back unrotated).

    The other copy is dropped first: dequantize then compiles once per copy and shape, not once more
    for every combination of buffers a caller happens to hold.
    """
    other = ("data", "scale_inv") if columnwise else ("columnwise_data", "columnwise_scale_inv")
    values = dequantize(dataclasses.replace(q, **dict.fromkeys(other)), dtype, columnwise=columnwise)
    return values.T if columnwise else values  # dequantize gives the logical layout: a columnwise copy's K is dim 0


def exact_product_precision(*operands) -> lax.Precision:
    """The dot precision of fp32 math: HIGHEST for fp32 operands (no TF32 or bf16 passes on a GPU), DEFAULT
    for 16-bit ones. A bf16 or fp16 product is exact in fp32, so their tensor-core GEMM with fp32
    accumulation (preferred_element_type=float32) is the same math, where HIGHEST may make XLA:GPU upcast
    them to an fp32 GEMM without tensor cores. XLA:CPU gives both precisions the same result."""
    sixteen_bit = all(np.dtype(x.dtype) in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)) for x in operands)
    return lax.Precision.DEFAULT if sixteen_bit else lax.Precision.HIGHEST


def _matmul(a, b, out_dtype, bias=None) -> Array:
    """a @ b with fp32 accumulation (never TF32 or bf16 passes), plus bias in fp32, rounded once to out_dtype."""
    out = jnp.matmul(a, b, precision=exact_product_precision(a, b), preferred_element_type=jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(out_dtype)


_CONTRACT_LAST = (((1,), (1,)), ((), ()))  # A [M, K] . B [N, K] -> [M, N]


def power_2_scales(recipe: Recipe) -> bool:
    """Whether every scale the recipe makes is a power of two: MXFP8's e8m0 scales always, the fp32-scaled
    recipes with power_2_scale (Float8BlockScaling's default). NVFP4's are not (e4m3 scales, a global one)."""
    if isinstance(recipe, MXFP8BlockScaling):
        return True
    return isinstance(recipe, (Float8CurrentScaling, Float8BlockScaling)) and recipe.power_2_scale


def _fp8_codes(q: Quantized, columnwise: bool) -> tuple[Array, Array]:
    """(FP8 codes [rows, K], fp32 scale_inv (1,)) of a per-tensor copy."""
    data, scale_inv = (q.columnwise_data, q.columnwise_scale_inv) if columnwise else (q.data, q.scale_inv)
    return lax.bitcast_convert_type(data, DTYPES[q.fmt]), scale_inv


def _tensorwise_mm(a: Quantized, b: Quantized, a_columnwise: bool, b_columnwise: bool, dot_dtype) -> Array:
    """A @ B^T of two per-tensor copies: dot_dtype(acc of the FP8 codes) * scale_inv_a * scale_inv_b."""
    (a_codes, a_scale_inv), (b_codes, b_scale_inv) = _fp8_codes(a, a_columnwise), _fp8_codes(b, b_columnwise)
    out = lax.dot_general(a_codes, b_codes, _CONTRACT_LAST, preferred_element_type=dot_dtype)
    # Rank 0, not (1,): XLA:GPU folds a broadcast scalar into the cuBLASLt FP8 call; a (1,) one stays a pass.
    scale_inv = (a_scale_inv * b_scale_inv).reshape(())
    return out * scale_inv.astype(dot_dtype)


def _dequantized_mm(a: Quantized, b: Quantized, a_columnwise: bool, b_columnwise: bool, dtype) -> Array:
    """A @ B^T of two block-scaled copies dequantized to `dtype`, with fp32 accumulation (module docstring)."""
    a_values, b_values = _gemm_values(a, a_columnwise, dtype), _gemm_values(b, b_columnwise, dtype)
    precision = exact_product_precision(a_values, b_values)
    return lax.dot_general(a_values, b_values, _CONTRACT_LAST, precision=precision, preferred_element_type=jnp.float32)


def _scaled_mm(
    a: Quantized, b: Quantized, out_dtype, *, a_columnwise=False, b_columnwise=False, bias=None, power_2=False
) -> Array:
    """out [M, N] = A [M, K] @ B [N, K]^T (+ bias) of two quantized copies, as fp8kernels.gemm.scaled_mm (module docstring).

    power_2: every scale of both operands is a power of two (`power_2_scales` of their recipe).
    """
    if a.scheme == "tensorwise":
        # Without a bias, power-of-2 scales let the dot round to out_dtype itself: a bf16 times 2^k is exact.
        out = _tensorwise_mm(a, b, a_columnwise, b_columnwise, out_dtype if power_2 and bias is None else jnp.float32)
    else:
        # An FP8 code times 2^k is exact in bf16 (fp32's exponent range); other scales need fp32 values.
        out = _dequantized_mm(a, b, a_columnwise, b_columnwise, jnp.bfloat16 if power_2 else jnp.float32)
    if bias is not None:
        out = out + bias.astype(jnp.float32)
    return out.astype(out_dtype)


def _columnwise_only(q: Quantized) -> Quantized:
    """The copy the backward reads, without the rowwise bytes (so they need not live until then)."""
    return dataclasses.replace(q, data=None, scale_inv=None)


def _check_activation(x, what: str) -> None:
    if np.dtype(x.dtype) not in ACTIVATION_DTYPES:
        raise TypeError(f"{what} writes float32 or bfloat16; got an input of {x.dtype}: cast the input")


# ----------------------------------------------------------------------------- linear


@dataclass(frozen=True)
class _LinearStatic:
    recipe: Recipe
    kernel_dtype: np.dtype
    bias_dtype: np.dtype | None
    groups: int  # data-parallel shards that cast their tokens apart (module docstring); 1: all tokens together
    batch_dim: int | None  # the input's dim they split


_ON_DATA_AXES = PartitionSpec((DP_REPLICATE, DP_SHARD), PartitionSpec.UNCONSTRAINED, PartitionSpec.UNCONSTRAINED)


def _group_tokens(static: _LinearStatic, x) -> Array:
    """x [..., K] as [G, T / G, K]: group g holds the tokens of data-parallel rank g, in that rank's flattened order."""
    if static.groups == 1:
        return x.reshape(1, -1, x.shape[-1])
    lead, b, groups = x.shape[:-1], static.batch_dim, static.groups
    split = x.reshape(*lead[:b], groups, lead[b] // groups, *lead[b + 1 :], x.shape[-1])
    return constrain(jnp.moveaxis(split, b, 0).reshape(groups, -1, x.shape[-1]), _ON_DATA_AXES)


def _ungroup_tokens(static: _LinearStatic, y_G, lead: tuple[int, ...]) -> Array:
    """The inverse of `_group_tokens`: [G, T / G, N] back to [*lead, N]."""
    if static.groups == 1:
        return y_G.reshape(*lead, y_G.shape[-1])
    b, groups = static.batch_dim, static.groups
    split = y_G.reshape(groups, *lead[:b], lead[b] // groups, *lead[b + 1 :], y_G.shape[-1])
    return jnp.moveaxis(split, 0, b).reshape(*lead, y_G.shape[-1])


def _per_group(static: _LinearStatic, fn, in_axes: tuple[int | None, ...], *args):
    """fn over the group axis (leading) of the args whose in_axes entry is 0 (jax.vmap); one group runs fn as it is."""
    if static.groups > 1:
        return jax.vmap(fn, in_axes=in_axes)(*args)
    first = [a if axis is None else jax.tree.map(lambda leaf: leaf[0], a) for a, axis in zip(args, in_axes)]
    return jax.tree.map(lambda leaf: leaf[None], fn(*first))


def _slot(scales, index: int):
    return None if scales is None else scales[index : index + 1]


def _fp8_forward(static: _LinearStatic, x, kernel, bias, scales, columnwise: bool):
    recipe = static.recipe
    quantize_x = partial(quantize_operand, recipe=recipe, role="input", scale=_slot(scales, 0), columnwise=columnwise)
    qx_G = _per_group(static, quantize_x, (0,), _group_tokens(static, x))
    qw = quantize_operand(kernel.T, recipe, "weight", scale=_slot(scales, 1), columnwise=columnwise)
    fprop = partial(_scaled_mm, out_dtype=x.dtype, bias=bias, power_2=power_2_scales(recipe))
    y_G = _per_group(static, fprop, (0, None), qx_G, qw)
    amaxes = None if scales is None else jnp.concatenate([qx_G.amax.max(axis=0), qw.amax])
    return _ungroup_tokens(static, y_G, x.shape[:-1]), amaxes, qx_G, qw


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_linear(static: _LinearStatic, x, kernel, bias, scales, grad_amax_sink, seed):
    y, amaxes, _, _ = _fp8_forward(static, x, kernel, bias, scales, columnwise=False)
    return y, amaxes


def _fp8_linear_fwd(static: _LinearStatic, x, kernel, bias, scales, grad_amax_sink, seed):
    y, amaxes, qx_G, qw = _fp8_forward(static, x, kernel, bias, scales, columnwise=True)
    residuals = (_columnwise_only(qx_G), _columnwise_only(qw), scales, grad_amax_sink, seed)
    return (y, amaxes), residuals


def _fp8_linear_bwd(static: _LinearStatic, residuals, cotangents):
    x_columnwise_G, w_columnwise, scales, grad_amax_sink, seed = residuals
    dy = cotangents[0]  # the amaxes' cotangent carries nothing
    dy_G = _group_tokens(static, dy)
    quantize_dy = partial(quantize_operand, recipe=static.recipe, role="grad", scale=_slot(scales, 2), seed=seed)
    qdy_G = _per_group(static, quantize_dy, (0,), dy_G)
    power_2 = power_2_scales(static.recipe)
    dgrad = partial(_scaled_mm, out_dtype=dy.dtype, b_columnwise=True, power_2=power_2)
    dx_G = _per_group(static, dgrad, (0, None), qdy_G, w_columnwise)
    wgrad = partial(_scaled_mm, out_dtype=static.kernel_dtype, a_columnwise=True, b_columnwise=True, power_2=power_2)
    dkernel_IO = _per_group(static, wgrad, (0, 0), x_columnwise_G, qdy_G).sum(axis=0, dtype=static.kernel_dtype)
    dbias = None
    if static.bias_dtype is not None:
        dbias = dy_G.astype(jnp.float32).sum(axis=(0, 1)).astype(static.bias_dtype)
    sink_cotangent = None
    if grad_amax_sink is not None:
        sink_cotangent = jnp.concatenate([qdy_G.amax.max(axis=0), jnp.ones(1, jnp.float32)])
    return _ungroup_tokens(static, dx_G, dy.shape[:-1]), dkernel_IO, dbias, None, sink_cotangent, None


_fp8_linear.defvjp(_fp8_linear_fwd, _fp8_linear_bwd)


def _data_parallel_groups(x, kernel, batch_dim: int | None) -> int:
    """How many data-parallel shards cast x's tokens apart when x's batch dim is known: a
    `data_parallel_groups` context's count, else the mesh's data shards."""
    if batch_dim is None or batch_dim >= x.ndim - 1:
        return 1
    groups = forced_data_parallel_groups() or data_parallel_size(kernel)
    if x.shape[batch_dim] % groups:
        raise ValueError(
            f"the FP8 linear's input {list(x.shape)} has batch dim {batch_dim} of size {x.shape[batch_dim]}, which "
            f"{groups} data-parallel shards do not divide: use a batch that is a multiple of {groups}"
        )
    return groups


def fp8_linear(
    x, kernel, bias, recipe: Recipe, *, scales=None, grad_amax_sink=None, seed=None, batch_dim: int | None = None
) -> tuple[Array, Array | None]:
    """x @ kernel + bias with FP8 GEMMs under `recipe`; returns (y, the fp32 [2] amaxes of x and w, or None).

    DelayedScaling only: `scales`, fp32 [3], of the input, weight and grad, and `grad_amax_sink`,
    fp32 [2], whose gradient is [grad amax, 1]; the amaxes are returned for the history. `seed`: the
    uint32 seed of the NVFP4 grads' stochastic rounding. `batch_dim`: the dim of x a make_mesh mesh's data
    axes split; each of its shards then casts its own tokens (module docstring). None: all tokens together.
    """
    _check_activation(x, "an FP8 linear")
    delayed = isinstance(recipe, DelayedScaling)
    if delayed != (scales is not None) or delayed != (grad_amax_sink is not None):
        raise ValueError("pass scales and grad_amax_sink exactly when the recipe is DelayedScaling")
    groups = _data_parallel_groups(x, kernel, batch_dim)
    static = _LinearStatic(
        recipe, np.dtype(kernel.dtype), None if bias is None else np.dtype(bias.dtype), groups, batch_dim
    )
    return _fp8_linear(static, x, kernel, bias, scales, grad_amax_sink, seed)


def linear(x, kernel, bias) -> Array:
    """x @ kernel + bias in high precision (FP8 off): fp32 accumulation, rounded once to x's dtype."""
    return _matmul(x, kernel, x.dtype, bias)


# ----------------------------------------------------------------------------- normalization


def _gamma(weight, zero_centered_gamma: bool) -> Array:
    return weight.astype(jnp.float32) + 1.0 if zero_centered_gamma else weight.astype(jnp.float32)


def _norm_forward(x, weight, bias, rms: bool, eps: float, zero_centered_gamma: bool):
    # Reduced over the last dim in place: flattening [S, B, H] to [S * B, H] would gather a batch split over devices.
    x32 = x.astype(jnp.float32)
    mean = None if rms else jnp.mean(x32, axis=-1, keepdims=True)
    centered = x32 if rms else x32 - mean
    rstd = lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    y = centered * rstd * _gamma(weight, zero_centered_gamma)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x.dtype), (x, weight, mean, rstd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _normalize(x, weight, bias, rms: bool, eps: float, zero_centered_gamma: bool):
    return _norm_forward(x, weight, bias, rms, eps, zero_centered_gamma)[0]


def _normalize_bwd(rms: bool, eps: float, zero_centered_gamma: bool, residuals, dy):
    x, weight, mean, rstd = residuals
    x32, dy32 = x.astype(jnp.float32), dy.astype(jnp.float32)
    xhat = (x32 if mean is None else x32 - mean) * rstd
    gdy = _gamma(weight, zero_centered_gamma) * dy32
    inner = gdy - xhat * jnp.mean(xhat * gdy, axis=-1, keepdims=True)
    if mean is not None:
        inner = inner - jnp.mean(gdy, axis=-1, keepdims=True)
    dx = (inner * rstd).astype(x.dtype)
    tokens = tuple(range(x.ndim - 1))
    dweight = jnp.sum(dy32 * xhat, axis=tokens).astype(weight.dtype)
    dbias = None if mean is None else jnp.sum(dy32, axis=tokens).astype(weight.dtype)
    return dx, dweight, dbias


_normalize.defvjp(lambda x, w, b, rms, eps, zcg: _norm_forward(x, w, b, rms, eps, zcg), _normalize_bwd)


def normalize(x, weight, bias, *, rms: bool, eps: float, zero_centered_gamma: bool) -> Array:
    """LayerNorm (RMSNorm when `rms`) over the last dim in fp32, written in x's dtype; fp8kernels.norm's math and grads."""
    _check_activation(x, "a norm")
    return _normalize(x, weight, bias, rms, float(eps), zero_centered_gamma)
