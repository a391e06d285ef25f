"""The float64 model of torchside.modules' quantized math (fp8kernels.reference casts, float64 GEMMs, roundings
where the module writes its dtype), shared by the module, grouped-linear and transformer-layer tests.
tests/torchside/test_modules_numerics.py's docstring describes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bridge import numerics
from fp8kernels import reference as R
from torchside.modules import LayerNormLinear, Linear, ModuleConfig
from torchside.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    NVFP4BlockScaling,
)


RECIPES = {
    "delayed": DelayedScaling(amax_history_len=8),
    "current": Float8CurrentScaling(),
    "current-e4m3-pow2": Float8CurrentScaling(fp8_format=Format.E4M3, power_2_scale=True),
    "block": Float8BlockScaling(),
    # fp32 block scales: with power-of-2 scales a 1x128 and a 128x128 cast differ only in subnormals
    "block-fp32-scales": Float8BlockScaling(power_2_scale=False),
    "mxfp8": MXFP8BlockScaling(),
    "nvfp4": NVFP4BlockScaling(),
}


# ||module - float64|| / ||float64|| allowed per tensor (outputs and every gradient), by where the
# kernels run and the activation dtype. Both sides cast the same values with the same rules, so what
# differs is arithmetic:
#  - the GEMMs and norms sum K <= 256 terms in fp32: at worst K * 2^-24 <= 2^-16 of the result;
#  - the module rounds each result it returns to its dtype, the float64 model does not: 2^-24 (fp32)
#    or 2^-9 (bf16) per element at most;
#  - a value that fp32 and float64 put on opposite sides of a rounding boundary of the next cast
#    would land one step apart (2^-3 of the value for E4M3): that needs a gap below 2^-16 of the
#    value, about 2^-13 of the elements of a cast, and the seeds here hit none on CPU.
# CPU: fp32 2^-14 (4x the accumulation bound), bf16 2^-8 (2x the final rounding).
# CUDA: Hopper's FP8 tensor cores keep ~14 bits while accumulating inside one MMA (DeepSeek-V3
# report, section 3.3.2), so a 2^-14 error reaches bf16 rounding boundaries and then a few FP8 steps
# flip in chained casts: 2^-6, whatever the activation dtype (fp32 activations go through the same
# tensor cores). A skipped cast, a wrong scale or a transposed operand costs more
# than 2^-5 (one E4M3 cast alone is ~2% rms).
TOLERANCE = {
    ("cpu", torch.float32): 2**-14,
    ("cpu", torch.bfloat16): 2**-8,
    ("cuda", torch.float32): 2**-6,
    ("cuda", torch.bfloat16): 2**-6,
}


def _reference_quantize(x: torch.Tensor, recipe, role: str, *, scale=None, stochastic_seed=None) -> R.Quantized:
    """fp8kernels.reference quantization of `x` for `role`, with the recipe's documented arguments."""
    both = {"rowwise": True, "columnwise": True}
    if isinstance(recipe, DelayedScaling):
        return R.quantize_tensorwise(x, recipe.fp8_format.for_role(role), scale, **both)
    if isinstance(recipe, Float8CurrentScaling):
        fmt = recipe.fp8_format.for_role(role)
        return R.quantize_tensorwise(x, fmt, power_2_scale=recipe.power_2_scale, **both)
    if isinstance(recipe, Float8BlockScaling):
        block = (128, 128) if role == "weight" else (1, 128)
        fmt = recipe.fp8_format.for_role(role)
        return R.quantize_blockwise(x, fmt, block, power_2_scale=recipe.power_2_scale, **both)
    if isinstance(recipe, MXFP8BlockScaling):
        return R.quantize_mxfp8(x, recipe.fp8_format.for_role(role), scale_rounding="up", **both)
    block = (16, 16) if role == "weight" else (1, 16)  # NVFP4: RHT on the wgrad operands, SR on grads
    seed = stochastic_seed if role == "grad" else None
    return R.quantize_nvfp4(x, block=block, hadamard=role != "weight", stochastic_seed=seed, **both)


def _values(q: R.Quantized, columnwise: bool = False) -> torch.Tensor:
    return R.dequantize(q, torch.float32, columnwise=columnwise).double()


class _Round(torch.autograd.Function):
    """Round to `dtype` forward and the gradient to `dtype` backward: where the module writes that dtype."""

    @staticmethod
    def forward(ctx, x, dtype):
        ctx.dtype = dtype
        return x.to(dtype).double()

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).double(), None


