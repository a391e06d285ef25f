"""The JAX/Flax twin of torchside: the same FP8 functions with JAX's own tools.

Never imports torch.
"""
