"""The models `shardbridge verify` builds twice: a torchside stack and its jaxside twin, layer for layer.

Each is `layers` (a list of blocks with the same attribute names on both sides), and a call
returns (output, every block's output) so that a comparison can name the first block that
diverges. Blocks, by model name (H hidden, F = 4H ffn):

    linear        x + down(up(x))            up: Linear H -> F column-parallel, down: Linear F -> H row-parallel
    mlp           x + mlp(x)                 mlp: LayerNormMLP H -> F -> H (fc1 column, fc2 row)
    transformer   TransformerLayer(x)        self_attention (fused LayerNorm-QKV, proj) + layernorm_mlp

A placement plan (`TwinSpec.plan`, twinspec.plan) gives the mlp and transformer blocks their TP modes
by name (`layers.N.mlp`, `layers.N.self_attention`, `layers.N.layernorm_mlp`), on both sides alike.

Activations are [S, B, H] (sequence first); every parameter and activation is fp32. The JAX stack
declares dim 1 the batch (jaxside.modules.tokens), so on a data-parallel mesh its FP8 GEMMs cast each
DP shard's tokens apart, as each torch rank casts its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twinspec.plan import DEFAULT_PLAN, Plan

HEAD_DIM = 32  # transformer: heads = hidden / HEAD_DIM


def _PLACEHOLDER(key, shape, dtype):
    """JAX kernels start as zeros: torch's values replace them (a random init would compile per shape for nothing)."""
    import jax.numpy as jnp

    return jnp.zeros(shape, dtype)


@dataclass(frozen=True)
class TwinSpec:
    """Sizes of a verify model."""

    model: str
    layers: int
    hidden: int
    tp_size: int
    amax_history_len: int
    plan: Plan = field(default=DEFAULT_PLAN)

    def splits(self, unit: str, kind: str) -> bool:
        """Whether the plan splits the attention or MLP unit `unit` over TP (else it replicates it)."""
        return self.plan.tp_mode(unit, kind) == "split"

    def layer_tp(self, index: int) -> dict[str, str]:
        """The TransformerConfig TP fields of block `index`."""
        return {
            "attention_tp": self.plan.tp_mode(f"layers.{index}.self_attention", "attention"),
            "mlp_tp": self.plan.tp_mode(f"layers.{index}.layernorm_mlp", "mlp"),
        }

    @property
    def ffn(self) -> int:
        return 4 * self.hidden

    sequence_parallel: bool = False  # torch only: the JAX twin's layouts do not depend on it


def _torch_linear_block(spec: TwinSpec, config, index: int):
    import dataclasses

    from torch import nn

    from torchside.modules import Linear

    class LinearBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = Linear(spec.hidden, spec.ffn, config=dataclasses.replace(config, parallel_mode="column"))
            self.down = Linear(spec.ffn, spec.hidden, config=dataclasses.replace(config, parallel_mode="row"))

        def forward(self, x):
            return x + self.down(self.up(x))

    return LinearBlock()


def _jax_linear_block(spec: TwinSpec, config, index: int, rngs):
    import dataclasses

    from flax import nnx

    from jaxside.modules import Linear

    class LinearBlock(nnx.Module):
        def __init__(self) -> None:
            column, row = (dataclasses.replace(config, parallel_mode=mode) for mode in ("column", "row"))
            self.up = Linear(spec.hidden, spec.ffn, config=column, kernel_init=_PLACEHOLDER, rngs=rngs)
            self.down = Linear(spec.ffn, spec.hidden, config=row, kernel_init=_PLACEHOLDER, rngs=rngs)

        def __call__(self, x):
            return x + self.down(self.up(x))

    return LinearBlock()


def _torch_mlp_block(spec: TwinSpec, config, index: int):
    from torch import nn

    from torchside.modules import LayerNormMLP

    class MLPBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            split = spec.splits(f"layers.{index}.mlp", "mlp")
            self.mlp = LayerNormMLP(spec.hidden, spec.ffn, set_parallel_mode=split, config=config)

        def forward(self, x):
            return x + self.mlp(x)

    return MLPBlock()


