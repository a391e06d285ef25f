"""The one commit rule: a checkpoint exists only once it is complete.

Layout of a checkpoint root:

    root/step-00000100/            committed: DCP's files, checksums, shardbridge.json
    root/step-00000200.tmp/        being written, or left by a save that died (reported by `load`)

A save writes into `step-N.tmp/`; when every rank's files and DCP's `.metadata` are there, rank 0
writes `shardbridge.json` (step, extra, world size, optimizer hyperparameters, FP8 parameter facts),
syncs it and renames the directory to `step-N/` (atomic on one filesystem), then removes the oldest
committed steps beyond `keep_last`. `latest` is the committed step with the highest number. Only
this file touches directory names.

The same rule for any other output (`bridge.convert`'s targets, a file or a directory):
`stage(final)` creates the directory `.<name>.partial/` beside it exclusively (a second writer of
the same target is refused, not interleaved) and the writer fills `.<name>.partial/<name>` (with
any temporaries of its own, as Orbax's, inside the staging directory too); `publish_staged` renames
that to `final` (never over an existing path) and `discard` removes the staging directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from torchside.checkpoint import damaged

METADATA_FILE = "shardbridge.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_STAGING_DIR = re.compile(r"^step-(\d+)\.tmp$")


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def staging_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}.tmp"


def committed_steps(root: Path) -> list[int]:
    """Committed steps under `root`, oldest first."""
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def interrupted_saves(root: Path) -> list[Path]:
    """Staging directories under `root`: saves that have not finished (or died)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if _STAGING_DIR.match(p.name) and p.is_dir())


def prepare_staging(root: Path, step: int) -> Path:
    """Rank 0, before a save: an empty staging directory for `step` (a dead save's leftovers are removed)."""
    if step_dir(root, step).exists():
        raise ValueError(
            f"step {step} is already committed at {step_dir(root, step)}: save under another step, or delete it first"
        )
    staging = staging_dir(root, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def is_unfinished(path: str | os.PathLike) -> bool:
    """Whether `path` names a staging directory (`step-N.tmp`): a save that has not committed."""
    return bool(_STAGING_DIR.match(Path(path).name))


def refuse_unfinished(path: Path) -> None:
    """ValueError for a save that never committed (a `step-N.tmp` here, an Orbax temporary directory)."""
    raise ValueError(f"{path} is an unfinished save (no commit): load the root {path.parent} or a committed step")


def staging_for(final: Path) -> Path:
    """The staging directory of an output path: `.<name>.partial` beside it."""
    return final.with_name(f".{final.name}.partial")


def stage(final: Path) -> Path:
    """Create `final`'s staging directory exclusively (and missing parents); the path to write (`final`'s name inside it)."""
    staging = staging_for(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(staging)
    except FileExistsError:
        raise ValueError(
            f"{staging} exists: another process is writing {final}, or one was killed while writing it; "
            f"wait for it to finish, or delete {staging} if none is running"
        ) from None
    except OSError as error:
        raise OSError(
            error.errno, f"cannot create {staging} ({error.strerror}): write {final.name} into a directory you can write to"
        ) from error
    if os.path.lexists(final):  # checked after the exclusive create: no other writer can publish `final` now
        discard(final)
        raise ValueError(f"target {final} exists; pass a new path (it is never overwritten)")
    return staging / final.name


def publish_staged(written: Path, final: Path) -> None:
    """Move a complete output from its staging directory (`stage`) to `final`, then remove the staging directory."""
    _rename_into_place(written, final)
    os.rmdir(written.parent)


def discard(final: Path) -> None:
    """Remove `final`'s staging directory with whatever it holds (a failed or interrupted write)."""
    shutil.rmtree(staging_for(final), ignore_errors=True)


def _rename_into_place(source: Path, final: Path) -> None:
    """Rename `source` to `final` (atomic on one filesystem, never over an existing path), durably."""
    if os.path.lexists(final):
        raise ValueError(f"{final} appeared while it was being written; pass a new path")
    os.rename(source, final)
    _fsync_dir(final.parent)


def publish(root: Path, step: int, metadata: dict[str, Any], keep_last: int | None) -> Path:
    """Rank 0, after every rank's files are written: metadata, atomic rename, rotation."""
    staging = staging_dir(root, step)
    if not (staging / ".metadata").exists():
        raise RuntimeError(f"{staging} has no DCP .metadata: the save did not complete, so it is not published")
    path = staging / METADATA_FILE
    with open(path, "w") as f:
        json.dump({"format": FORMAT_VERSION, **metadata}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = step_dir(root, step)
    _rename_into_place(staging, final)
    if keep_last is not None:
        for old in committed_steps(root)[:-keep_last]:
            shutil.rmtree(step_dir(root, old))
    return final


def root_of(path: str | os.PathLike) -> Path:
    """The checkpoint root of a root, `root/latest` or `root/step-N`."""
    path = Path(path)
    is_step = _STEP_DIR.match(path.name) or _STAGING_DIR.match(path.name)
    return path.parent if path.name == "latest" or is_step else path


def resolve(path: str | os.PathLike) -> tuple[Path, Path]:
    """(checkpoint root, committed step directory) for a root, `root/latest`, or a step directory."""
    path = Path(path)
    if path.name == "latest" and not path.exists():
        path = path.parent
    if _STEP_DIR.match(path.name) and (path / METADATA_FILE).exists():
        return path.parent, path
    if _STAGING_DIR.match(path.name):
        refuse_unfinished(path)
    steps = committed_steps(path)
    if not steps:
        leftovers = ", ".join(p.name for p in interrupted_saves(path)) or "none"
        raise ValueError(
            f"no committed checkpoint under {path} (interrupted saves: {leftovers}): pass a checkpoint root "
            "written by torchside.checkpoint.save, or one of its step-N directories"
        )
    return path, step_dir(path, steps[-1])


def read_metadata(step_path: Path) -> dict[str, Any]:
    """The JSON metadata of a committed step; ValueError naming the file if it is damaged."""
    path = step_path / METADATA_FILE
    if not path.exists():
        raise ValueError(f"{step_path} has no {METADATA_FILE}: it was not committed by torchside.checkpoint.save")
    metadata = damaged.read_json_object(path)
    if metadata.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path} has format {metadata.get('format')!r}; this version reads format {FORMAT_VERSION}")
    missing = [key for key in ("step", "world_size", "param_groups", "fp8_params") if key not in metadata]
    if missing:
        raise damaged.damaged(path, f"keys {missing} are missing")
    wrong = _malformed_entries(metadata)
    if wrong:
        raise damaged.damaged(path, "; ".join(wrong))
    return metadata


def _malformed_entries(metadata: dict[str, Any]) -> list[str]:
    """What in the entries load reads is not what save writes (a hand edit, or bytes that still parse)."""
    wrong = [f"{key} is not an integer" for key in ("step", "world_size") if type(metadata[key]) is not int]
    groups = metadata["param_groups"]
    if groups is not None and not (
        isinstance(groups, list)
        and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)
        and all(isinstance(name, str) for g in groups for name in g["params"])
    ):
        wrong.append("param_groups is not null or a list of groups with a list of parameter names each")
    fp8 = metadata["fp8_params"]
    if not (isinstance(fp8, dict) and all(isinstance(facts, dict) for facts in fp8.values())):
        wrong.append("fp8_params is not an object of objects")
    return wrong


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
