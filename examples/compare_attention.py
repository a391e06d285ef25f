"""Verify a user-written attention block, in torch and in Flax NNX, with `bridge.compare`.

The block is a variant the project does not ship: multi-query attention (one key/value head shared
by all query heads) with RMS-normalized queries and keys ("QK-norm"), then a GELU MLP, pre-norm and
residual, written with torchside's and jaxside's Linear (FP8 GEMMs under a recipe) and each
framework's own norms. Run it on one process:

    python examples/compare_attention.py                 # FP8 off
    python examples/compare_attention.py current         # each side under its own FP8 autocast

or data-parallel on 2 co-located CPU processes (the batch split between them, each framework summing
the weight gradients with its own collective; both build the block from `torch_mqa` / `jax_mqa`):

    python examples/compare_attention.py --mesh dp=2

or through the CLI, whose factories are `torch_block` and `jax_block` below:

    shardbridge verify --torch examples.compare_attention:torch_block --jax examples.compare_attention:jax_block

Shape legend: B batch, S sequence, D model width, N query heads, H head dim.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import torch
from flax import nnx
from torch import nn

import torchside
from jaxside.modules import Linear

WIDTH, HEADS, BATCH, SEQ = 64, 4, 2, 16
# How the processes of a --mesh run import this file's factories: by its name when run as a script.
MODULE = Path(__file__).stem if __name__ == "__main__" else __name__
HEAD_DIM = WIDTH // HEADS


class TorchMQABlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.query = torchside.Linear(WIDTH, WIDTH)
        self.key_value = torchside.Linear(WIDTH, 2 * HEAD_DIM)  # one key head and one value head
        self.query_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.key_norm = nn.RMSNorm(HEAD_DIM, eps=1e-6)
        self.out = torchside.Linear(WIDTH, WIDTH)
        self.mlp_norm = nn.LayerNorm(WIDTH)
        self.up = torchside.Linear(WIDTH, 4 * WIDTH)
        self.down = torchside.Linear(4 * WIDTH, WIDTH)

    def attention(self, x_BSD: torch.Tensor) -> torch.Tensor:
        q_BSNH = self.query_norm(self.query(x_BSD).unflatten(-1, (HEADS, HEAD_DIM)))
        k_BSH, v_BSH = self.key_value(x_BSD).split(HEAD_DIM, dim=-1)
        k_BSH = self.key_norm(k_BSH)
        scores_BNSS = torch.einsum("bqnh,bkh->bnqk", q_BSNH, k_BSH) / math.sqrt(HEAD_DIM)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        weights_BNSS = scores_BNSS.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.out(torch.einsum("bnqk,bkh->bqnh", weights_BNSS, v_BSH).flatten(-2))

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.attention(self.norm(x_BSD))
        return x_BSD + self.down(nn.functional.gelu(self.up(self.mlp_norm(x_BSD))))


class JaxMQABlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
        self.query = Linear(WIDTH, WIDTH, rngs=rngs)
        self.key_value = Linear(WIDTH, 2 * HEAD_DIM, rngs=rngs)
        self.query_norm = nnx.RMSNorm(HEAD_DIM, epsilon=1e-6, rngs=rngs)
        self.key_norm = nnx.RMSNorm(HEAD_DIM, epsilon=1e-6, rngs=rngs)
        self.out = Linear(WIDTH, WIDTH, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(WIDTH, epsilon=1e-5, rngs=rngs)
        self.up = Linear(WIDTH, 4 * WIDTH, rngs=rngs)
        self.down = Linear(4 * WIDTH, WIDTH, rngs=rngs)

    def attention(self, x_BSD: jax.Array) -> jax.Array:
        q_BSNH = self.query_norm(self.query(x_BSD).reshape(*x_BSD.shape[:-1], HEADS, HEAD_DIM))
        k_BSH, v_BSH = jnp.split(self.key_value(x_BSD), 2, axis=-1)
        k_BSH = self.key_norm(k_BSH)
        scores_BNSS = jnp.einsum("bqnh,bkh->bnqk", q_BSNH, k_BSH) / math.sqrt(HEAD_DIM)
        causal = jnp.tril(jnp.ones((SEQ, SEQ), dtype=bool))
        weights_BNSS = jax.nn.softmax(jnp.where(causal, scores_BNSS, -jnp.inf), axis=-1)
        return self.out(jnp.einsum("bnqk,bkh->bqnh", weights_BNSS, v_BSH).reshape(x_BSD.shape))

    def __call__(self, x_BSD: jax.Array) -> jax.Array:
        x_BSD = x_BSD + self.attention(self.norm(x_BSD))
        return x_BSD + self.down(jax.nn.gelu(self.up(self.mlp_norm(x_BSD)), approximate=False))


def _inputs() -> torch.Tensor:
    return torch.randn(BATCH, SEQ, WIDTH, generator=torch.Generator().manual_seed(0))


def torch_mqa() -> TorchMQABlock:
    """The torch block, seeded (each process of a --mesh run builds its own)."""
    torch.manual_seed(0)
    return TorchMQABlock()


def jax_mqa() -> JaxMQABlock:
    return JaxMQABlock(nnx.Rngs(0))


def torch_block() -> tuple[nn.Module, torch.Tensor]:
    """The factory `shardbridge verify --torch` calls: (model, example inputs)."""
    return torch_mqa(), _inputs()


def jax_block() -> tuple[nnx.Module, torch.Tensor]:
    """The factory `shardbridge verify --jax` calls (the inputs only give the shapes: JAX gets torch's values)."""
    return jax_mqa(), _inputs()


def main() -> int:
    import bridge

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe", nargs="?", default="off", help="off (default), current, block, ...")
    parser.add_argument("--mesh", help="e.g. dp=2: data-parallel co-located CPU processes")
    args = parser.parse_args()
    if args.mesh:
        models = f"{MODULE}:torch_mqa", f"{MODULE}:jax_mqa"
        report = bridge.compare(*models, _inputs(), recipe=args.recipe, mesh=args.mesh)
    else:
        report = bridge.compare(torch_mqa(), jax_mqa(), _inputs(), recipe=args.recipe)
    print(report.table())
    return 0 if report.passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
