"""Optimizers for shardbridge's PyTorch frontend: FusedAdam (multi-tensor Triton Adam/AdamW), FP8-weight hooks."""

from torchside.optim.fp8_weights import requantize_fp8_weights
from torchside.optim.fused_adam import FusedAdam

__all__ = ["FusedAdam", "requantize_fp8_weights"]
