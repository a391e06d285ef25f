"""Hugging Face Llama directories as a converter format: read under our keys, write back in HF's names and files.

The name-and-layout table is jaxside.models.hf_llama (framework-free; docs/hf.md). Our keys are a
torchside DCP checkpoint's of `torchside.models.llama.Llama`: `model.<fqn>`.

Reading: the directory is checked whole first (`hf_llama.Checkpoint`: architecture, config.json,
index, every file's header, every tensor's name, shape and dtype), before any weight byte is read.
A box of one of our tensors is made of a few row ranges of HF tensors (`row_pieces`: the fused QKV
from slices of q, k and v; fc1 from gate and up rows), each read by its byte ranges (`get_slice`).
Files transformers writes carry no checksums: such a source converts unverified. Files this writer
wrote carry torchside's `shardbridge.crc32` table: each HF tensor is checked against it before the
first box made of it is read (CheckFailed on a mismatch).

Writing: HF holds no record of the Llama config, and neither does a DCP, Orbax or safetensors
checkpoint of our model (a head count or rope_theta cannot be read off the shapes), so an HF target
needs the HF `config.json` to write (`target_options["config"]`: the file or its directory; the CLI's
`--config`). It is copied as it is; the plan's tensors are checked against it before anything is
written. Files: `model.safetensors`, or `model-0000k-of-0000n.safetensors` plus
`model.safetensors.index.json` once the tensors exceed `max_shard_size` (transformers' rule: tensors
in its parameter order, a new shard when the next one would not fit). Written by one process,
streamed: each of our tensors is produced in dim-0 blocks as tall as the largest of its HF tensors
(`_row_blocks`), and each block's row pieces are written at their offsets in their HF tensors
(torchside.checkpoint.safetensors_file, each tensor's CRC32 running on piece by piece): peak memory
is about one HF tensor, never a whole fused QKV or fc1.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from bridge.convert.plan import Box, Plan, PlanEntry, TensorInfo, WriteJob, check_against, itemsize
from bridge.errors import CheckFailed
from jaxside.models import hf_llama
from torchside.checkpoint import safetensors_file

TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
DEFAULT_MAX_SHARD_SIZE = "5GB"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """Bytes of a size as transformers spells it ("5GB" = 5e9, "500MiB" = 500 * 2**20, or a number)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(text).upper())
    if match is None or match[2] not in _UNITS or float(match[1]) * _UNITS[match[2]] < 1:
        raise ValueError(f"--max-shard-size {text!r}: give bytes or a size like 5GB, 500MB, 2GiB")
    return int(float(match[1]) * _UNITS[match[2]])


