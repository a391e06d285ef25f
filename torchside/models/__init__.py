"""Models built from torchside's modules: a Llama-style decoder and how to parallelize it."""

from torchside.models.llama import LLAMA_CONFIGS, Llama, LlamaConfig

__all__ = ["LLAMA_CONFIGS", "Llama", "LlamaConfig"]
