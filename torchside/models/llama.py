"""`Llama`: a Llama-style decoder from our modules; the LM head tied to the token embedding or its own.

Shape legend: B batch, S sequence, D hidden size, V vocabulary, Vp padded vocabulary (below).

    tokens_BS -> embedding (nn.Embedding) -> x_SBD -> num_layers x TransformerLayer -> RMSNorm
              -> lm_head: logits_SBV = (h_SBD @ weight.T)[..., :V]

Each TransformerLayer is pre-norm RMSNorm attention (rotary, grouped-query heads, biases only with
`LlamaConfig.bias`) plus an RMSNorm SwiGLU LayerNormMLP. Hidden states are sequence-first ([S, B, D],
"sbhd"), the layout sequence parallelism splits. With `tie_word_embeddings` (the default) the head
has no parameter of its own: it multiplies by the embedding's weight, so the tie is one parameter,
one DTensor after parallelization and one checkpoint key (`embedding.weight`); no parallelization
step can untie it. Untied, the head owns `lm_head.weight` [Vp, D], split like the embedding. The
head's GEMM runs in high precision whatever the recipe (as in torchtitan and most FP8 recipes: the
logits feed a softmax over V).

`LlamaConfig` (framework-free, shared with the JAX twin: twinspec.llama) carries the
options real checkpoints need: head_dim, rope_theta, Llama 3 rope scaling, norm eps, biases, and
the vocabulary padding: the embedding (and an untied head) hold Vp = `padded_vocab_size(tp)` rows
so that TP splits them evenly; the logits of the padding ids are sliced off. `load_hf` reads a
Hugging Face checkpoint (torchside.models.llama_hf).

Nothing here imports torch.distributed: `torchside.models.llama_parallel` splits the embedding
and the head with torch's own tensor-parallel styles and our layers with `set_device_mesh`.
"""

from __future__ import annotations

import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Framework-free (no jax): the config and the HF table are shared with jaxside.models.llama.
from torchside.modules import ModuleConfig, RMSNorm, RotaryPositionEmbedding, TransformerConfig, TransformerLayer
from twinspec.llama import LLAMA_CONFIGS, LlamaConfig, RopeScaling
from twinspec.plan import DEFAULT_PLAN, Plan


def transformer_config(
    config: LlamaConfig, module_config: ModuleConfig, plan: Plan = DEFAULT_PLAN, index: int = 0
) -> TransformerConfig:
    """The TransformerLayer settings of Llama block `index`, with the TP modes `plan` gives it."""
    return TransformerConfig(
        attention_tp=plan.tp_mode(f"layers.{index}.self_attention", "attention"),
        mlp_tp=plan.tp_mode(f"layers.{index}.layernorm_mlp", "mlp"),
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_eps,
        activation="swiglu",
        glu_interleave=config.glu_interleave,
        bias=config.bias,
        kv_channels=config.head_dim,
        qkv_format="sbhd",
        attn_mask_type="causal",
        module_config=module_config,
    )


class TokenEmbedding(nn.Embedding):
    """nn.Embedding initialized N(0, init_std) (torch's default is N(0, 1)), also by materialize after meta."""

    tp_unit = "embedding"  # the kind of unit whose TP mode a placement plan chooses (twinspec.plan)

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float, **factory) -> None:
        self.init_std = init_std  # read by reset_parameters, which nn.Embedding.__init__ calls
        super().__init__(vocab_size, hidden_size, **factory)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class LMHead(nn.Module):
    """logits = h @ weight.T: its own weight [Vp, D] when untied, else the embedding's, passed in by Llama."""

    tp_unit = "embedding"  # untied: split as the embedding (twinspec.plan); tied, it holds no parameter

    def __init__(self, vocab_size: int | None = None, hidden_size: int = 0, init_std: float = 0.02, **factory) -> None:
        super().__init__()
        self.init_std = init_std
        if vocab_size is None:
            self.register_parameter("weight", None)  # tied: the embedding's weight is passed to forward
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, **factory))
            self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.normal_(self.weight, mean=0.0, std=self.init_std)

    def forward(self, h_SBD: Tensor, weight_VD: Tensor) -> Tensor:
        return F.linear(h_SBD, weight_VD)


