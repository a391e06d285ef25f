"""`LayerNormMLP`: norm, fc1, activation, fc2; both GEMMs run in FP8 inside fp8_autocast.

Shape legend: T tokens (all leading dims), H hidden size, F ffn hidden size, F1 fc1's out features
(F, or 2F for a gated activation). Parameters (torchside's names, Flax kernels): `layer_norm_weight`
[H] (and `layer_norm_bias` [H]), `fc1_kernel` [H, F1] ("embed", "mlp"), `fc1_bias` [F1],
`fc2_kernel` [F, H] ("mlp", "embed"), `fc2_bias` [H]. As in TransformerEngine, fc1 is column-parallel
and fc2 row-parallel: on a mesh with tp > 1 the ffn dim is split over tp, on tp = 1 only FSDP remains.

Activations follow torchside's table. Each torch op there computes in fp32 and rounds its result to
the activation dtype; here each op (`_op`) does the same, so both round at the same places, in the
forward and, through autodiff, in the backward. A gated activation computes function(gate) * up from
fc1's output with gate and up interleaved in runs of `glu_interleave` (w) features (run 2j: gate
features jw .. jw + w - 1, run 2j + 1: the same up features; w = 1: feature 2i is gate i, 2i + 1
up i), as torchside's twin does: a column split of the kernel over tp then keeps whole (gate, up)
runs when F / tp is a multiple of w (the arrays are global here, so any split computes the same).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.base import FP8Module, Initializer, default_kernel_init, parameter
from jaxside.modules.config import ModuleConfig, check_config, check_params_dtype, check_size
from jaxside.modules.normalization import NormSettings
from jaxside.modules.placement import gathered


def _op(function: Callable[..., Array], *operands) -> Array:
    """One torch op in the activation dtype: computed in fp32, rounded once to the first operand's dtype."""
    return function(*(x.astype(jnp.float32) for x in operands)).astype(operands[0].dtype)


def _gelu_tanh(x) -> Array:
    return _op(partial(jax.nn.gelu, approximate=True), x)  # TransformerEngine's "gelu" is the tanh approximation


def _relu(x) -> Array:
    return _op(jax.nn.relu, x)


def _silu(x) -> Array:
    return _op(jax.nn.silu, x)


def _quick_gelu(x) -> Array:
    return _op(jnp.multiply, x, _op(jax.nn.sigmoid, _op(lambda v: 1.702 * v, x)))  # torch: x * sigmoid(1.702 * x)


def _squared_relu(x) -> Array:
    return _op(jnp.square, _relu(x))


@dataclass(frozen=True)
class Activation:
    function: Callable[[Array], Array]
    gated: bool  # fc1 writes 2F features, (gate, up) interleaved: function(gate) * up


ACTIVATIONS: dict[str, Activation] = {
    "gelu": Activation(_gelu_tanh, gated=False),
    "relu": Activation(_relu, gated=False),
    "silu": Activation(_silu, gated=False),
    "qgelu": Activation(_quick_gelu, gated=False),
    "srelu": Activation(_squared_relu, gated=False),
    "geglu": Activation(_gelu_tanh, gated=True),
    "reglu": Activation(_relu, gated=True),
    "swiglu": Activation(_silu, gated=True),
    "qgeglu": Activation(_quick_gelu, gated=True),
    "sreglu": Activation(_squared_relu, gated=True),
}


