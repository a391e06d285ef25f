"""One safetensors file written by positioned writes: the low-level half of our safetensors dialect.

The format: an 8-byte little-endian header length, a JSON header `{key: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}` padded with spaces to a multiple of 8 bytes, then every
tensor's row-major bytes back to back in header order. Because the layout follows from keys,
dtypes and shapes alone, one process writes the header and sizes the file, then any process writes
any byte range of it (`write_at`), never holding more than the range it writes.

What we add under `__metadata__` (docs/checkpoints.md):
- `shardbridge.dtypes`: JSON {key: torch dtype name} for 1-byte dtypes safetensors has no code for
  (`float8_e8m0fnu` scales), stored as `U8`; a reader gives the real dtype back.
- `shardbridge.crc32`: JSON {key: 8 hex digits}, the CRC32 of each tensor's bytes. The header is
  written first with zeros there and rewritten in place once every tensor is written
  (`record_checksums`; fixed-width digits keep its length). A file without it is foreign: readable,
  not verifiable.
"""

from __future__ import annotations

import json
import math
import os
import struct
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

CODES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
DTYPES_KEY = "shardbridge.dtypes"
CRC_KEY = "shardbridge.crc32"
_CHUNK = 16 << 20

TensorSpec = tuple[str, str, tuple[int, ...]]  # (key, torch dtype name, shape)


def itemsize(dtype: str) -> int:
    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class Layout:
    """Where everything lies in one file: the header's entries and metadata, each tensor's first byte."""

    entries: dict[str, dict]
    metadata: dict[str, str]
    offsets: dict[str, int]  # absolute file offset of each tensor's bytes

    def header(self, crcs: Mapping[str, int] | None = None) -> bytes:
        """The file's first bytes; the CRC32 table holds `crcs` (zeros until they are known)."""
        table = {key: f"{(crcs or {}).get(key, 0):08x}" for key in self.entries}
        metadata = {**self.metadata, CRC_KEY: json.dumps(table, separators=(",", ":"))}
        text = json.dumps({**self.entries, "__metadata__": metadata}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
        return struct.pack("<Q", len(text)) + text

    @property
    def size(self) -> int:
        return len(self.header()) + sum(e["data_offsets"][1] - e["data_offsets"][0] for e in self.entries.values())


def layout(tensors: Sequence[TensorSpec], metadata: Mapping[str, str]) -> Layout:
    """The layout of a file holding `tensors` in this order, with `metadata` in its header."""
    entries, real, position = {}, {}, 0
    for key, dtype, shape in tensors:
        code = CODES.get(dtype)
        if code is None:
            if itemsize(dtype) != 1:
                raise TypeError(f"{key}: dtype {dtype} has no safetensors code; convert to another format")
            code, real[key] = "U8", dtype
        nbytes = math.prod(shape) * itemsize(dtype)
        entries[key] = {"dtype": code, "shape": list(shape), "data_offsets": [position, position + nbytes]}
        position += nbytes
    partial = Layout(entries, {**metadata, DTYPES_KEY: json.dumps(real)}, {})
    start = len(partial.header())
    offsets = {key: start + entry["data_offsets"][0] for key, entry in entries.items()}
    return Layout(entries, partial.metadata, offsets)


def create(path: str | os.PathLike, file_layout: Layout) -> None:
    """Write the header (zero CRCs) and size the file; the tensors' bytes follow by `write_at`."""
    with open(path, "r+b" if os.path.exists(path) else "wb") as f:
        f.write(file_layout.header())
        f.truncate(file_layout.size)


def write_at(fd: int, offset: int, values: torch.Tensor, crc: int = 0) -> int:
    """Write a CPU tensor's bytes at `offset` (retrying short writes); their CRC32, continuing `crc`, the CRC32
    of the bytes before them (a tensor written in pieces, in order)."""
    data = memoryview(values.contiguous().reshape(-1).view(torch.uint8).numpy())
    crc = zlib.crc32(data, crc)
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
    return crc


def record_checksums(path: str | os.PathLike, file_layout: Layout, crcs: Mapping[str, int]) -> None:
    """Rewrite the header in place with every tensor's CRC32, and sync the file."""
    missing = sorted(set(file_layout.entries) - set(crcs))
    if missing:
        raise RuntimeError(f"{path}: no CRC32 for {', '.join(missing)}; every tensor must be written first")
    fd = os.open(path, os.O_WRONLY)
    try:
        os.pwrite(fd, file_layout.header(crcs), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Header:
    """A safetensors file's header as read: entries, metadata, where the data starts."""

    path: Path
    entries: dict[str, dict]
    metadata: dict[str, str]
    data_start: int

    def dtype(self, key: str) -> str:
        """The torch dtype name of `key` (the real one for a U8-stored dtype)."""
        real = json.loads(self.metadata.get(DTYPES_KEY, "{}"))
        names = {code: name for name, code in CODES.items()}
        return real.get(key, names.get(self.entries[key]["dtype"], self.entries[key]["dtype"]))

    def recorded_crcs(self) -> dict[str, int] | None:
        """The recorded CRC32 of each tensor, or None for a file written without a table."""
        if CRC_KEY not in self.metadata:
            return None
        try:
            return {key: int(value, 16) for key, value in json.loads(self.metadata[CRC_KEY]).items()}
        except (ValueError, TypeError, AttributeError) as error:
            raise ValueError(f"{self.path}: its CRC32 table ({CRC_KEY}) is damaged ({error}); restore the file") from error

    def crc_of(self, key: str) -> int:
        """CRC32 of `key`'s bytes as they are in the file now (read in chunks)."""
        first, last = self.entries[key]["data_offsets"]
        crc, position = 0, self.data_start + first
        with open(self.path, "rb") as f:
            f.seek(position)
            remaining = last - first
            while remaining:
                chunk = f.read(min(_CHUNK, remaining))
                if not chunk:
                    raise ValueError(f"{self.path} ends inside tensor {key}: the file is truncated; restore it")
                crc, remaining = zlib.crc32(chunk, crc), remaining - len(chunk)
        return crc


def read_header(path: str | os.PathLike) -> Header:
    """The header of a safetensors file; ValueError naming the file when it is not one."""
    path = Path(path)
    fix = "pass an intact .safetensors file (truncated or not safetensors?)"
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file ({len(head)} bytes): {fix}")
        (length,) = struct.unpack("<Q", head)
        size = os.fstat(f.fileno()).st_size
        if length > size - 8:
            raise ValueError(f"{path} is not a safetensors file (header of {length} bytes in a {size}-byte file): {fix}")
        try:
            entries = json.loads(f.read(length))
            metadata = entries.pop("__metadata__", None) or {}
            ends = [entry["data_offsets"][1] for entry in entries.values()]
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise ValueError(f"{path} has no valid safetensors header ({error}): {fix}") from error
    if max(ends, default=0) > size - 8 - length:
        raise ValueError(f"{path} is truncated ({size} bytes, its header needs {8 + length + max(ends)}): {fix}")
    return Header(path, entries, metadata, 8 + length)
