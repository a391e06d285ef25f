"""Distributed checkpoints: DCP save/load into any topology, async saves, atomic commits, safetensors.

- `save(dir, model, optimizer, step=..., async_mode=None|"thread"|"process", keep_last=...)` writes
  `dir/step-N/` atomically (`commit`) from a tensors-only `AppState` (`app_state`); FP8 parameters
  travel as their raw buffers (`quantized_params`), shard files carry CRC32s (`checksums`).
- `load(dir | dir/latest | dir/step-N, model, optimizer)` checks, loads into fresh tensors, swaps.
- `export_safetensors` / `import_safetensors` (`safetensors_io`): a portable copy of the weights.

Docs: docs/checkpoints.md.
"""

from torchside.checkpoint.app_state import AppState
from torchside.checkpoint.load import LoadResult, load
from torchside.checkpoint.save import SaveHandle, save

__all__ = ["AppState", "LoadResult", "SaveHandle", "load", "save"]
