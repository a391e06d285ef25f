"""Tiny transformers Llama checkpoints shared by the HF tests (load_hf, convert --from/--to hf).

Every HF parameter is redrawn N(0, 1.6 / sqrt(hidden)) (norm weights 1 + that) so that biases and
norms are not their trivial init while the model stays well conditioned: with weights twice that
size the 256-wide grid model amplifies fp32 reordering to 1.1e-5 relative.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from twinspec import hf_llama

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


def torch_logits(model, tokens: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        logits = model(tokens)
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits.transpose(0, 1).numpy()


# ---- FP8 block-scaled checkpoints (DeepSeek-V3's / transformers' FineGrainedFP8 format)

FP8_QUANTIZATION = {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e4m3"}
E4M3_MAX = 448.0


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, fp32 scale_inv [ceil(out/128), ceil(in/128)]) of a weight, each 128x128 block scaled by its amax."""
    w64 = weight.double()
    rows, cols = (-(-n // 128) for n in w64.shape)
    scale_inv = torch.empty(rows, cols, dtype=torch.float32)
    data = torch.empty(w64.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            block = w64[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            scale_inv[i, j] = max(block.abs().max().item(), 1e-30) / E4M3_MAX
            data[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / scale_inv[i, j].double()).float()
    return data, scale_inv


def dequantize_blocks(data: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """float64 values of E4M3 bytes times their block's scale_inv (the format's definition)."""
    scale = scale_inv.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return data.double() * scale[: data.shape[0], : data.shape[1]]


def fp8_hf_checkpoint(
    directory: Path, sharded: bool = False, **overrides
) -> tuple[Path, LlamaForCausalLM, dict[str, torch.Tensor]]:
    """A tiny FP8 block-scaled Llama directory, its files written by transformers' own `save_pretrained`.

    Returns (directory, transformers' fp32 model holding the dequantized weights, the tensors written).
    The projection weights are F8_E4M3 + fp32 weight_scale_inv; the embedding and norms bf16.
    """
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    settings = {"hidden_size": 256, "head_dim": 128, "num_attention_heads": 2, "num_key_value_heads": 1,
                "intermediate_size": 256, "tie_word_embeddings": False} | overrides  # fmt: skip
    config = HFConfig(vocab_size=160, num_hidden_layers=2, rms_norm_eps=1e-6, attn_implementation="eager", **settings)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    stored = copy.deepcopy(model)  # holds the stored tensors, as transformers' FP8Linear would
    tensors = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 1.6 / config.hidden_size**0.5)
            if "norm" in name:
                param.add_(1.0)
            module, _, kind = name.rpartition(".")
            if name.endswith("_proj.weight"):
                data, scale_inv = quantize_blocks(param)
                tensors[name], tensors[name + "_scale_inv"] = data, scale_inv
                param.copy_(dequantize_blocks(data, scale_inv))  # exact in fp32: an E4M3 value times an fp32 scale
                linear = stored.get_submodule(module)
                linear.weight = torch.nn.Parameter(data, requires_grad=False)
                linear.register_parameter("weight_scale_inv", torch.nn.Parameter(scale_inv, requires_grad=False))
            else:
                tensors[name] = param.to(torch.bfloat16)
                param.copy_(tensors[name])
                setattr(stored.get_submodule(module), kind, torch.nn.Parameter(tensors[name], requires_grad=False))
    save(stored, directory, sharded)
    hf_config = json.loads((directory / hf_llama.CONFIG_FILE).read_text())
    (directory / hf_llama.CONFIG_FILE).write_text(json.dumps(hf_config | {"quantization_config": FP8_QUANTIZATION}))
    return directory, model, tensors


FP8_DEFECTS = ["missing weight_scale_inv", "wrong scale shape", "weight_block_size", "fmt"]


def break_fp8(directory: Path, defect: str) -> tuple[str, ...]:
    """Give an FP8 checkpoint (of `fp8_hf_checkpoint`) one defect of FP8_DEFECTS; the words its error must hold."""
    from safetensors.torch import load_file, save_file

    scale = "model.layers.1.mlp.up_proj.weight_scale_inv"
    index = directory / hf_llama.INDEX_FILE
    name = json.loads(index.read_text())["weight_map"][scale] if index.exists() else hf_llama.SINGLE_FILE
    file, config_path = directory / name, directory / "config.json"
    config = json.loads(config_path.read_text())
    tensors = load_file(file)
    if defect == "missing weight_scale_inv":
        save_file({k: v for k, v in tensors.items() if k != scale}, file, metadata={"format": "pt"})
        return str(directory), scale
    if defect == "wrong scale shape":
        save_file(tensors | {scale: tensors[scale][:1]}, file, metadata={"format": "pt"})
        return file.name, scale, "[1, 2]"
    edits = {"weight_block_size": {"weight_block_size": [1, 128]}, "fmt": {"fmt": "e5m2"}}
    config["quantization_config"] = config["quantization_config"] | edits[defect]
    config_path.write_text(json.dumps(config))
    return "config.json", "[1, 128]" if defect == "weight_block_size" else "e5m2"


def our_rows(source: hf_llama.Source, config, total_rows: int) -> dict[str, list[int]]:
    """For each HF tensor of `source`, the rows of our full tensor it is made of (row_pieces, read backwards)."""
    rows: dict[str, list[int]] = {name: [] for name in source.hf_names}
    for piece in hf_llama.row_pieces(source, config, 0, total_rows):
        if piece.hf_name is not None:
            count = piece.stop - piece.start
            rows[piece.hf_name] += range(piece.dest, piece.dest + count * piece.step, piece.step)
    return rows
