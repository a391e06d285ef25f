"""Optimizers for shardbridge's PyTorch frontend: FusedAdam (multi-tensor Triton Adam/AdamW)."""

from torchside.optim.fused_adam import FusedAdam

__all__ = ["FusedAdam"]
