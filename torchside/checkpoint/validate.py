"""Checks before a load touches anything: the checkpoint fits the model, and its files are intact.

DCP would fail on a wrong model deep inside its planner, on one key at a time, or load a truncated
or corrupted shard silently; here every mismatched key is listed at once and a bad file is named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from torchside.checkpoint import checksums

_LISTED = 200  # mismatches shown in an error message


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Tensor]:
    """`{"model": {"w": t}}` -> `{"model.w": t}`, DCP's key for each tensor."""
    flat = {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def read_dcp_metadata(step_path: Path) -> Metadata:
    if not (step_path / ".metadata").exists():
        raise ValueError(f"{step_path / '.metadata'} is missing: this is not a complete DCP checkpoint")
    return FileSystemReader(str(step_path)).read_metadata()


def check_fits(step_path: Path, metadata: Metadata, target: dict[str, Any]) -> None:
    """ValueError listing every key the model and the checkpoint disagree on (name, shape, dtype)."""
    saved = metadata.state_dict_metadata
    wanted = flatten(target)
    missing = sorted(k for k in wanted if k not in saved)
    unexpected = sorted(k for k in saved if k not in wanted and not k.startswith("rng."))
    problems = [f"missing from the checkpoint: {k}" for k in missing]
    problems += [f"not in the model: {k}" for k in unexpected]
    for key in sorted(set(wanted) & set(saved)):
        entry, tensor = saved[key], wanted[key]
        if not isinstance(entry, TensorStorageMetadata):
            problems.append(f"{key}: saved as bytes, expected a tensor")
        elif tuple(entry.size) != tuple(tensor.shape):
            problems.append(f"{key}: shape {tuple(entry.size)} in the checkpoint, {tuple(tensor.shape)} in the model")
        elif entry.properties.dtype != tensor.dtype:
            problems.append(f"{key}: dtype {entry.properties.dtype} in the checkpoint, {tensor.dtype} in the model")
    if problems:
        shown = "\n  ".join(problems[:_LISTED])
        more = f"\n  ... and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
        raise ValueError(
            f"checkpoint {step_path} does not fit this model ({len(problems)} mismatched keys):\n  {shown}{more}\n"
            "Build the model (and optimizer, FP8 parameters, recipe) as it was when saved."
        )


def check_files(step_path: Path, metadata: Metadata, group: dist.ProcessGroup | None) -> None:
    """ValueError naming the first shard file that is missing, truncated or corrupted."""
    referenced = [info.relative_path for info in metadata.storage_data.values()]
    bad = checksums.first_bad_file(step_path, referenced, group)
    if bad is not None:
        raise ValueError(f"checkpoint shard {bad}; the model is unchanged. Load an earlier step instead")
