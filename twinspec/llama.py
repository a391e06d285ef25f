"""`LlamaConfig`: the sizes and options of the Llama-style decoder, shared by its torch and JAX builds.

Framework-free (Python and the standard library only): torchside.models.llama and
jaxside.models.llama both build from it.

Options real Llama-family checkpoints need (Hugging Face `config.json` names in brackets):
`head_dim` [head_dim] when it is not hidden_size / num_heads; `tie_word_embeddings`
[tie_word_embeddings]: the head multiplies by the embedding's weight, else it has its own
`lm_head.weight`; `rope_theta` and `rope_scaling` [rope_theta, rope_scaling or rope_parameters]
of type "llama3" (`RopeScaling`); `norm_eps` [rms_norm_eps]; `bias` [attention_bias and
mlp_bias, which must agree: our TransformerConfig has one `bias` for every projection].
`glu_interleave` is not HF's: it is our fc1 layout (gate and up rows alternate in runs of that
many rows; 128 keeps 128x128 block-scaled FP8 gate/up weights byte for byte, docs/hf.md).

Vocabulary padding: a vocabulary split over devices must divide evenly (torch's TP splits the
embedding rows; JAX refuses uneven dims), so the models hold `padded_vocab_size(tp)` rows, the
vocabulary rounded up to a multiple of lcm(`vocab_multiple`, tp). The extra rows are zeros when
loaded from a checkpoint and the logits of those ids are sliced off: the models return logits
over `vocab_size` ids only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's rotary frequency scaling ("llama3" rope_type): long wavelengths slowed by `factor`, smoothly."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self) -> None:
        if not self.factor > 0 or not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"{self}: need factor > 0 and 0 < low_freq_factor < high_freq_factor (Llama 3.1: 8, 1, 4)"
            )
        if self.original_max_position_embeddings < 1:
            raise ValueError(f"{self}: original_max_position_embeddings must be >= 1 (Llama 3.1: 8192)")

    def scale(self, inv_freq, where):
        """inv_freq (a torch or JAX fp32 array) scaled as Llama 3 does; `where` is torch.where or jnp.where.

        Written with arithmetic operators and `where` only, so that both frameworks run the same fp32 steps.
        """
        low_freq_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_freq_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        wavelen = (2 * math.pi) / inv_freq
        slowed = where(wavelen > low_freq_wavelen, inv_freq / self.factor, inv_freq)
        smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        smoothed = (1 - smooth) * slowed / self.factor + smooth * slowed
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return where(medium, smoothed, slowed)


_SIZES = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size", "vocab_multiple",
          "glu_interleave")  # fmt: skip


@dataclass(frozen=True)
class LlamaConfig:
    """Model sizes and options (module docstring); `head_dim` None means hidden_size / num_heads."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02  # normal init of every weight; output projections get init_std / sqrt(2 * num_layers)
    head_dim: int | None = None
    tie_word_embeddings: bool = True
    rope_scaling: RopeScaling | None = None
    bias: bool = False  # a bias on every projection (q, k, v, o, gate, up, down)
    vocab_multiple: int = 1  # the padded vocabulary is a multiple of lcm(this, tp): module docstring
    glu_interleave: int = 1  # fc1's gate and up rows alternate in runs of this many (the modules' LayerNormMLP)

    def __post_init__(self) -> None:
        for name in _SIZES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig({name}={value!r}): pass an integer >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig(num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}): num_heads must be a "
                "multiple of num_kv_heads"
            )
        if self.ffn_hidden_size % self.glu_interleave:
            raise ValueError(
                f"LlamaConfig(ffn_hidden_size={self.ffn_hidden_size}, glu_interleave={self.glu_interleave}): "
                "ffn_hidden_size must be a multiple of glu_interleave (fc1 holds whole runs of gate and up rows)"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_heads:
                raise ValueError(
                    f"LlamaConfig(hidden_size={self.hidden_size}, num_heads={self.num_heads}): hidden_size must be a "
                    "multiple of num_heads, or pass head_dim"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        elif isinstance(self.head_dim, bool) or not isinstance(self.head_dim, int) or self.head_dim < 2:
            raise ValueError(f"LlamaConfig(head_dim={self.head_dim!r}): pass an integer >= 2, or None")
        for name in ("tie_word_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LlamaConfig({name}={getattr(self, name)!r}): pass True or False")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise TypeError(f"LlamaConfig(rope_scaling={self.rope_scaling!r}): pass a RopeScaling or None")

    def padded_vocab_size(self, tp: int = 1) -> int:
        """Rows of the embedding (and head) when TP splits them `tp` ways: module docstring."""
        multiple = math.lcm(self.vocab_multiple, tp)
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Parameter count without padding (a tied head counted once)."""
        d, h, f = self.hidden_size, self.head_dim, self.ffn_hidden_size
        q, kv = self.num_heads * h, self.num_kv_heads * h
        attention = d * (q + 2 * kv) + q * d + d  # QKV, output projection, input norm
        mlp = d * 2 * f + f * d + d  # fc1 (gate, up), fc2, norm
        if self.bias:
            attention, mlp = attention + q + 2 * kv + d, mlp + 2 * f + d
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + self.num_layers * (attention + mlp) + d


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

__all__ = ["LLAMA_CONFIGS", "LlamaConfig", "RopeScaling"]