class Llama(nn.Module):
    """Token ids [B, S] -> logits [S, B, V] (see the module docstring); build on "meta" to parallelize first."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        module_config: ModuleConfig | None = None,
        plan: Plan = DEFAULT_PLAN,
    ) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama(config={config!r}): pass a LlamaConfig, e.g. LLAMA_CONFIGS['tiny']")
        module_config = ModuleConfig() if module_config is None else module_config
        self.config = config
        self.padded_vocab_size = config.padded_vocab_size(module_config.tp_size)  # logits keep vocab_size ids
        dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        factory = {"dtype": dtype, "device": device}
        self.embedding = TokenEmbedding(self.padded_vocab_size, config.hidden_size, config.init_std, **factory)
        init = partial(nn.init.normal_, mean=0.0, std=config.init_std)
        output_init = partial(nn.init.normal_, mean=0.0, std=config.init_std / math.sqrt(2 * config.num_layers))
        self.layers = nn.ModuleList(
            TransformerLayer(
                config.hidden_size,
                config.ffn_hidden_size,
                config.num_heads,
                num_gqa_groups=config.num_kv_heads,
                params_dtype=dtype,
                device=device,
                init_method=init,
                output_layer_init_method=output_init,
                config=transformer_config(config, module_config, plan, index),
            )
            for index in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, eps=config.norm_eps, params_dtype=dtype, device=device, config=module_config
        )
        if config.tie_word_embeddings:
            self.lm_head = LMHead()
        else:
            self.lm_head = LMHead(self.padded_vocab_size, config.hidden_size, config.init_std, **factory)
        self.rotary = RotaryPositionEmbedding(config.head_dim, rotary_base=config.rope_theta)  # fp32 angles, CPU
        if config.rope_scaling is not None:
            self.rotary.inv_freq = config.rope_scaling.scale(self.rotary.inv_freq, torch.where)
        self._freqs: dict[tuple[int, torch.device], Tensor] = {}  # (S, device) -> angles there

    def rotary_freqs(self, seq_len: int, device: torch.device) -> Tensor:
        """The rotary angles of positions 0..seq_len-1 on `device`, computed once per (seq_len, device).

        torch.compile traces the computation into the graph instead: a cache there is a guard on the dict, which
        the first call fills, and with it a recompile on the second call."""
        if torch.compiler.is_compiling():
            return self.rotary(seq_len).to(device)
        key = (seq_len, torch.device(device))
        if key not in self._freqs:
            self._freqs[key] = self.rotary(seq_len).to(device)
        return self._freqs[key]

    def forward(self, tokens_BS: Tensor) -> Tensor:
        """Logits [S, B, V] (a vocab-split DTensor under tensor parallelism) of the next token at every position.

        With a padded vocabulary the padding's logits are sliced off; under TP that gathers the logits
        first (a plain tensor, not a vocab-split DTensor): choose a vocabulary TP divides to avoid it.
        """
        if not isinstance(tokens_BS, Tensor) or tokens_BS.dim() != 2 or tokens_BS.dtype != torch.long:
            got = f"{tokens_BS.dtype} {list(tokens_BS.shape)}" if isinstance(tokens_BS, Tensor) else type(tokens_BS)
            raise ValueError(f"Llama takes token ids as an int64 tensor [B, S], got {got}")
        tokens_SB = tokens_BS.t()
        freqs = self.rotary_freqs(tokens_SB.shape[0], tokens_SB.device)
        x_SBD = self.embedding(tokens_SB)
        for layer in self.layers:
            x_SBD = layer(x_SBD, rotary_pos_emb=freqs)
        head_weight = self.embedding.weight if self.config.tie_word_embeddings else self.lm_head.weight
        logits_SBV = self.lm_head(self.norm(x_SBD), head_weight)
        if self.padded_vocab_size == self.config.vocab_size:
            return logits_SBV
        if hasattr(logits_SBV, "full_tensor"):  # a DTensor: slicing its split dim needs the whole of it
            logits_SBV = logits_SBV.full_tensor()
        return logits_SBV[..., : self.config.vocab_size]


def load_hf(
    path: str | Path,
    *,
    mesh=None,
    tp_mesh=None,
    weight_mesh=None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> Llama:
    """A Llama with the weights of a Hugging Face LlamaForCausalLM directory, parallelized when meshes are given.

    See torchside.models.llama_hf (this is its entry point; that module imports torch.distributed).
    """
    from torchside.models.llama_hf import load_hf as load

    return load(path, mesh=mesh, tp_mesh=tp_mesh, weight_mesh=weight_mesh, device=device, dtype=dtype)


__all__ = [
    "LLAMA_CONFIGS",
    "LMHead",
    "Llama",
    "LlamaConfig",
    "RopeScaling",
    "TokenEmbedding",
    "load_hf",
    "transformer_config",
]
