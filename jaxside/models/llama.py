"""`Llama`: the Flax NNX twin of torchside.models.llama, and `load_hf` for Hugging Face checkpoints.

Shape legend: B batch, S sequence, D hidden size, V vocabulary, Vp padded vocabulary.

    tokens_BS -> embedding -> x_SBD -> num_layers x TransformerLayer -> RMSNorm -> logits_SBV[..., :V]

The same `LlamaConfig` (twinspec.llama) builds both models, and the parameters sit
under the paths bridge.params maps torch's names to: a 2-D torch `...weight` [out, in] is the
Flax `...kernel` [in, out], anything else keeps its name. So the embedding is `embedding.kernel`
[D, Vp] (torch's `embedding.weight` [Vp, D] transposed), an untied head `lm_head.kernel` [D, Vp],
the final norm `norm.weight`, and the layers are jaxside.modules.TransformerLayer's
(`layers.N.self_attention.layernorm_qkv.kernel`, ...). A tied head multiplies by the embedding's
kernel and has no path of its own, as in torch.

Sharding: the embedding and head kernels are column-parallel kernels of jaxside.sharding's rules
(logical axes ("embed", "vocab")): the vocabulary over ('tp', 'dp_shard'), as torch's vocab-split
`Shard(0)` embedding under FSDP2 is `(_StridedShard(0, sf=tp), Shard(0))`. Vp must divide by
tp x dp_shard (JAX refuses uneven dims): `LlamaConfig.vocab_multiple`, which `load_hf` sets to it.
The head's GEMM runs with fp32 accumulation, as torch's runs in high precision: HIGHEST precision for
fp32 operands, the tensor cores' DEFAULT for 16-bit ones, whose products are exact in fp32
(jaxside.modules.functions.exact_product_precision).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import Array
from jax.sharding import Mesh, NamedSharding

from twinspec.hf_llama import Checkpoint, Piece
from twinspec.llama import LLAMA_CONFIGS, LlamaConfig, RopeScaling
from jaxside.modules import ModuleConfig, RMSNorm, RotaryPositionEmbedding, TransformerConfig, TransformerLayer
from jaxside.modules.base import parameter
from jaxside.modules.functions import exact_product_precision
from jaxside.modules.placement import gathered, shardings
from jaxside.modules.tokens import batch_dim
from jaxside.sharding import constrain, make_mesh, spec_for
from twinspec.mesh import DP_SHARD, TP
from twinspec.plan import DEFAULT_PLAN, Plan, torch_name


def transformer_config(
    config: LlamaConfig, module_config: ModuleConfig, plan: Plan = DEFAULT_PLAN, index: int = 0
) -> TransformerConfig:
    """The TransformerLayer settings of Llama block `index` (torchside.models.llama.transformer_config's twin)."""
    return TransformerConfig(
        attention_tp=plan.tp_mode(f"layers.{index}.self_attention", "attention"),
        mlp_tp=plan.tp_mode(f"layers.{index}.layernorm_mlp", "mlp"),
        kv_channels=config.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_eps,
        activation="swiglu",
        glu_interleave=config.glu_interleave,
        bias=config.bias,
        qkv_format="sbhd",
        attn_mask_type="causal",
        module_config=module_config,
    )


class VocabKernel(nnx.Module):
    """`kernel` [D, Vp]: the token embedding (`embed`) or an untied head (`logits`)."""

    tp_unit = "embedding"  # the kind of unit whose TP mode a placement plan chooses (twinspec.plan)

    def __init__(self, hidden_size: int, vocab_size: int, init, dtype, rngs: nnx.Rngs) -> None:
        self.kernel = parameter(rngs, init, (hidden_size, vocab_size), dtype, ("embed", "vocab"), "kernel", "column")

    def embed(self, tokens_SB) -> Array:
        """x [S, B, D]: column t of the kernel for token t."""
        return jnp.moveaxis(jnp.take(gathered(self.kernel), tokens_SB, axis=1), 0, -1)

    def logits(self, h_SBD) -> Array:
        """h @ kernel [S, B, Vp] in high precision."""
        kernel = gathered(self.kernel)
        return jnp.einsum("sbd,dv->sbv", h_SBD, kernel, precision=exact_product_precision(h_SBD, kernel))


class LlamaRotary(RotaryPositionEmbedding):
    """Rotary angles with Llama 3's frequency scaling applied to inv_freq (None: plain RoPE)."""

    def __init__(self, dim: int, rotary_base: float, scaling: RopeScaling | None) -> None:
        super().__init__(dim, rotary_base=rotary_base)
        self.scaling = scaling

    def inv_freq(self) -> Array:
        inv_freq = super().inv_freq()
        return inv_freq if self.scaling is None else self.scaling.scale(inv_freq, jnp.where)


class Llama(nnx.Module):
    """Token ids [B, S] -> logits [S, B, V] (module docstring)."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        params_dtype=jnp.float32,
        module_config: ModuleConfig | None = None,
        kernel_init=None,
        plan: Plan = DEFAULT_PLAN,
        rngs: nnx.Rngs,
    ) -> None:
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama(config={config!r}): pass a LlamaConfig, e.g. LLAMA_CONFIGS['tiny']")
        module_config = ModuleConfig() if module_config is None else module_config
        self.config = config
        self.padded_vocab_size = config.padded_vocab_size()
        init = nnx.initializers.normal(config.init_std) if kernel_init is None else kernel_init
        output_init = nnx.initializers.normal(config.init_std / math.sqrt(2 * config.num_layers))
        output_init = output_init if kernel_init is None else kernel_init
        vocab = (config.hidden_size, self.padded_vocab_size, init, params_dtype, rngs)
        self.embedding = VocabKernel(*vocab)
        self.layers = nnx.List(
            [
                TransformerLayer(
                    config.hidden_size,
                    config.ffn_hidden_size,
                    config.num_heads,
                    num_gqa_groups=config.num_kv_heads,
                    params_dtype=params_dtype,
                    kernel_init=init,
                    output_kernel_init=output_init,
                    config=transformer_config(config, module_config, plan, index),
                    rngs=rngs,
                )
                for index in range(config.num_layers)
            ]
        )
        self.norm = RMSNorm(
            config.hidden_size, eps=config.norm_eps, params_dtype=params_dtype, config=module_config, rngs=rngs
        )
        self.lm_head = None if config.tie_word_embeddings else VocabKernel(*vocab)
        self.rotary = LlamaRotary(config.head_dim, config.rope_theta, config.rope_scaling)

    def __call__(self, tokens_BS) -> Array:
        """Logits [S, B, V] of the next token at every position (padding ids sliced off)."""
        if tokens_BS.ndim != 2 or not jnp.issubdtype(tokens_BS.dtype, jnp.integer):
            got = f"{tokens_BS.dtype} {list(tokens_BS.shape)}"
            raise ValueError(f"Llama takes token ids as an integer array [B, S], got {got}")
        tokens_SB = tokens_BS.T
        freqs = self.rotary(tokens_SB.shape[0])
        x_SBD = constrain(self.embedding.embed(tokens_SB), spec_for(("seq", "batch", "embed")))
        with batch_dim(1):
            for layer in self.layers:
                x_SBD = layer(x_SBD, rotary_pos_emb=freqs)
            h_SBD = self.norm(x_SBD)
        head = self.embedding if self.lm_head is None else self.lm_head
        return head.logits(h_SBD)[..., : self.config.vocab_size]


def _read(checkpoint: Checkpoint, name: str, shape: tuple[int, ...], index: tuple[slice, ...], *, dtype) -> np.ndarray:
    """The box `index` of our tensor `name` (torch's layout, global `shape`) in `dtype`, read from the checkpoint.

    A box that is one HF tensor's rows in our dtype is a view of the file's mapping: the transfer to the
    device reads its bytes, nothing copies them before. Any other box (the fused QKV and fc1, the padded
    vocabulary, a dtype to convert) is assembled on the host, each piece read once into it.
    """
    rows, *cols = [s.indices(n)[:2] for s, n in zip(index, shape)]
    cols = cols[0] if cols else None
    pieces: list[tuple[Piece, np.ndarray | None]] = []
    checkpoint.read_box(name, rows, cols, "numpy", lambda piece, values: pieces.append((piece, values)))
    box_shape = (rows[1] - rows[0], *([cols[1] - cols[0]] if cols else []))
    if len(pieces) == 1 and cols is not None:  # (a 1-D box is copied: tiny, and then never an alias of the file)
        values = pieces[0][1]
        if values is not None and values.dtype == dtype and values.shape == box_shape:
            return values
    box = np.zeros(box_shape, dtype)
    for piece, values in pieces:
        if values is not None:
            box[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step] = values
    return box


def _load_param(checkpoint: Checkpoint, name: str, shape: tuple[int, ...], sharding: NamedSharding, dtype) -> Array:
    """One parameter of global `shape` with `sharding`, each device's shard read from the file on its own.

    A kernel [in, out] is the transpose of the rows the file holds: the transfer gets the transposed view
    and copies it once, transposing. (Sending the rows and transposing on the GPU was measured slower on
    the H200: 0.73 s hot / 2.93 s cold against 0.50 / 1.53 for a 0.75B checkpoint, benchmarks/RESULTS.md.)
    """
    read = functools.partial(_read, checkpoint, name, dtype=np.dtype(dtype))
    if len(shape) == 1:
        return jax.make_array_from_callback(shape, sharding, functools.partial(read, shape))
    file_shape = shape[::-1]
    return jax.make_array_from_callback(shape, sharding, lambda index: read(file_shape, index[::-1]).T)


def _abstract_init(key, shape, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
    """A kernel initializer that allocates nothing: the model's skeleton, its kernels read later."""
    return jax.ShapeDtypeStruct(shape, dtype)


DTYPES = {"F32": jnp.float32, "BF16": jnp.bfloat16}


def load_hf(path: str | Path, *, mesh: Mesh | None = None, dtype=None) -> Llama:
    """The twin with an HF LlamaForCausalLM directory's weights, every parameter a NamedSharding'd array on `mesh`.

    mesh: from jaxside.sharding.make_mesh (None: one device). Each device's shard is read on its own
    (`jax.make_array_from_callback`): only the rows and columns of that shard (twinspec.hf_llama), each
    byte read once, from the files' mappings to the device (through a host box only where our tensor
    fuses HF tensors, pads the vocabulary or converts the dtype: `_read`). The model is built eagerly
    with kernels that are only shapes (no trace or compile of its construction); its small FP8 state is
    a fresh model's.
    dtype: the parameters' dtype; None keeps the checkpoint's. ValueError naming the file for bad input.
    """
    checkpoint = Checkpoint(path)
    mesh = make_mesh() if mesh is None else mesh
    config = dataclasses.replace(checkpoint.config, vocab_multiple=mesh.shape[TP] * mesh.shape[DP_SHARD])
    if dtype is None:
        if checkpoint.dtype() not in DTYPES:
            raise ValueError(f"{path}: the checkpoint is {checkpoint.dtype()}; pass dtype=jnp.float32 or jnp.bfloat16")
        dtype = DTYPES[checkpoint.dtype()]
    model = Llama(config, params_dtype=dtype, kernel_init=_abstract_init, rngs=nnx.Rngs(0))
    placements = dict(nnx.to_flat_state(shardings(model, mesh)))
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {path: torch_name(".".join(map(str, path)), v.get_value().ndim) for path, v in params}
    unmapped = sorted(set(names.values()) ^ set(checkpoint.sources))
    assert not unmapped, f"the HF table and the JAX model disagree on {unmapped}"
    for path, variable in params:
        shape = tuple(variable.get_value().shape)
        sharding = placements[path].get_value()
        value = _load_param(checkpoint, names[path], shape, sharding, dtype)
        variable.set_value(value)
    rest = nnx.state(model, nnx.Not(nnx.Param))
    rest_placement = nnx.from_flat_state({path: placements[path] for path, _ in nnx.to_flat_state(rest)})
    nnx.update(model, jax.device_put(rest, rest_placement))
    return model


__all__ = [
    "LLAMA_CONFIGS",
    "Llama",
    "LlamaConfig",
    "LlamaRotary",
    "RopeScaling",
    "VocabKernel",
    "load_hf",
    "torch_name",
    "transformer_config",
]
