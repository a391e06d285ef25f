"""safetensors boxes: read by offsets (`safe_open(...).get_slice`), write one file by positioned writes.

File layout (the safetensors format): an 8-byte little-endian header length, a JSON header
(`{key: {dtype, shape, data_offsets}}`, `__metadata__`), padded with spaces to 8 bytes, then every
tensor's row-major bytes, back to back in header order. Every box the converter writes is a dim-0
block, so it is one contiguous byte range: process 0 writes the header and sizes the file, then each
process writes its own boxes at their offsets (`os.pwrite`), never holding more than one box.

Dtypes safetensors has no code for (`float8_e8m0fnu` scales, ...) are stored as `U8` bytes, with the
real dtype under `__metadata__["shardbridge.dtypes"]` (JSON {key: dtype}) so a read gives it back.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence

import torch

from bridge.convert_plan import Box, TensorInfo, itemsize

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


class SafetensorsReader:
    """The tensors of one .safetensors file, read a box at a time.

    The file is mapped only while a box is read: pages a read touched count as this process's
    memory for as long as the mapping lives.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        from safetensors import safe_open

        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"{self.path} is not a file; pass a .safetensors file")
        names = {code: name for name, code in CODES.items()}
        self.tensors, self.skipped = {}, []
        with safe_open(self.path, framework="pt") as file:
            real = json.loads((file.metadata() or {}).get(DTYPES_KEY, "{}"))
            for key in file.keys():
                part = file.get_slice(key)
                self.tensors[key] = TensorInfo(key, tuple(part.get_shape()), real.get(key, names[part.get_dtype()]))

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of tensor `key` (only its byte ranges are read)."""
        from safetensors import safe_open

        info = self.tensors[key]
        offsets, sizes = box
        with safe_open(self.path, framework="pt") as file:
            if not info.shape:
                values = file.get_tensor(key)
            else:
                values = file.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        return values.view(getattr(torch, info.dtype)) if CODES.get(info.dtype) is None else values


def header(tensors: Sequence[TensorInfo]) -> tuple[bytes, dict[str, int]]:
    """The file's first bytes (length + padded JSON) and each key's data offset from the end of them."""
    entries, offsets, position, real = {}, {}, 0, {}
    for info in tensors:
        code = CODES.get(info.dtype)
        if code is None:
            if itemsize(info.dtype) != 1:
                raise TypeError(f"{info.key}: dtype {info.dtype} has no safetensors code; convert to another format")
            code, real[info.key] = "U8", info.dtype
        offsets[info.key] = position
        position += info.nbytes
        entries[info.key] = {"dtype": code, "shape": list(info.shape), "data_offsets": [offsets[info.key], position]}
    entries["__metadata__"] = {"format": "pt", DTYPES_KEY: json.dumps(real)}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def write(
    path: str | os.PathLike, tensors: Sequence[TensorInfo], boxes: Sequence[tuple[TensorInfo, Box]], produce, *, first: bool, barrier
) -> None:
    """Write `tensors` into one file: the header (by the `first` process), then this process's boxes."""
    head, offsets = header(tensors)
    if first:
        with open(path, "wb") as f:
            f.write(head)
            f.truncate(len(head) + sum(t.nbytes for t in tensors))
    barrier()
    fd = os.open(path, os.O_WRONLY)
    try:
        for info, (box_offsets, sizes) in boxes:
            row_bytes = math.prod(info.shape[1:]) * itemsize(info.dtype)
            start = len(head) + offsets[info.key] + (box_offsets[0] * row_bytes if info.shape else 0)
            values = produce(info.key, (box_offsets, sizes))
            data = memoryview(values.contiguous().reshape(-1).view(torch.uint8).numpy())
            while data:
                written = os.pwrite(fd, data, start)
                data, start = data[written:], start + written
        os.fsync(fd)
    finally:
        os.close(fd)
