"""Models built from jaxside's modules: `jaxside.models.llama`, the Llama decoder (torchside.models.llama's twin)."""
