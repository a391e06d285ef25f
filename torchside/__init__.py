"""The PyTorch frontend: FP8 recipes, quantized tensors and TransformerEngine-style modules.

Never imports jax.
"""
