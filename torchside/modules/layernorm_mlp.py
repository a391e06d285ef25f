"""`LayerNormMLP`: norm, fc1, activation, fc2; both GEMMs run in FP8 inside fp8_autocast.

Shape legend: T tokens (all leading dims), H hidden size, F ffn hidden size, F1 fc1's out features
(F, or 2F for a gated activation). Parameters: `layer_norm_weight` [H] (and `layer_norm_bias` [H]),
`fc1_weight` [F1, H], `fc1_bias` [F1], `fc2_weight` [H, F], `fc2_bias` [H].

A gated activation (the `*glu` rows of ACTIVATIONS) computes function(gate) * up, with gate and up
interleaved in fc1's output in runs of `glu_interleave` (w) features: run 2j is gate features
jw .. jw + w - 1, run 2j + 1 the same up features (w = 1, the default: feature 2i is gate i, 2i + 1
up i). TransformerEngine stacks [gate; up] instead; interleaving makes every contiguous run of 2w
rows whole (gate, up) pairs, so a plain Shard(0) splits the gated fc1 over TP and DCP, FSDP2 and
JAX all describe it (a [gate; up] weight would need each half split on its own: a strided
placement DCP cannot save). w = 128 makes every 128-row block of `fc1_weight` one block-row of
gate or of up, so 128x128 block-scaled FP8 gate and up weights map onto it byte for byte
(docs/hf.md). From separate gate and up weights [F, H]:
`torch.stack([gate.unflatten(0, (-1, w)), up.unflatten(0, (-1, w))], dim=1).flatten(0, 2)`. Each
TP shard of fc1 must hold whole runs (F / tp a multiple of w); FSDP2 gathers fc1 before the
activation, so its shards need not. Activations run in the activation dtype through torch ops.

With tp_size > 1 (and `set_parallel_mode`, TransformerEngine's name, True by default here), fc1 is column-parallel (this rank: `fc1_weight` [F1/tp, H], `fc1_bias` [F1/tp]) and
fc2 row-parallel (`fc2_weight` [H, F/tp]; `fc2_bias` [H] added after the reduction), so the
activation runs on local features with no collective in between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from torchside.modules.base import FP8Module, ParamSpec, default_init_method
from torchside.modules.config import ModuleConfig, check_parallel_mode, check_size
from torchside.modules.functions import linear
from torchside.modules.normalization import NormSettings


def _gelu_tanh(x: Tensor) -> Tensor:
    return F.gelu(x, approximate="tanh")  # TransformerEngine's "gelu" is the tanh approximation


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def _squared_relu(x: Tensor) -> Tensor:
    return torch.square(F.relu(x))


@dataclass(frozen=True)
class Activation:
    function: Callable[[Tensor], Tensor]
    gated: bool  # fc1 writes 2F features, (gate, up) interleaved: function(gate) * up


ACTIVATIONS: dict[str, Activation] = {
    "gelu": Activation(_gelu_tanh, gated=False),
    "relu": Activation(F.relu, gated=False),
    "silu": Activation(F.silu, gated=False),
    "qgelu": Activation(_quick_gelu, gated=False),
    "srelu": Activation(_squared_relu, gated=False),
    "geglu": Activation(_gelu_tanh, gated=True),
    "reglu": Activation(F.relu, gated=True),
    "swiglu": Activation(F.silu, gated=True),
    "qgeglu": Activation(_quick_gelu, gated=True),
    "sreglu": Activation(_squared_relu, gated=True),
}


def check_glu_interleave(owner: str, glu_interleave: object, ffn_hidden_size: int, gated: bool, tp_size: int) -> int:
    """ValueError unless fc1's runs of `glu_interleave` rows fit F and every TP shard of it (module docstring)."""
    w = check_size(owner, "glu_interleave", glu_interleave)
    if w > 1 and not gated:
        raise ValueError(f"{owner}(glu_interleave={w}): only a gated activation (*glu) interleaves; leave it 1")
    if w > 1 and ffn_hidden_size % (w * tp_size):  # (w = 1: the placement checks say it for tp)
        raise ValueError(
            f"{owner}(ffn_hidden_size={ffn_hidden_size}, glu_interleave={w}, tp_size={tp_size}): each TP shard of "
            f"fc1 must hold whole runs of {w} gate and {w} up rows, so ffn_hidden_size must be a multiple of "
            f"glu_interleave x tp_size = {w * tp_size}; choose a glu_interleave or tp that divides it"
        )
    return w


