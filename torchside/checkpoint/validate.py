"""Checks before a load touches anything: the checkpoint fits the model, and its files are intact.

DCP would fail on a wrong model deep inside its planner, on one key at a time, or load a truncated
or corrupted shard silently; here every difference is listed at once (keys, shapes, dtypes, FP8
scheme and format, optimizer param groups) and a bad file is named. DCP's `.metadata` is a pickle
without a checksum of its own: its size and CRC32 go into `shardbridge.json` at commit (under
DCP_METADATA_CHECKSUM) and are checked before it is unpickled; a checkpoint saved before that is
checked for the structure DCP relies on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from torchside.checkpoint import checksums, damaged

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


DCP_METADATA_CHECKSUM = "dcp_metadata_checksum"  # shardbridge.json's [size, crc32] of `.metadata`
FP8_FACTS = ("scheme", "fmt", "hadamard")  # what an FP8 parameter's buffers do not say by their shapes


def read_dcp_metadata(step_path: Path, recorded: list[int] | None = None) -> Metadata:
    """DCP's `.metadata` of a step, checked against its `recorded` [size, crc32] when given (it is a
    pickle: a flipped byte could otherwise point reads at the wrong bytes); ValueError naming the file."""
    path = step_path / ".metadata"
    if not path.exists():
        raise ValueError(f"{path} is missing: this is not a complete DCP checkpoint; {damaged.FIX}")
    if recorded is not None and list(checksums.file_checksum(path)) != list(recorded):
        raise damaged.damaged(path, f"size and CRC32 differ from the ones recorded in {step_path / 'shardbridge.json'}")
    return damaged.decode_file(path, lambda: _well_formed(FileSystemReader(str(step_path)).read_metadata()))


def _well_formed(metadata: Any) -> Metadata:
    """`metadata` if every entry has the fields and types DCP will use (a flipped byte can unpickle into
    an object without them); else TypeError."""
    if not isinstance(metadata, Metadata):
        raise TypeError(f"it unpickles to a {type(metadata).__name__}, not DCP Metadata")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or not isinstance(entry, TensorStorageMetadata | BytesStorageMetadata):
            raise TypeError(f"entry {key!r} is a {type(entry).__name__}")
        if isinstance(entry, TensorStorageMetadata):
            sizes = [torch.Size(entry.size), *(torch.Size(c.offsets) + torch.Size(c.sizes) for c in entry.chunks)]
            if not isinstance(entry.properties.dtype, torch.dtype) or min(min(s, default=0) for s in sizes) < 0:
                raise TypeError(f"entry {key!r} has a dtype {entry.properties.dtype!r} or a negative size")
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info.relative_path, str):
            raise TypeError(f"storage entry {index!r} is not a (MetadataIndex, file) pair")
        if int(info.offset) < 0 or int(info.length) < 0:
            raise TypeError(f"storage entry {index.fqn!r} has a negative offset or length")
    return metadata


def check_fits(
    step_path: Path,
    metadata: Metadata,
    target: dict[str, Any],
    *,
    fp8_params: tuple[dict[str, dict], dict[str, dict]] = ({}, {}),
    param_groups: tuple[list[dict] | None, list[dict] | None] = (None, None),
    layouts: tuple[dict, dict] = ({}, {}),
) -> None:
    """ValueError listing everything the model and the checkpoint disagree on: keys, shapes, dtypes,
    FP8 parameters' scheme and format (`fp8_params`: saved, live `quantized_params.describe`s) and the
    optimizer's param groups (`param_groups`: saved, live; parameters by FQN) and fc1's layout
    (`layouts`: saved, live `glu_interleave`s)."""
    problems = _param_group_problems(*param_groups) + _fp8_problems(*fp8_params)
    if layouts[0].get("glu_interleave", 1) != layouts[1].get("glu_interleave", 1):  # same shapes, other rows
        was, now = (layout.get("glu_interleave", 1) for layout in layouts)
        problems.append(f"fc1 gate/up rows in runs of {was} (glu_interleave) in the checkpoint, {now} in the model")
    problems += _key_problems(metadata.state_dict_metadata, flatten(target))
    if problems:
        shown = "\n  ".join(problems[:_LISTED])
        more = f"\n  ... and {len(problems) - _LISTED} more" if len(problems) > _LISTED else ""
        raise ValueError(
            f"checkpoint {step_path} does not fit this model ({len(problems)} differences):\n  {shown}{more}\n"
            "Build the model (and optimizer with its param groups, FP8 parameters, recipe) as it was when saved."
        )


def glu_interleave(model: nn.Module) -> dict:
    """{"glu_interleave": w} when the gated fc1s have runs of w != 1 gate and up rows (a list if they differ), else {}.

    Saved in shardbridge.json: the shapes do not show it, and a converter splits fc1 into gate and up by it.
    """
    runs = sorted({m.glu_interleave for m in model.modules() if hasattr(m, "glu_interleave")})
    if runs in ([], [1]):
        return {}  # the layout every checkpoint had before glu_interleave existed
    return {"glu_interleave": runs[0] if len(runs) == 1 else runs}


def _key_problems(saved: dict[str, Any], wanted: dict[str, Tensor]) -> list[str]:
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
    return problems


def _fp8_problems(saved: dict[str, dict], live: dict[str, dict]) -> list[str]:
    """Same buffers can hold different numbers (E4M3 or E5M2 bytes, with or without a Hadamard transform)."""
    problems = []
    for fqn in sorted(set(saved) & set(live)):
        was, now = ({k: facts.get(k) for k in FP8_FACTS} for facts in (saved[fqn], live[fqn]))
        if was != now:
            problems.append(f"{fqn}: FP8 {was} in the checkpoint, {now} in the model")
    return problems


def _param_group_problems(saved: list[dict] | None, live: list[dict] | None) -> list[str]:
    """The optimizer must group the same parameters (by FQN) as the one that saved, in the same order."""
    if live is None:
        return []
    if saved is None:
        return ["the checkpoint holds no optimizer state: load it with optimizer=None"]
    saved_params, live_params = ([set(group["params"]) for group in groups] for groups in (saved, live))
    if saved_params == live_params:
        return []
    sizes = ", ".join(str(len(params)) for params in saved_params), ", ".join(str(len(p)) for p in live_params)
    problems = [
        f"optimizer param groups: {len(saved)} in the checkpoint (sizes {sizes[0]}), "
        f"{len(live)} in the optimizer (sizes {sizes[1]})"
    ]
    for index, (was, now) in enumerate(zip(saved_params, live_params)):
        if was != now:
            moved = sorted(was ^ now)
            problems.append(f"optimizer param group {index} differs in {len(moved)} parameters, e.g. {moved[0]}")
    return problems


def check_files(step_path: Path, metadata: Metadata, group: dist.ProcessGroup | None) -> None:
    """ValueError naming the first shard file that is missing, truncated or corrupted."""
    referenced = [info.relative_path for info in metadata.storage_data.values()]
    bad = checksums.first_bad_file(step_path, referenced, group)
    if bad is not None:
        raise ValueError(f"checkpoint shard {bad}; the model is unchanged. Load an earlier step instead")