class LayerNormMLP(FP8Module):
    """Norm + MLP with TransformerEngine's te.LayerNormMLP arguments (Flax's kernel layout and initializer names)."""

    tp_unit = "mlp"  # the kind of unit whose TP mode a placement plan chooses (twinspec.plan)

    def __init__(
        self,
        hidden_size: int,
        ffn_hidden_size: int,
        *,
        eps: float = 1e-5,
        bias: bool = True,
        normalization: str = "LayerNorm",
        activation: str = "gelu",
        glu_interleave: int = 1,
        zero_centered_gamma: bool = False,
        params_dtype=jnp.float32,
        kernel_init: Initializer | None = None,
        output_kernel_init: Initializer | None = None,
        return_bias: bool = False,
        set_parallel_mode: bool = True,
        config: ModuleConfig | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        self.hidden_size = check_size("LayerNormMLP", "hidden_size", hidden_size)
        self.ffn_hidden_size = check_size("LayerNormMLP", "ffn_hidden_size", ffn_hidden_size)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP(activation={activation!r}): use one of {', '.join(ACTIVATIONS)}")
        self.glu_interleave = check_size("LayerNormMLP", "glu_interleave", glu_interleave)
        if glu_interleave > 1 and (not ACTIVATIONS[activation].gated or self.ffn_hidden_size % glu_interleave):
            raise ValueError(
                f"LayerNormMLP(activation={activation!r}, ffn_hidden_size={ffn_hidden_size}, glu_interleave="
                f"{glu_interleave}): runs of gate and up rows need a gated activation (*glu) and ffn_hidden_size a "
                "multiple of glu_interleave"
            )
        config = check_config("LayerNormMLP", config)
        if config.parallel_mode is not None:
            raise ValueError(
                f"LayerNormMLP(config=ModuleConfig(parallel_mode={config.parallel_mode!r})): fc1 is always "
                "column-parallel and fc2 row-parallel (they split over tp whenever the mesh has it); leave it None"
            )
        super().__init__(2, config)
        self.activation, self.return_bias = activation, return_bias
        self.norm = NormSettings(normalization, eps, zero_centered_gamma)
        dtype = check_params_dtype("LayerNormMLP", params_dtype)
        hidden, ffn = self.hidden_size, self.ffn_hidden_size
        fc1_features = 2 * ffn if ACTIVATIONS[activation].gated else ffn
        zeros = nnx.initializers.zeros
        self.norm.add_params(self, hidden, "layer_norm_", dtype, "embed", rngs, "column")
        fc1_init, fc2_init = kernel_init or default_kernel_init, output_kernel_init or default_kernel_init
        if not isinstance(set_parallel_mode, bool):
            raise TypeError(f"LayerNormMLP(set_parallel_mode={set_parallel_mode!r}): pass True or False")
        column, row = ("column", "row") if set_parallel_mode else (None, None)  # False: nothing splits over tp
        self.fc1_kernel = parameter(rngs, fc1_init, (hidden, fc1_features), dtype, ("embed", "mlp"), "kernel", column)
        self.fc1_bias = parameter(rngs, zeros, (fc1_features,), dtype, ("mlp",), "bias", column) if bias else None
        self.fc2_kernel = parameter(rngs, fc2_init, (ffn, hidden), dtype, ("mlp", "embed"), "kernel", row)
        self.fc2_bias = parameter(rngs, zeros, (hidden,), dtype, ("embed",), "bias", row) if bias else None

    def _activate(self, h_TF1) -> Array:
        activation = ACTIVATIONS[self.activation]
        if not activation.gated:
            return activation.function(h_TF1)
        runs = h_TF1.reshape(*h_TF1.shape[:-1], -1, 2, self.glu_interleave)  # interleaved (module docstring)
        gate_TF, linear_TF = (runs[..., half, :].reshape(*h_TF1.shape[:-1], -1) for half in (0, 1))
        return _op(jnp.multiply, activation.function(gate_TF), linear_TF)

    def __call__(self, x_TH) -> Array | tuple[Array, Array | None]:
        """y [..., H]; with return_bias, (y without fc2's bias, fc2's bias) for the caller to fuse."""
        plan = self.fp8_plan()
        fc1_bias = None if self.fc1_bias is None else gathered(self.fc1_bias)
        fc2_bias = None if self.fc2_bias is None else gathered(self.fc2_bias)
        normalized_TH = self.norm.apply(self, x_TH, prefix="layer_norm_")
        h_TF1 = self.linear(plan, 0, normalized_TH, gathered(self.fc1_kernel), fc1_bias)
        fc2_kernel = gathered(self.fc2_kernel)
        y_TH = self.linear(plan, 1, self._activate(h_TF1), fc2_kernel, None if self.return_bias else fc2_bias)
        return (y_TH, fc2_bias) if self.return_bias else y_TH
