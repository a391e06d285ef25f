"""Reading a checkpoint's own small files (DCP `.metadata`, `shardbridge.json`, checksum JSON) safely.

A flipped or truncated byte in one of them makes its decoder fail with whatever error the bytes
lead to (UnpicklingError, EOFError, MemoryError, JSONDecodeError, AttributeError, ...), none of
which says which file is bad. `decode_file` turns every such failure into one ValueError that names
the file and the fix. OSError (a missing or unreadable file) passes through: it names the path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

FIX = "restore the file from a copy, or load another step of this checkpoint (pass root/step-N)"


def damaged(path: Path, why: str) -> ValueError:
    """The error for a checkpoint file that exists but cannot be what its writer wrote."""
    return ValueError(f"{path} is damaged ({why}): {FIX}")


def decode_file(path: Path, decode: Callable[[], T]) -> T:
    """`decode()`, which reads `path`; any decoding failure becomes `damaged(path, ...)`."""
    try:
        return decode()
    except OSError:
        raise
    except Exception as error:  # a corrupt file can make a decoder raise anything
        raise damaged(path, f"{type(error).__name__}: {error}") from error


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object (dict) stored in `path`; ValueError naming the file when it is not one."""
    value = decode_file(path, lambda: json.loads(path.read_bytes()))
    if not isinstance(value, dict):
        raise damaged(path, f"a JSON object was expected, found {type(value).__name__}")
    return value