class QuantizedMath64:
    """The float64 model of one module's FP8 math: which scale and seed each cast uses.

    `follow`: {(role, gemm): codes} the model takes instead of casting itself (the module's own
    casts, each checked separately), so that a cast the module's fp32 arithmetic legitimately
    rounds the other way does not travel down the model. `cast_inputs` and `casts` record, by
    (role, gemm), what the model cast (or would have) and the codes it used.
    """

    def __init__(self, recipe, module, dtype: torch.dtype, follow: dict | None = None) -> None:
        self.recipe, self.dtype, self.follow = recipe, dtype, follow
        self.cast_inputs: dict[tuple[str, int], torch.Tensor] = {}
        self.casts: dict[tuple[str, int], R.Quantized] = {}
        delayed = isinstance(recipe, DelayedScaling)
        self.forward_scale = module.fp8_forward_scale.cpu().clone() if delayed else None
        self.backward_scale = module.fp8_backward_scale.cpu().clone() if delayed else None

    def quantize(self, x: torch.Tensor, role: str, gemm: int) -> R.Quantized:
        self.cast_inputs[role, gemm] = x.detach().to(self.dtype)
        if self.follow is not None:
            return self.follow[role, gemm]
        scale = None
        if self.forward_scale is not None:
            slot = {"input": 2 * gemm, "weight": 2 * gemm + 1}.get(role, gemm)
            scales = self.backward_scale if role == "grad" else self.forward_scale
            scale = scales[slot : slot + 1]
        seed = getattr(self.recipe, "stochastic_rounding_seed", 0)  # a fresh quantizer's first step
        q = _reference_quantize(x.to(self.dtype), self.recipe, role, scale=scale, stochastic_seed=seed)
        self.casts[role, gemm] = q
        return q

    def linear(self, x, w, b, gemm: int) -> torch.Tensor:
        return _Linear64.apply(x, w, b, self, gemm)

    def round(self, x: torch.Tensor) -> torch.Tensor:
        return _Round.apply(x, self.dtype)


class _Linear64(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, math: QuantizedMath64, gemm: int):
        x2d = x.reshape(-1, x.shape[-1])
        qx, qw = math.quantize(x2d, "input", gemm), math.quantize(w, "weight", gemm)
        y = _values(qx) @ _values(qw).T
        if b is not None:
            y = y + b
        ctx.math, ctx.gemm, ctx.qx, ctx.qw, ctx.x_shape, ctx.has_bias = math, gemm, qx, qw, x.shape, b is not None
        return y.to(math.dtype).double().reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        dy2d = dy.reshape(-1, dy.shape[-1])
        qdy = ctx.math.quantize(dy2d, "grad", ctx.gemm)
        dx = _values(qdy) @ _values(ctx.qw, columnwise=True)
        dw = _values(qdy, columnwise=True).T @ _values(ctx.qx, columnwise=True)
        db = dy2d.sum(0) if ctx.has_bias else None
        return dx.to(ctx.math.dtype).double().reshape(ctx.x_shape), dw, db, None, None


def norm64(module, params: dict, x) -> torch.Tensor:
    norm = module.norm
    weight = params["layer_norm_weight"] + (1.0 if norm.zero_centered_gamma else 0.0)
    if norm.normalization == "LayerNorm":
        return F.layer_norm(x, (x.shape[-1],), weight, params["layer_norm_bias"], norm.eps)
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm.eps) * weight
ACTIVATIONS64 = {"gelu": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}
GATED64 = {"swiglu": "silu", "geglu": "gelu"}


def _activation64(math: QuantizedMath64, name: str, h):
    if name not in GATED64:
        return math.round(ACTIVATIONS64[name](math.round(h)))
    gate, linear = h[..., 0::2], h[..., 1::2]  # fc1's rows alternate gate, up
    return math.round(math.round(ACTIVATIONS64[GATED64[name]](math.round(gate))) * math.round(linear))


def forward64(module, params: dict, math: QuantizedMath64, x):
    """The float64 model of `module`'s forward, with float64 `params` and x (values exact in their dtypes)."""
    if isinstance(module, Linear):
        return math.linear(x, params["weight"], params["bias"], 0)
    normalized = math.round(norm64(module, params, x))
    if isinstance(module, LayerNormLinear):
        return math.linear(normalized, params["weight"], params["bias"], 0)
    h = math.linear(normalized, params["fc1_weight"], params["fc1_bias"], 0)
    return math.linear(_activation64(math, module.activation, h), params["fc2_weight"], params["fc2_bias"], 1)


CONFIG = ModuleConfig(amax_history_len=8)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(actual).all(), "NaN or inf in the module's result"
    return numerics.relative_error(actual, expected)
