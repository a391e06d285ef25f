"""Orbax checkpoints of a pytree of jax.Arrays (parameters, optimizer state, FP8 scaling state).

Layout: one Orbax `StandardCheckpointer` save per step, in `<directory>/step-<N>/`.

Atomic commit: Orbax's own. It writes the whole save into `step-<N>.orbax-checkpoint-tmp`, writes
`commit_success.txt` into it and renames it to `step-<N>` (where renaming is not atomic, as on
GCS, it writes in place and the commit file alone marks the save complete). An interrupted save
therefore leaves at most a temporary directory, which `committed_steps` and `latest_step` never
list and the next save of that step replaces; the last committed step stays loadable.

Restore always goes into an abstract target: a pytree of `jax.ShapeDtypeStruct` with a `sharding`
on every array (`abstract_target` builds one). Each device reads the byte ranges of its own shard,
so the mesh of the save does not constrain the mesh of the restore. Orbax would cast a stored
array to the target's dtype without a word; `restore` refuses instead, so FP8 bytes arrive as saved.
Saves are synchronous (this returns once the step is committed).

Checksums: `save` then writes `shardbridge_checksums.json` into the step directory, the CRC32 of
every array's row-major bytes under Orbax's name for it (the dotted tree path: dict keys, attribute
names, list indices). `bridge.convert` checks an Orbax source against it, and writes it for its Orbax targets.
The file is written after Orbax's commit (atomically, by rename): a save killed in between leaves
a committed step without it, which reads as a foreign, unverifiable checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

_STEP_NAME = re.compile(r"step-(\d+)")
CHECKSUM_FILE = "shardbridge_checksums.json"


def step_path(directory: str | os.PathLike, step: int) -> Path:
    """Where step `step` lives (committed or not)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: pass an integer >= 0")
    return Path(directory) / f"step-{step}"


def save(directory: str | os.PathLike, step: int, tree: Any) -> Path:
    """Save `tree` as step `step`, committed atomically; refuses to overwrite a committed step."""
    path = step_path(directory, step)
    if step in committed_steps(directory):
        raise ValueError(f"step {step} is already committed at {path}; save under a new step or delete it first")
    path.parent.mkdir(parents=True, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path.absolute(), tree)
        checkpointer.wait_until_finished()
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    write_checksums(path, {".".join(map(str, _plain_path(key))): _array_crc32(leaf) for key, leaf in leaves})
    return path


def _array_crc32(leaf: Any) -> int:
    """CRC32 of an array's row-major bytes as Orbax stores them (one array on the host at a time)."""
    return zlib.crc32(np.ascontiguousarray(jax.device_get(leaf)).reshape(-1).view(np.uint8))


def write_checksums(step_dir: str | os.PathLike, crcs: Mapping[str, int]) -> None:
    """Record each array's CRC32 (by Orbax name) beside the arrays, atomically (temporary file + rename)."""
    path = Path(step_dir) / CHECKSUM_FILE
    temporary = path.with_name(path.name + ".tmp")
    with open(temporary, "w") as f:
        json.dump({"crc32": {name: f"{crc:08x}" for name, crc in crcs.items()}}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(temporary, path)


def recorded_checksums(step_dir: str | os.PathLike) -> dict[str, int] | None:
    """The CRC32 of each array recorded at save time, or None for a step saved without them (foreign)."""
    path = Path(step_dir) / CHECKSUM_FILE
    if not path.exists():
        return None
    try:
        return {str(name): int(crc, 16) for name, crc in json.loads(path.read_text())["crc32"].items()}
    except (ValueError, TypeError, KeyError, AttributeError) as error:
        raise ValueError(
            f"{path} is damaged ({type(error).__name__}: {error}): restore it, or delete it to read unverified"
        ) from error


def restore(directory: str | os.PathLike, step: int, target: Any) -> Any:
    """Step `step` read into `target`'s shardings; `target` is abstract (ShapeDtypeStruct with sharding)."""
    path = step_path(directory, step)
    if step not in committed_steps(directory):
        raise ValueError(
            f"step {step} has no committed save in {directory} (committed: {committed_steps(directory)}); "
            "an interrupted save is never restored"
        )
    _check_abstract(target)
    with ocp.StandardCheckpointer() as checkpointer:
        _check_stored_dtypes(checkpointer, path, target)
        return checkpointer.restore(path.absolute(), target)


def abstract_target(tree: Any, shardings: Any) -> Any:
    """A restore target: `tree`'s shapes and dtypes with `shardings` (a tree like `tree`, or one sharding)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def committed_steps(directory: str | os.PathLike) -> list[int]:
    """Steps whose save Orbax committed, ascending; temporary directories of unfinished saves are left out."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for entry in directory.iterdir():
        match = _STEP_NAME.fullmatch(entry.name)
        if match and entry.is_dir() and ocp.step.is_path_finalized(entry):
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest committed step, or None when there is none."""
    steps = committed_steps(directory)
    return steps[-1] if steps else None


def _check_abstract(target: Any) -> None:
    for key, leaf in jax.tree_util.tree_leaves_with_path(target):
        if not isinstance(leaf, jax.ShapeDtypeStruct):
            problem = f"of type {type(leaf).__name__}, not jax.ShapeDtypeStruct"
        elif leaf.sharding is None:
            problem = "a jax.ShapeDtypeStruct without a sharding"
        else:
            continue
        raise TypeError(
            f"restore target {jax.tree_util.keystr(key)} is {problem}; pass "
            "jax.ShapeDtypeStruct(shape, dtype, sharding=...) for every array (abstract_target builds them)"
        )


def _check_stored_dtypes(checkpointer: ocp.StandardCheckpointer, path: Path, target: Any) -> None:
    """Raise if a stored array's shape or dtype differs from the target's (Orbax would cast it silently)."""
    metadata = checkpointer.metadata(path.absolute()).item_metadata.tree
    # Orbax stores containers as dicts and lists (a NamedTuple comes back as a dict): match by key names.
    stored = {_plain_path(key): saved for key, saved in jax.tree_util.tree_leaves_with_path(metadata)}
    for key, leaf in jax.tree_util.tree_leaves_with_path(target):
        saved = stored.get(_plain_path(key))
        if saved is None:
            continue  # a structure mismatch: Orbax's own error lists the keys
        if (tuple(leaf.shape), leaf.dtype) != (tuple(saved.shape), saved.dtype):
            raise ValueError(
                f"{jax.tree_util.keystr(key)} was saved as {saved.dtype}{list(saved.shape)} but the target asks for "
                f"{leaf.dtype}{list(leaf.shape)}; build the target from the saved shapes and dtypes"
            )


def _plain_path(key_path: tuple) -> tuple:
    """A key path as plain names and indices, whatever container held each level."""
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in key_path)
