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
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

_STEP_NAME = re.compile(r"step-(\d+)")


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
    return path


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
