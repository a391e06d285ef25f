"""What a converted checkpoint says about what it holds, beyond its tensors' names, shapes and dtypes.

The tensors alone do not say how to read some of them:

- `fp8_params`: per FP8 parameter (its fqn, as the target names it), the facts torchside's
  `shardbridge.json` records (torchside.checkpoint.quantized_params.describe: scheme, fmt,
  hadamard, shape, dtype, buffers): the buffers are raw uint8 bytes and fp32 scales;
- `glu_interleave`: the run length w of a gated fc1's gate and up rows (LlamaConfig.glu_interleave);
  absent means 1, the layout every checkpoint had before it existed.
- `hf_files`: {file name: its text} of a Hugging Face source's `config.json` and, when it has one,
  `generation_config.json` (bridge.convert.hf.CARRIED_FILES), so that `--to hf` writes them back
  without `--config` (which still wins).

A reader has `facts` (from a torchside save's shardbridge.json, a converted DCP or Orbax directory's
FACTS_FILE, a converted safetensors file's header under FACTS_KEY, or an HF directory's own
quantization and config files); the converter hands them, renamed for the target, to the writer, which records them
the same way. A writer that needs one (an HF target: w and the FP8 format) refuses what does not fit.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchside.checkpoint import damaged

FACTS_FILE = "shardbridge.facts.json"  # in a converted DCP or Orbax directory
FACTS_KEY = "shardbridge.facts"  # in a converted safetensors file's header metadata


def glu_interleave(facts: Mapping[str, Any]) -> int:
    """The checkpoint's fc1 run length (1 when not recorded); ValueError if its modules disagree."""
    w = facts.get("glu_interleave", 1)
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(
            f"the checkpoint records glu_interleave={w!r}: its fc1 layers differ, so no one layout splits them"
        )
    return w


def read_file(directory: Path) -> dict[str, Any]:
    """The facts recorded in `directory` (none: {}); ValueError naming the file if it is not JSON."""
    path = Path(directory) / FACTS_FILE
    return damaged.read_json_object(path) if path.is_file() else {}


def write_file(directory: Path, facts: Mapping[str, Any]) -> None:
    if facts:
        (Path(directory) / FACTS_FILE).write_text(json.dumps(dict(facts), indent=2, sort_keys=True) + "\n")


def renamed(facts: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`facts` with each FP8 parameter under its target name (`names`: source fqn -> target fqn)."""
    fp8 = {names[fqn]: value for fqn, value in facts.get("fp8_params", {}).items() if fqn in names}
    return {**facts, "fp8_params": fp8} if fp8 else {k: v for k, v in facts.items() if k != "fp8_params"}


__all__ = ["FACTS_FILE", "FACTS_KEY", "glu_interleave", "read_file", "renamed", "write_file"]
