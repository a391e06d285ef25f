"""Per-file CRC32 checksums: written beside DCP's shard files, checked before a load reads them.

DCP records where each tensor lies in which file but not whether the bytes are intact; a truncated
or corrupted shard would load silently (or fail deep inside torch.load). Each rank's writer, once its
files are written and synced, records `{file: [size, crc32]}` in `<prefix>checksums.json` (prefix
`__<rank>_`, DCP's own file prefix). It happens inside `write_data`, before DCP's coordinator
writes `.metadata`, so a checkpoint with metadata has all its checksum files.

Also the CRC32 arithmetic the other checksummed formats share (safetensors header tables, Orbax
checksum files, bridge.convert): the CRC32 of a tensor's bytes, and `crc32_combine` to join the
CRCs of consecutive byte ranges written by different boxes or processes.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.futures import Future

from torchside.checkpoint import damaged

SUFFIX = "checksums.json"
_CHUNK = 16 << 20


def file_checksum(path: Path) -> tuple[int, int]:
    """(size in bytes, CRC32) of a file, read in chunks."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return size, crc


def tensor_crc32(tensor: torch.Tensor) -> int:
    """CRC32 of a CPU tensor's bytes in row-major order."""
    return zlib.crc32(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _advance(register: int) -> int:
    """The CRC32 register after one more zero bit (reflected polynomial 0xEDB88320)."""
    return (register >> 1) ^ (0xEDB88320 if register & 1 else 0)


def _apply(operator: list[int], register: int) -> int:
    """A linear map on 32-bit registers (operator[i] = image of bit i) applied to `register`."""
    out, bit = 0, 0
    while register:
        if register & 1:
            out ^= operator[bit]
        register >>= 1
        bit += 1
    return out


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """CRC32 of A + B from CRC32(A), CRC32(B) and len(B), without the bytes.

    Appending zero bytes acts linearly on the register (the initial and final inversions cancel
    between A + B and B alone), so CRC(A + B) = Z^len(B)(CRC(A)) ^ CRC(B), with Z the one-zero-byte
    operator; Z^n is built by repeated squaring.
    """
    operator = [_apply_bits(1 << bit, 8) for bit in range(32)]  # one zero byte
    while length_b:
        if length_b & 1:
            crc_a = _apply(operator, crc_a)
        length_b >>= 1
        if length_b:
            operator = [_apply(operator, image) for image in operator]
    return crc_a ^ crc_b


def _apply_bits(register: int, bits: int) -> int:
    for _ in range(bits):
        register = _advance(register)
    return register


class ChecksummedWriter(FileSystemWriter):
    """DCP's file writer, plus a checksum file per rank (see the module docstring)."""

    def write_data(self, plan, planner) -> Future:
        results = super().write_data(plan, planner).wait()
        files = sorted({r.storage_data.relative_path for r in results})
        directory = Path(self.path)
        sums = {name: list(file_checksum(directory / name)) for name in files}
        target = directory / f"{plan.storage_data.prefix}{SUFFIX}"
        with open(target, "w") as f:
            json.dump(sums, f)
            f.flush()
            os.fsync(f.fileno())
        done: Future = Future()
        done.set_result(results)
        return done


def recorded(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file's recorded (size, crc32) in a checkpoint directory; ValueError naming a damaged checksum file."""
    sums: dict[str, tuple[int, int]] = {}
    for path in sorted(directory.glob(f"*{SUFFIX}")):
        for name, entry in damaged.read_json_object(path).items():
            if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int for v in entry)):
                raise damaged.damaged(path, f"the entry of {name!r} is {entry!r}, not [size, crc32]")
            sums[name] = tuple(entry)
    return sums


def first_bad_file(directory: Path, referenced: list[str], group: dist.ProcessGroup | None) -> str | None:
    """The first file (in sorted order) that is missing, unrecorded, truncated or corrupted, else None.

    The ranks split the files between them (rank r reads files r, r + W, ...) and agree on the
    first bad one with one all-reduce, so every rank raises the same error.
    """
    sums = recorded(directory)
    names = sorted(set(referenced))
    use_dist = dist.is_initialized()
    rank, world = (dist.get_rank(group), dist.get_world_size(group)) if use_dist else (0, 1)
    first_bad = len(names)
    for index in range(rank, len(names), world):
        if _problem(directory, names[index], sums) is not None:
            first_bad = index
            break
    if use_dist and world > 1:
        flag = torch.tensor([first_bad], dtype=torch.int64, device=_collective_device(group))
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        first_bad = int(flag.item())
    if first_bad == len(names):
        return None
    return f"{directory / names[first_bad]}: {_problem(directory, names[first_bad], sums)}"


def _problem(directory: Path, name: str, sums: dict[str, tuple[int, int]]) -> str | None:
    path = directory / name
    if not path.exists():
        return "missing"
    if name not in sums:
        return "no checksum recorded for it"
    size, crc = sums[name]
    actual_size = path.stat().st_size
    if actual_size != size:
        return f"truncated or overwritten ({actual_size} bytes, {size} written)"
    if file_checksum(path)[1] != crc:
        return "corrupted (CRC32 differs from the one recorded when it was written)"
    return None


def _collective_device(group: dist.ProcessGroup | None) -> str:
    return "cuda" if dist.get_backend(group) == "nccl" else "cpu"
