"""Tiny transformers Llama checkpoints shared by the HF tests (load_hf, convert --from/--to hf).

Every HF parameter is redrawn N(0, 1.6 / sqrt(hidden)) (norm weights 1 + that) so that biases and
norms are not their trivial init while the model stays well conditioned: with weights twice that
size the 256-wide grid model amplifies fp32 reordering to 1.1e-5 relative.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from jaxside.models import hf_llama

if TYPE_CHECKING:  # imported where used: a spawned rank (tests/bridge/hf_reads.py) needs no transformers
    from transformers import LlamaForCausalLM

TOLERANCE = 1e-5  # relative, fp32: both sides sum the same products in different orders
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,  # a short original context: most frequencies are rescaled
}
CASES = {
    "gqa_tied_odd_vocab": {"num_key_value_heads": 2, "tie_word_embeddings": True},
    "mha_untied_bias": {
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "mlp_bias": True,
    },
    "llama3_rope_head_dim": {
        "num_key_value_heads": 1,
        "tie_word_embeddings": False,
        "head_dim": 32,  # not hidden / heads = 16
        "rope_theta": 500000.0,
        "rope_scaling": LLAMA3,
    },
}


def hf_model(case: str, *, vocab: int = 129, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=4,
        rms_norm_eps=1e-6,
        attn_implementation="eager",
        **CASES[case],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 1.6 / hidden**0.5)  # 0.2 at hidden 64: each projection keeps the activations' scale
            if "norm" in name:
                param.add_(1.0)
    return model


def save(model: LlamaForCausalLM, directory: Path, sharded: bool) -> Path:
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="20KB" if sharded else "1GB")
    assert (directory / hf_llama.INDEX_FILE).exists() == sharded
    return directory


def random_tokens(vocab: int, batch: int = 4, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))


def reference_logits(model: LlamaForCausalLM, tokens: torch.Tensor) -> np.ndarray:
    """[B, S, V] from transformers."""
    with torch.no_grad():
        return model(tokens).logits.numpy()


def relative(ours: np.ndarray, reference: np.ndarray) -> float:
    assert ours.shape == reference.shape and not np.isnan(ours).any()
    return float(np.linalg.norm(ours - reference) / np.linalg.norm(reference))


def torch_logits(model, tokens: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        logits = model(tokens)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits.transpose(0, 1).numpy()