class HfReader:
    """An HF Llama directory's tensors under our keys (module docstring), read a box at a time."""

    def __init__(self, path: str | os.PathLike, *, check: bool = True) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"{self.path} is not a directory; pass a Hugging Face model directory")
        self.checkpoint = hf_llama.Checkpoint(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for ours, source in self.checkpoint.sources.items():
            infos = [self.checkpoint.tensors[name] for name in source.hf_names]
            dtypes = {info.dtype for info in infos}
            if len(dtypes) > 1:
                raise ValueError(f"{infos[0].file}: tensors {list(source.hf_names)} have dtypes {sorted(dtypes)}; "
                                 "they make one of our tensors, so they must share one")  # fmt: skip
            shape = (sum(info.shape[0] for info in infos), *infos[0].shape[1:])
            self.tensors[f"model.{ours}"] = TensorInfo(f"model.{ours}", shape, TORCH_DTYPES[dtypes.pop()])
        known = {name for source in self.checkpoint.sources.values() for name in source.hf_names}
        unused = [name for name in sorted(self.checkpoint.tensors) if name not in known]
        self.skipped = [(n, "tied: the embedding" if n == "lm_head.weight" else "recomputed from config.json") for n in unused]
        files = sorted({info.file for info in self.checkpoint.tensors.values()})
        self._headers = {file: safetensors_file.read_header(file) for file in files} if check else {}
        self.verifiable = bool(self._headers) and all(h.recorded_crcs() is not None for h in self._headers.values())
        # (transformers' files record none: such a source converts unverified, as a foreign safetensors file does)
        self._checked: set[str] = set()

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of our tensor `key`, from the byte ranges of the HF rows it is made of."""
        offsets, sizes = box
        out = torch.empty(sizes, dtype=getattr(torch, self.tensors[key].dtype))
        rows = (offsets[0], offsets[0] + sizes[0])
        cols = (offsets[1], offsets[1] + sizes[1]) if len(sizes) == 2 else None

        def put(piece: hf_llama.Piece, values: torch.Tensor | None) -> None:
            target = out[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step]
            target.zero_() if values is None else target.copy_(values)

        ours = key.removeprefix("model.")
        for name in self.checkpoint.sources[ours].hf_names:
            self._check(name)
        self.checkpoint.read_box(ours, rows, cols, "pt", put)
        return out

    def _check(self, name: str) -> None:
        """Check HF tensor `name` against the CRC32 our writer recorded, once, before its first read."""
        if not self.verifiable or name in self._checked:
            return
        file = self.checkpoint.tensors[name].file
        header = self._headers[file]
        recorded, actual = header.recorded_crcs().get(name), header.crc_of(name)
        if recorded != actual:
            raise CheckFailed(
                f"{file}: tensor {name} has CRC32 {actual:08x}, but {recorded or 0:08x} was recorded when it was written: "
                "the source is corrupted; nothing was written. Convert an intact copy"
            )
        self._checked.add(name)


def _target_config(options: Mapping[str, Any]) -> tuple[Path, hf_llama.LlamaConfig]:
    if not options.get("config"):
        raise ValueError("an HF target needs the model's config.json: pass --config PATH (the file or its directory)")
    return hf_llama.read_config_file(options["config"])


def check_target(plan: Plan, options: Mapping[str, Any]) -> None:
    """ValueError before anything is written if the plan's tensors do not make an HF Llama of the given config."""
    if plan.owners != 1:
        raise ValueError("an HF target is written by one process; run without torch.distributed")
    _, config = _target_config(options)
    expected = {f"model.{ours}": shape for ours, shape in hf_llama.our_shapes(config).items()}
    extra = [e.source.key for e in plan.entries if e.target.key not in expected]
    if extra:
        raise ValueError(f"{', '.join(extra[:5])}: not part of a {hf_llama.ARCHITECTURE} of config {options['config']} "
                         "(FP8 parameters do not export to HF yet; docs/hf.md)")  # fmt: skip
    check_against(plan, expected)
    parse_size(options.get("max_shard_size") or DEFAULT_MAX_SHARD_SIZE)


def _nbytes(spec: safetensors_file.TensorSpec) -> int:
    name, dtype, shape = spec
    return TensorInfo(name, shape, dtype).nbytes


def _shards(specs: list[safetensors_file.TensorSpec], max_bytes: int) -> list[list[safetensors_file.TensorSpec]]:
    """transformers' sharding: in order, a new shard when the next tensor would not fit (a big one alone)."""
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec)
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write(job: WriteJob) -> None:
    """config.json, the safetensors file(s) and (sharded) the index, into the directory `job.path`."""
    config_file, config = _target_config(job.options)
    entries = {e.target.key.removeprefix("model."): e for e in job.plan.entries}
    ours_of, shapes = hf_llama.ours_of(config), hf_llama.hf_shapes(config)
    specs = [(name, entries[ours_of[name]].target.dtype, shapes[name]) for name in hf_llama.hf_order(config)]
    shards = _shards(specs, parse_size(job.options.get("max_shard_size") or DEFAULT_MAX_SHARD_SIZE))
    names = [f"model-{k:05d}-of-{len(shards):05d}.safetensors" for k in range(1, len(shards) + 1)]
    names = [hf_llama.SINGLE_FILE] if len(shards) == 1 else names
    job.path.mkdir()
    layouts = {}
    for file, shard in zip(names, shards):
        layouts[file] = safetensors_file.layout(shard, {"format": "pt"})
        safetensors_file.create(job.path / file, layouts[file])
    where = {spec[0]: file for file, shard in zip(names, shards) for spec in shard}
    crcs: dict[str, int] = {}
    fds = {file: os.open(job.path / file, os.O_WRONLY) for file in names}
    try:
        for ours, source in hf_llama.sources(config).items():
            for name, offset, rows in _row_blocks(job, entries[ours], source, config, shapes):
                file, start = where[name], layouts[where[name]].offsets[name] + offset
                crcs[name] = safetensors_file.write_at(fds[file], start, rows, crcs.get(name, 0))
    finally:
        for fd in fds.values():
            os.close(fd)
    for file, shard in zip(names, shards):  # (and syncs each file)
        safetensors_file.record_checksums(job.path / file, layouts[file], {spec[0]: crcs[spec[0]] for spec in shard})
    if len(names) > 1:
        parameters = sum(math.prod(shape) for _, _, shape in specs)
        metadata = {"total_parameters": parameters, "total_size": sum(map(_nbytes, specs))}
        index = {"metadata": metadata, "weight_map": {name: where[name] for name, _, _ in specs}}
        (job.path / hf_llama.INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    shutil.copyfile(config_file, job.path / hf_llama.CONFIG_FILE)


def _row_blocks(job: WriteJob, entry: PlanEntry, source: hf_llama.Source, config, shapes):
    """(HF name, byte offset in it, its rows) of one of our tensors, produced a dim-0 block at a time.

    A block has as many rows as the largest of the HF tensors it is made of (peak memory: about one
    HF tensor, not the fused one); its rows go to the HF tensors by `row_pieces`, the reader's table,
    in increasing HF row order (each HF tensor's CRC32 runs on in that order).
    """
    key, shape = entry.target.key, entry.target.shape
    block = max(shapes[name][0] for name in source.hf_names)
    row_bytes = math.prod(shape[1:]) * itemsize(entry.target.dtype)
    for start in range(0, shape[0], block):
        stop = min(shape[0], start + block)
        values = job.produce(key, ((start, *[0] * (len(shape) - 1)), (stop - start, *shape[1:])))
        for piece in hf_llama.row_pieces(source, config, start, stop):
            rows = values[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step]
            yield piece.hf_name, piece.start * row_bytes, rows