def _jax_mlp_block(spec: TwinSpec, config, index: int, rngs):
    from flax import nnx

    from jaxside.modules import LayerNormMLP

    class MLPBlock(nnx.Module):
        def __init__(self) -> None:
            inits = {"kernel_init": _PLACEHOLDER, "output_kernel_init": _PLACEHOLDER}
            split = spec.splits(f"layers.{index}.mlp", "mlp")
            self.mlp = LayerNormMLP(spec.hidden, spec.ffn, set_parallel_mode=split, config=config, **inits, rngs=rngs)

        def __call__(self, x):
            return x + self.mlp(x)

    return MLPBlock()


def _torch_transformer_block(spec: TwinSpec, config, index: int):
    from torchside.modules import TransformerConfig, TransformerLayer

    heads = spec.hidden // HEAD_DIM
    layer_config = TransformerConfig(module_config=config, **spec.layer_tp(index))
    return TransformerLayer(spec.hidden, spec.ffn, heads, config=layer_config)


def _jax_transformer_block(spec: TwinSpec, config, index: int, rngs):
    from jaxside.modules import TransformerConfig, TransformerLayer

    heads = spec.hidden // HEAD_DIM
    inits = {"kernel_init": _PLACEHOLDER, "output_kernel_init": _PLACEHOLDER}
    config = TransformerConfig(module_config=config, **spec.layer_tp(index))
    return TransformerLayer(spec.hidden, spec.ffn, heads, config=config, **inits, rngs=rngs)


# model name -> (torch block builder, JAX block builder)
MODELS: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "linear": (_torch_linear_block, _jax_linear_block),
    "mlp": (_torch_mlp_block, _jax_mlp_block),
    "transformer": (_torch_transformer_block, _jax_transformer_block),
}


def check_spec(spec: TwinSpec) -> None:
    """ValueError for sizes the models cannot take."""
    if spec.model not in MODELS:
        raise ValueError(f"model {spec.model!r}: use one of {', '.join(MODELS)}")
    if spec.layers < 1 or spec.hidden < 1:
        raise ValueError(f"layers={spec.layers}, hidden={spec.hidden}: both must be >= 1")
    if spec.model == "transformer" and spec.hidden % HEAD_DIM:
        raise ValueError(f"transformer: hidden={spec.hidden} must be a multiple of the head dim {HEAD_DIM}")


def build_torch(spec: TwinSpec):
    """The torch stack on the meta device (parallelize materializes it), TP sizes from the spec."""
    import torch
    from torch import nn

    from torchside.modules import ModuleConfig

    config = ModuleConfig(
        amax_history_len=spec.amax_history_len, tp_size=spec.tp_size, sequence_parallel=spec.sequence_parallel
    )
    build_block = MODELS[spec.model][0]

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([build_block(spec, config, index) for index in range(spec.layers)])

        def forward(self, x):
            outputs = []
            for layer in self.layers:
                x = layer(x)
                outputs.append(x)
            return x, outputs

    with torch.device("meta"):
        return Stack()


def build_jax(spec: TwinSpec):
    """The JAX twin (parameters on this process's device until placed)."""
    from flax import nnx

    from jaxside.modules import ModuleConfig
    from jaxside.modules.tokens import batch_dim

    config = ModuleConfig(amax_history_len=spec.amax_history_len)
    build_block = MODELS[spec.model][1]
    rngs = nnx.Rngs(0)

    class Stack(nnx.Module):
        def __init__(self) -> None:
            self.layers = nnx.List([build_block(spec, config, index, rngs) for index in range(spec.layers)])

        def __call__(self, x):
            outputs = []
            with batch_dim(1):  # [S, B, H]
                for layer in self.layers:
                    x = layer(x)
                    outputs.append(x)
            return x, outputs

    return Stack()


__all__ = ["MODELS", "TwinSpec", "build_jax", "build_torch", "check_spec"]
