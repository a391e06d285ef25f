"""Models built from jaxside's modules: `jaxside.models.llama`, the Llama decoder (torchside.models.llama's twin).

Imports nothing, on purpose: `llama_config` and `hf_llama` are framework-free and torchside imports
them, which must not load JAX (tests/test_imports.py). Import `jaxside.models.llama` for the model.
"""
