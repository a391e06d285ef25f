"""Small user-written model pairs for tests/bridge/test_compare*.py: a stack of pre-norm MLP blocks in plain
torch and in plain Flax NNX, with torchside/jaxside Linears for the FP8 cases, and one planted difference.

Shape legend: B batch, S sequence, D model width, F = 2D ffn width.
"""

from __future__ import annotations

import jax
import torch
from flax import nnx
from torch import nn

EPS = 1e-5


class TorchBlock(nn.Module):
    def __init__(self, width: int, fp8: bool, planted: str | None = None) -> None:
        super().__init__()
        linear = _torchside_linear if fp8 else nn.Linear
        self.norm = nn.LayerNorm(width, eps=EPS)
        self.fc1 = (WrongWeightGradLinear if planted == "weight_grad" else linear)(width, 2 * width)
        self.fc2 = linear(2 * width, width)
        self.act = nn.GELU()

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(self.norm(x_BSD)))
        return x_BSD + self.fc2(h)


def _torchside_linear(in_features: int, out_features: int):
    import torchside

    return torchside.Linear(in_features, out_features)


class _WrongWeightGrad(torch.autograd.Function):
    """y = x W^T + b whose weight gradient is 0.1% off: a bug only the weight-gradient checks see."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        grad_weight = dy.reshape(-1, dy.shape[-1]).T @ x.reshape(-1, x.shape[-1])
        return dy @ weight, grad_weight * (1 + 2**-10), dy.reshape(-1, dy.shape[-1]).sum(0)


class WrongWeightGradLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WrongWeightGrad.apply(x, self.weight, self.bias)


class TorchStack(nn.Module):
    def __init__(self, width: int, depth: int, fp8: bool = False, planted: tuple[int, str] | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            TorchBlock(width, fp8, planted[1] if planted and planted[0] == i else None) for i in range(depth)
        )

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return x_BSD


def _jaxside_linear(in_features: int, out_features: int, rngs: nnx.Rngs):
    from jaxside.modules import Linear

    return Linear(in_features, out_features, rngs=rngs)


class Gelu(nnx.Module):
    """GELU as a submodule, so that compare checks it on its own (tanh form: the planted difference)."""

    def __init__(self, approximate: bool) -> None:
        self.approximate = approximate

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=self.approximate)


class JaxBlock(nnx.Module):
    def __init__(self, width: int, fp8: bool, planted: str | None, rngs: nnx.Rngs) -> None:
        linear = _jaxside_linear if fp8 else (lambda i, o, rngs: nnx.Linear(i, o, rngs=rngs))
        epsilon = 1e-4 if planted == "epsilon" else EPS
        self.norm = nnx.LayerNorm(width, epsilon=epsilon, rngs=rngs)
        self.fc1 = linear(width, 2 * width, rngs)
        self.fc2 = linear(2 * width, width, rngs)
        self.act = Gelu(approximate=planted == "tanh_gelu")
        self.planted = planted

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        normed = self.norm(x_BSD)
        if self.planted == "transposed_weight":  # the kernel read as torch's [out, in] reshaped: a layout bug
            kernel = self.fc1.kernel[...]
            pre = normed @ kernel.T.reshape(kernel.shape) + self.fc1.bias[...]
        else:
            pre = self.fc1(normed)
        h = self.act(pre)
        out = self.fc2(h)
        if self.planted == "dropped_bias":
            out = out - self.fc2.bias[...]
        residual = x_BSD * (1 + 2**-10) if self.planted == "scaled_residual" else x_BSD
        return residual + out


class JaxStack(nnx.Module):
    def __init__(self, width: int, depth: int, fp8: bool = False, planted: tuple[int, str] | None = None) -> None:
        rngs = nnx.Rngs(0)
        self.blocks = nnx.List(
            [JaxBlock(width, fp8, planted[1] if planted and planted[0] == i else None, rngs) for i in range(depth)]
        )

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        for block in self.blocks:
            x_BSD = block(x_BSD)
        return x_BSD


def inputs(width: int, seed: int = 0, batch: int = 2, seq: int = 64) -> torch.Tensor:
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(seed))


def torch_stack():
    """A factory for `shardbridge verify --torch`: (model, example inputs)."""
    torch.manual_seed(0)
    return TorchStack(32, 3), inputs(32, seq=8)


def jax_stack():
    return JaxStack(32, 3), inputs(32, seq=8)


def jax_stack_tanh_gelu():
    """The twin with block 1's GELU in its tanh form: verify must fail and name blocks.1.act."""
    return JaxStack(32, 3, planted=(1, "tanh_gelu")), inputs(32, seq=8)


def torch_stack_model() -> TorchStack:
    """Model factories for `bridge.compare(..., mesh=...)`, whose processes build the models themselves."""
    return TorchStack(32, 2)


def jax_stack_model() -> JaxStack:
    return JaxStack(32, 2)


def torch_fp8_stack_model() -> TorchStack:
    return TorchStack(32, 2, fp8=True)


def jax_fp8_stack_model() -> JaxStack:
    return JaxStack(32, 2, fp8=True)


def jax_stack_model_tanh_gelu() -> JaxStack:
    return JaxStack(32, 2, planted=(1, "tanh_gelu"))


__all__ = [
    "JaxStack",
    "TorchStack",
    "inputs",
    "jax_fp8_stack_model",
    "jax_stack",
    "jax_stack_model",
    "jax_stack_model_tanh_gelu",
    "jax_stack_tanh_gelu",
    "torch_fp8_stack_model",
    "torch_stack",
    "torch_stack_model",
]
