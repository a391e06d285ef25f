"""safetensors boxes: read by offsets (`safe_open(...).get_slice`), write one file by positioned writes.

The file is our safetensors dialect (torchside.checkpoint.safetensors_file: header layout, the
`shardbridge.dtypes` table for dtypes safetensors has no code for, the `shardbridge.crc32` table).
Every box the converter writes is a dim-0 block, so it is one contiguous byte range: process 0
writes the header and sizes the file, then each process writes its own boxes at their offsets,
never holding more than one box; once all are written, process 0 fills in the CRC32 table.

Source checks: a file with a `shardbridge.crc32` table is verifiable: each tensor's bytes are
checked against it before the first box is read from it (CheckFailed on a mismatch). A file
without one (written elsewhere) converts unverified.
"""

from __future__ import annotations

import json
import math
import os

import torch

from bridge.convert import facts
from bridge.convert.plan import Box, TensorInfo, WriteJob, itemsize
from bridge.errors import CheckFailed
from torchside.checkpoint import safetensors_file


class SafetensorsReader:
    """The tensors of one .safetensors file, read a box at a time.

    The file is mapped only while a box is read: pages a read touched count as this process's
    memory for as long as the mapping lives.
    """

    def __init__(self, path: str | os.PathLike, *, check: bool = True) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise ValueError(f"{self.path} is not a file; pass a .safetensors file")
        self.header = safetensors_file.read_header(self.path)
        self.tensors = {}
        for key, entry in self.header.entries.items():
            self.tensors[key] = TensorInfo(key, tuple(entry["shape"]), self.header.dtype(key))
            if not hasattr(torch, self.tensors[key].dtype):
                raise ValueError(f"{self.path}: tensor {key} has dtype {entry['dtype']}, which torch cannot hold")
        self.skipped: list[tuple[str, str]] = []
        self.facts = json.loads(self.header.metadata.get(facts.FACTS_KEY, "{}"))  # bridge.convert.facts
        self._recorded = self.header.recorded_crcs() if check else None
        self.verifiable = self._recorded is not None
        self._checked: set[str] = set()

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of tensor `key` (only its byte ranges are read)."""
        from safetensors import safe_open

        self._check(key)
        info = self.tensors[key]
        offsets, sizes = box
        try:
            with safe_open(self.path, framework="pt") as file:
                if not info.shape:
                    values = file.get_tensor(key)
                else:
                    values = file.get_slice(key)[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
        except Exception as error:  # SafetensorError and friends: a damaged file
            raise ValueError(f"reading {key} from {self.path} failed ({error}): pass an intact .safetensors file") from error
        return values.view(getattr(torch, info.dtype)) if values.dtype != getattr(torch, info.dtype) else values

    def _check(self, key: str) -> None:
        """Check `key`'s bytes against the recorded CRC32 once, before its first box is read."""
        if not self.verifiable or key in self._checked:
            return
        if key not in self._recorded:
            raise ValueError(f"{self.path}: no CRC32 recorded for tensor {key}: the header is damaged; restore the file")
        actual = self.header.crc_of(key)
        if actual != self._recorded[key]:
            raise CheckFailed(
                f"{self.path}: tensor {key} has CRC32 {actual:08x}, but {self._recorded[key]:08x} was recorded when "
                "it was written: the source is corrupted; nothing was written. Convert an intact copy"
            )
        self._checked.add(key)


def _spec(info: TensorInfo) -> safetensors_file.TensorSpec:
    return info.key, info.dtype, info.shape


def write(job: WriteJob) -> None:
    """Write every tensor into one file: the header (by owner 0), this process's boxes, then the CRC32 table."""
    recorded = {facts.FACTS_KEY: json.dumps(dict(job.facts), sort_keys=True)} if job.facts else {}
    layout = safetensors_file.layout([_spec(t) for t in job.tensors()], {"format": "pt", **recorded})
    if job.owner == 0:
        safetensors_file.create(job.path, layout)
    job.barrier()
    fd = os.open(job.path, os.O_WRONLY)
    try:
        for info, (offsets, sizes) in job.boxes():
            row_bytes = math.prod(info.shape[1:]) * itemsize(info.dtype)
            start = layout.offsets[info.key] + (offsets[0] * row_bytes if info.shape else 0)
            safetensors_file.write_at(fd, start, job.produce(info.key, (offsets, sizes)))
        os.fsync(fd)
    finally:
        os.close(fd)
    crcs = job.tensor_crcs()
    if job.owner == 0:
        safetensors_file.record_checksums(job.path, layout, crcs)
    job.barrier()