class LayerNormMLP(FP8Module):
    """Norm + MLP with TransformerEngine's te.LayerNormMLP arguments; TP settings come from `config`."""

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
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        init_method=None,
        output_layer_init_method=None,
        return_bias: bool = False,
        set_parallel_mode: bool = True,
        config: ModuleConfig | None = None,
        tp_mesh: DeviceMesh | None = None,
        weight_mesh: DeviceMesh | None = None,
    ) -> None:
        hidden_size = check_size("LayerNormMLP", "hidden_size", hidden_size)
        ffn_hidden_size = check_size("LayerNormMLP", "ffn_hidden_size", ffn_hidden_size)
        if activation not in ACTIVATIONS:
            raise ValueError(f"LayerNormMLP(activation={activation!r}): use one of {', '.join(ACTIVATIONS)}")
        check_parallel_mode("LayerNormMLP", config, (None,))
        if not isinstance(set_parallel_mode, bool):
            raise TypeError(f"LayerNormMLP(set_parallel_mode={set_parallel_mode!r}): pass True or False")
        if not set_parallel_mode and config is not None and config.sequence_parallel and config.tp_size > 1:
            raise ValueError(
                "LayerNormMLP(set_parallel_mode=False) computes on the whole sequence: it cannot take "
                "sequence-parallel input; pass ModuleConfig(sequence_parallel=False) or set_parallel_mode=True"
            )
        column, row = ("column", "row") if set_parallel_mode else (None, None)
        gated = ACTIVATIONS[activation].gated
        check_glu_interleave("LayerNormMLP", glu_interleave, ffn_hidden_size, gated, (config or ModuleConfig()).tp_size)
        norm = NormSettings(normalization, eps, zero_centered_gamma)
        fc1_features = 2 * ffn_hidden_size if gated else ffn_hidden_size
        params = norm.param_specs(hidden_size, prefix="layer_norm_")
        fc1_init = init_method or default_init_method
        params["fc1_weight"] = ParamSpec((fc1_features, hidden_size), fc1_init, "linear_weight", column, gemm=0)
        if bias:
            params["fc1_bias"] = ParamSpec((fc1_features,), nn.init.zeros_, "linear_bias", column)
        fc2_init = output_layer_init_method or default_init_method
        params["fc2_weight"] = ParamSpec((hidden_size, ffn_hidden_size), fc2_init, "linear_weight", row, gemm=1)
        if bias:
            params["fc2_bias"] = ParamSpec((hidden_size,), nn.init.zeros_, "linear_bias", row)
        super().__init__(
            params, 2, params_dtype=params_dtype, device=device, config=config, tp_mesh=tp_mesh, weight_mesh=weight_mesh
        )
        if not bias:
            self.register_parameter("fc1_bias", None)
            self.register_parameter("fc2_bias", None)
        self.hidden_size, self.ffn_hidden_size, self.return_bias = hidden_size, ffn_hidden_size, return_bias
        self.activation, self.glu_interleave = activation, glu_interleave
        self.norm = norm

    def _activate(self, h_TF1: Tensor) -> Tensor:
        activation = ACTIVATIONS[self.activation]
        if not activation.gated:
            return activation.function(h_TF1)
        runs = h_TF1.unflatten(-1, (-1, 2, self.glu_interleave))  # interleaved in runs of w (module docstring)
        gate_TF, up_TF = (half.flatten(-2) for half in runs.unbind(-2))
        return activation.function(gate_TF) * up_TF

    def forward(self, x_TH: Tensor) -> Tensor | tuple[Tensor, Tensor | None]:
        """y [..., H]; with return_bias, (y without fc2's bias, fc2's bias) for the caller to fuse."""
        plan = self.fp8_plan(x_TH.device)
        fc1_q, fc2_q, on_backward_done = (*plan.gemms, plan.on_backward_done) if plan else (None, None, None)
        normalized_TH = self.norm.apply(self, x_TH, prefix="layer_norm_", on_backward_done=on_backward_done)
        fc1 = self.forward_param("fc1_weight"), self.forward_param("fc1_bias")
        h_TF1 = linear(normalized_TH, *fc1, fc1_q, None, self.linear_parallelism("fc1_weight"))
        fc2_weight, fc2_bias = self.forward_param("fc2_weight"), self.forward_param("fc2_bias")
        y_TH = linear(
            self._activate(h_TF1),
            fc2_weight,
            None if self.return_bias else fc2_bias,
            fc2_q,
            None,
            self.linear_parallelism("fc2_weight"),
        )
        return (y_TH, fc2_bias) if self.return_bias else y_TH

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, ffn_hidden_size={self.ffn_hidden_size}, "
            f"activation={self.activation}, glu_interleave={self.glu_interleave}, normalization={self.norm.normalization}, tp_size={self.tp_size}"
        )


__all__ = ["ACTIVATIONS", "Activation", "LayerNormMLP", "check_glu_interleave"]
