"""`Llama`: a Llama-style decoder from our modules, with the LM head tied to the token embedding.

Shape legend: B batch, S sequence, D hidden size, V vocabulary.

    tokens_BS -> embedding (nn.Embedding) -> x_SBD -> num_layers x TransformerLayer -> RMSNorm
              -> lm_head: logits_SBV = h_SBD @ embedding.weight.T

Each TransformerLayer is pre-norm RMSNorm attention (rotary, grouped-query heads, no biases) plus
an RMSNorm SwiGLU LayerNormMLP. Hidden states are sequence-first ([S, B, D], "sbhd"), the layout
sequence parallelism splits. The head has no parameter of its own: it multiplies by the embedding's
weight, so the tie is one parameter, one DTensor after parallelization and one checkpoint key
(`embedding.weight`); no parallelization step can untie it. The head's GEMM runs in high precision
whatever the recipe (as in torchtitan and most FP8 recipes: the logits feed a softmax over V).

Nothing here imports torch.distributed: `torchside.models.llama_parallel` splits the embedding
and the head with torch's own tensor-parallel styles and our layers with `set_device_mesh`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchside.modules import ModuleConfig, RMSNorm, RotaryPositionEmbedding, TransformerConfig, TransformerLayer


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes (Llama's names); `head_dim` is hidden_size / num_heads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02  # normal init of every weight; output projections get init_std / sqrt(2 * num_layers)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig({name}={value!r}): pass an integer >= 1")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig(hidden_size={self.hidden_size}, num_heads={self.num_heads}, num_kv_heads="
                f"{self.num_kv_heads}): hidden_size must be a multiple of num_heads and num_heads of num_kv_heads"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def num_parameters(self) -> int:
        """Parameter count (the tied head counted once)."""
        d, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attention = d * (d + 2 * kv) + d * d + d  # QKV, output projection, input norm
        mlp = d * 2 * self.ffn_hidden_size + self.ffn_hidden_size * d + d  # fc1 (gate; up), fc2, norm
        return self.vocab_size * d + self.num_layers * (attention + mlp) + d


LLAMA_CONFIGS: dict[str, LlamaConfig] = {
    # CPU tests: every dim a multiple of 32 (MXFP8 tiles), heads and vocab split by TP 2.
    "tiny": LlamaConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=128),
    # 128.4M parameters (103.8M in the layers): GPT-2 small's width with Llama 2's vocabulary.
    "125m": LlamaConfig(
        vocab_size=32000, hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4, ffn_hidden_size=3072
    ),
    # 1.04B parameters: Llama 3.2 1B's layers with Llama 2's 32k vocabulary.
    "1b": LlamaConfig(
        vocab_size=32000, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, ffn_hidden_size=8192
    ),
}


def transformer_config(config: LlamaConfig, module_config: ModuleConfig) -> TransformerConfig:
    """The TransformerLayer settings of a Llama block."""
    return TransformerConfig(
        normalization="RMSNorm",
        layernorm_epsilon=config.norm_eps,
        activation="swiglu",
        bias=False,
        qkv_format="sbhd",
        attn_mask_type="causal",
        module_config=module_config,
    )


class TokenEmbedding(nn.Embedding):
    """nn.Embedding initialized N(0, init_std) (torch's default is N(0, 1)), also by materialize after meta."""

    def __init__(self, vocab_size: int, hidden_size: int, init_std: float, **factory) -> None:
        self.init_std = init_std  # read by reset_parameters, which nn.Embedding.__init__ calls
        super().__init__(vocab_size, hidden_size, **factory)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.init_std)


class LMHead(nn.Module):
    """logits = h @ weight.T with a weight it does not own (the embedding's); a module so TP styles can wrap it."""

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
    ) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama(config={config!r}): pass a LlamaConfig, e.g. LLAMA_CONFIGS['tiny']")
        module_config = ModuleConfig() if module_config is None else module_config
        self.config = config
        dtype = torch.get_default_dtype() if params_dtype is None else params_dtype
        self.embedding = TokenEmbedding(
            config.vocab_size, config.hidden_size, config.init_std, dtype=dtype, device=device
        )
        init = partial(nn.init.normal_, mean=0.0, std=config.init_std)
        output_init = partial(nn.init.normal_, mean=0.0, std=config.init_std / math.sqrt(2 * config.num_layers))
        layer_config = transformer_config(config, module_config)
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
                config=layer_config,
            )
            for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(
            config.hidden_size, eps=config.norm_eps, params_dtype=dtype, device=device, config=module_config
        )
        self.lm_head = LMHead()
        self.rotary = RotaryPositionEmbedding(config.head_dim, rotary_base=config.rope_theta)  # fp32 angles, CPU
        self._freqs: dict[tuple[int, torch.device], Tensor] = {}  # (S, device) -> angles there

    def rotary_freqs(self, seq_len: int, device: torch.device) -> Tensor:
        """The rotary angles of positions 0..seq_len-1 on `device`, computed once per (seq_len, device)."""
        key = (seq_len, torch.device(device))
        if key not in self._freqs:
            self._freqs[key] = self.rotary(seq_len).to(device)
        return self._freqs[key]

    def forward(self, tokens_BS: Tensor) -> Tensor:
        """Logits [S, B, V] (a vocab-split DTensor under tensor parallelism) of the next token at every position."""
        if not isinstance(tokens_BS, Tensor) or tokens_BS.dim() != 2 or tokens_BS.dtype != torch.long:
            got = f"{tokens_BS.dtype} {list(tokens_BS.shape)}" if isinstance(tokens_BS, Tensor) else type(tokens_BS)
            raise ValueError(f"Llama takes token ids as an int64 tensor [B, S], got {got}")
        tokens_SB = tokens_BS.t()
        freqs = self.rotary_freqs(tokens_SB.shape[0], tokens_SB.device)
        x_SBD = self.embedding(tokens_SB)
        for layer in self.layers:
            x_SBD = layer(x_SBD, rotary_pos_emb=freqs)
        return self.lm_head(self.norm(x_SBD), self.embedding.weight)


__all__ = ["LLAMA_CONFIGS", "LMHead", "Llama", "LlamaConfig", "TokenEmbedding", "transformer_config"]
