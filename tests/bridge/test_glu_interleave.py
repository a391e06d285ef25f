"""`glu_interleave`: fc1's gate and up rows in runs of w, in torch's LayerNormMLP and its JAX twin.

The reference is the w = 1 layout (rows 2i gate i, 2i + 1 up i): the same gate and up weights laid
out in runs of w, by an independent permutation written here, must give the same output.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxside.modules import LayerNormMLP as JaxMLP
from torchside.modules import LayerNormMLP, ModuleConfig

HIDDEN, FFN, W = 32, 256, 128


def fc1_rows(gate: torch.Tensor, up: torch.Tensor, w: int) -> torch.Tensor:
    """Our fc1 [2F, H] of gate and up [F, H]: runs of w rows, gate run j then up run j (written row by row)."""
    rows = []
    for run in range(gate.shape[0] // w):
        rows += [gate[run * w + i] for i in range(w)] + [up[run * w + i] for i in range(w)]
    return torch.stack(rows)


def _weights():
    generator = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(FFN, HIDDEN, generator=generator) / HIDDEN**0.5 for _ in range(2))
    fc2 = torch.randn(HIDDEN, FFN, generator=generator) / FFN**0.5
    x = torch.randn(6, HIDDEN, generator=generator)
    return gate, up, fc2, x


def test_torch_runs_of_128_compute_what_pairs_compute():
    gate, up, fc2, x = _weights()
    outputs = []
    for w in (1, W):
        mlp = LayerNormMLP(HIDDEN, FFN, bias=False, normalization="RMSNorm", activation="swiglu", glu_interleave=w)
        with torch.no_grad():
            mlp.fc1_weight.copy_(fc1_rows(gate, up, w))
            mlp.fc2_weight.copy_(fc2)
            outputs.append(mlp(x))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-6, atol=1e-7)  # (GEMM blocking may reorder sums)
    with torch.no_grad():  # a layout that does not match the weights differs: the test sees the layout
        mlp.fc1_weight.copy_(fc1_rows(gate, up, 1))
        assert not torch.allclose(mlp(x), outputs[0], atol=1e-3)


def test_jax_runs_of_128_compute_what_pairs_compute():
    gate, up, fc2, x = _weights()
    outputs = []
    for w in (1, W):
        mlp = JaxMLP(HIDDEN, FFN, bias=False, normalization="RMSNorm", activation="swiglu", glu_interleave=w,
                     rngs=nnx.Rngs(0))  # fmt: skip
        mlp.fc1_kernel.set_value(jnp.asarray(fc1_rows(gate, up, w).T.numpy()))
        mlp.fc2_kernel.set_value(jnp.asarray(fc2.T.numpy()))
        outputs.append(np.asarray(nnx.jit(lambda m, v: m(v))(mlp, jnp.asarray(x.numpy()))))  # one program: fast
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6, atol=1e-7)
    torch_mlp = LayerNormMLP(HIDDEN, FFN, bias=False, normalization="RMSNorm", activation="swiglu", glu_interleave=W)
    with torch.no_grad():
        torch_mlp.fc1_weight.copy_(fc1_rows(gate, up, W))
        torch_mlp.fc2_weight.copy_(fc2)
        np.testing.assert_allclose(outputs[1], torch_mlp(x).numpy(), rtol=1e-5, atol=1e-6)


def test_a_tp_shard_must_hold_whole_runs():
    with pytest.raises(ValueError, match=r"glu_interleave=128, tp_size=4\).*multiple of glu_interleave x tp_size = 512"):
        LayerNormMLP(HIDDEN, FFN, activation="swiglu", glu_interleave=W, config=ModuleConfig(tp_size=4), device="meta")
    LayerNormMLP(HIDDEN, FFN, activation="swiglu", glu_interleave=W, config=ModuleConfig(tp_size=2), device="meta")
    with pytest.raises(ValueError, match="only a gated activation"):
        LayerNormMLP(HIDDEN, FFN, activation="gelu", glu_interleave=W)
    with pytest.raises(ValueError, match="multiple of glu_interleave"):
        JaxMLP(HIDDEN, 192, activation="swiglu", glu_interleave=W, rngs=nnx.Rngs(0))
