"""Hugging Face Llama directories as a converter format: read under our keys, write back in HF's names and files.

The name-and-layout table is twinspec.hf_llama (framework-free; docs/hf.md). Our keys are a
torchside DCP checkpoint's of `torchside.models.llama.Llama`: `model.<fqn>`.

Reading: the directory is checked whole first (`hf_llama.Checkpoint`: architecture, config.json,
index, every file's header, every tensor's name, shape and dtype), before any weight byte is read.
A box of one of our tensors is made of a few row ranges of HF tensors (`row_pieces`: the fused QKV
from slices of q, k and v; fc1 from gate and up rows), each read by its byte ranges (`get_slice`).
An FP8 block-scaled directory's projection weights read as torchside's FP8 buffers
(`model.<fqn>.rowwise_data` uint8, `.rowwise_scale_inv` fp32 blocks), their facts in `facts`
(bridge.convert.facts). Files transformers writes carry no checksums: such a source converts
unverified. Files this writer wrote carry torchside's `shardbridge.crc32` table: each HF tensor is
checked against it before the first box made of it is read (CheckFailed on a mismatch).

Writing: the shapes do not say the Llama config (a head count or rope_theta cannot be read off
them), so an HF target needs the HF `config.json`: the one an HF source carried along (its
`config.json` and `generation_config.json` ride in the checkpoint's facts as `hf_files`,
bridge.convert.facts), or `target_options["config"]` (the file or its directory; the CLI's
`--config`), which wins. It is written as it is; the plan's tensors are checked against it before
anything is written. FP8 buffers go back to F8_E4M3 `weight` + `weight_scale_inv` (with quantization_config,
added to config.json if it lacks one), when the checkpoint's facts say fc1 is in runs of 128 and
the buffers are block128x128/e4m3 (ValueError otherwise); a high-precision fc1 splits by its
recorded glu_interleave. Files: `model.safetensors`, or `model-0000k-of-0000n.safetensors` plus
`model.safetensors.index.json` once the tensors exceed `max_shard_size` (transformers' rule: tensors
in its parameter order, a new shard when the next one would not fit). Written by one process,
streamed: each of our tensors is produced in dim-0 blocks as tall as the largest of its HF tensors
(`_row_blocks`), and each block's row pieces are written at their offsets in their HF tensors
(torchside.checkpoint.safetensors_file, each tensor's CRC32 running on piece by piece): peak memory
is about one HF tensor, never a whole fused QKV or fc1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bridge.convert import facts
from bridge.convert.plan import FP8_BUFFERS, Box, Plan, PlanEntry, TensorInfo, WriteJob, check_against, itemsize
from bridge.errors import CheckFailed
from twinspec import hf_llama
from torchside.checkpoint import safetensors_file

TORCH_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
FP8_SCHEME = "block128x128"  # torchside's name of Float8BlockScaling's 128x128 weight blocks
DEFAULT_MAX_SHARD_SIZE = "5GB"
GENERATION_CONFIG_FILE = "generation_config.json"
CARRIED_FILES = (hf_llama.CONFIG_FILE, GENERATION_CONFIG_FILE)  # an HF source's, carried to an HF target
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

    def __init__(self, path: str | os.PathLike, *, check: bool = True, glu_interleave: int | None = None) -> None:
        """glu_interleave: present fc1 in that layout (hf_llama.Checkpoint; the read-back of a target written from one)."""
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"{self.path} is not a directory; pass a Hugging Face model directory")
        self.checkpoint = hf_llama.Checkpoint(self.path, glu_interleave)
        self.tensors: dict[str, TensorInfo] = {}
        self.facts: dict = {"hf_files": _carried_files(self.path)}  # bridge.convert.facts (+ FP8 format, fc1 layout)
        for ours, source in self.checkpoint.sources.items():
            infos = [self.checkpoint.tensors[name] for name in source.hf_names]
            dtypes = {info.dtype for info in infos}
            if len(dtypes) > 1:
                raise ValueError(f"{infos[0].file}: tensors {list(source.hf_names)} have dtypes {sorted(dtypes)}; "
                                 "they make one of our tensors, so they must share one")  # fmt: skip
            shape = (sum(info.shape[0] for info in infos), *infos[0].shape[1:])
            if ours in self.checkpoint.fp8_sources:
                self._add_fp8(ours, shape)
            else:
                self.tensors[f"model.{ours}"] = TensorInfo(f"model.{ours}", shape, TORCH_DTYPES[dtypes.pop()])
        known = {name for source in self.checkpoint.sources.values() for name in source.hf_names}
        known |= {name + hf_llama.SCALE_SUFFIX for name in known}
        unused = [name for name in sorted(self.checkpoint.tensors) if name not in known]
        self.skipped = [(n, "tied: the embedding" if n == "lm_head.weight" else "recomputed from config.json") for n in unused]
        files = sorted({info.file for info in self.checkpoint.tensors.values()})
        self._headers = {file: safetensors_file.read_header(file) for file in files} if check else {}
        self.verifiable = bool(self._headers) and all(h.recorded_crcs() is not None for h in self._headers.values())
        # (transformers' files record none: such a source converts unverified, as a foreign safetensors file does)
        self._checked: set[str] = set()

    def _add_fp8(self, ours: str, shape: tuple[int, ...]) -> None:
        """An FP8 weight as torchside checkpoints hold one: raw E4M3 bytes and fp32 128x128 scales, plus its facts."""
        block = hf_llama.BLOCK
        buffers = {"rowwise_data": (shape, "uint8"), "rowwise_scale_inv": (tuple(-(-n // block) for n in shape), "float32")}
        for buffer, (buffer_shape, dtype) in buffers.items():
            self.tensors[f"model.{ours}.{buffer}"] = TensorInfo(f"model.{ours}.{buffer}", buffer_shape, dtype)
        self.facts["glu_interleave"] = self.checkpoint.config.glu_interleave
        self.facts.setdefault("fp8_params", {})[ours] = {
            "scheme": FP8_SCHEME, "fmt": "e4m3", "hadamard": False, "shape": list(shape),
            "dtype": TORCH_DTYPES[self.checkpoint.dtype()], "buffers": list(buffers),
        }  # fmt: skip

    def read(self, key: str, box: Box) -> torch.Tensor:
        """The elements of `box` of our tensor `key`, from the byte ranges of the HF rows it is made of."""
        offsets, sizes = box
        out = torch.empty(sizes, dtype=getattr(torch, self.tensors[key].dtype))
        rows = (offsets[0], offsets[0] + sizes[0])
        cols = (offsets[1], offsets[1] + sizes[1]) if len(sizes) == 2 else None

        def put(piece: hf_llama.Piece, values) -> None:
            target = out[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step]
            target.zero_() if values is None else target.copy_(torch.as_tensor(values))

        ours, _, buffer = key.removeprefix("model.").rpartition(".")
        if ours not in self.checkpoint.fp8_sources:  # a plain tensor: the whole key is our name
            ours, buffer = key.removeprefix("model."), None
        names = self.checkpoint.sources[ours].hf_names
        for name in names + tuple(n + hf_llama.SCALE_SUFFIX for n in names if buffer):
            self._check(name)
        self.checkpoint.read_box(ours, rows, cols, "pt", put, *([buffer] if buffer else []))
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


def _carried_files(directory: Path) -> dict[str, str]:
    """The text of the directory's CARRIED_FILES that exist."""
    return {name: (directory / name).read_bytes().decode() for name in CARRIED_FILES if (directory / name).is_file()}


@dataclass(frozen=True)
class _Target:
    """The HF model to write: its config.json (and generation_config.json), our config (with the checkpoint's
    fc1 layout), FP8 or not."""

    files: Mapping[str, str]  # CARRIED_FILES' text, as they are to be written (config.json always)
    origin: str  # where config.json came from (named in errors)
    config: hf_llama.LlamaConfig
    fp8: bool  # projection weights as F8_E4M3 `weight` + `weight_scale_inv`
    add_quantization: bool  # FP8 buffers but a config.json without quantization_config: write it in


def _config_files(options: Mapping[str, Any], source_facts: Mapping[str, Any]) -> tuple[dict[str, str], str]:
    """(CARRIED_FILES' text, where config.json came from): `--config` (its directory's generation_config.json
    too) over the files carried from an HF source."""
    files = dict(source_facts.get("hf_files", {}))
    if options.get("config"):
        given = Path(options["config"])
        path = hf_llama.read_config_file(given)[0]  # (ValueError naming the file if it is no Llama config)
        files = {**files, **(_carried_files(given) if given.is_dir() else {hf_llama.CONFIG_FILE: path.read_bytes().decode()})}
        return files, str(path)
    if hf_llama.CONFIG_FILE not in files:
        raise ValueError(
            "an HF target needs the model's config.json: pass --config PATH (the file or its directory); "
            "checkpoints converted from an HF directory carry theirs, this one does not"
        )
    return files, f"the {hf_llama.CONFIG_FILE} carried from the HF source"


def _target(options: Mapping[str, Any], source_facts: Mapping[str, Any]) -> _Target:
    """ValueError unless the checkpoint (its facts: bridge.convert.facts) writes exactly as the HF config says."""
    files, origin = _config_files(options, source_facts)
    path = Path(origin)  # (named in parse_config's errors)
    config, quantization = hf_llama.parse_config(json.loads(files[hf_llama.CONFIG_FILE]), path)
    quantized = quantization is not None
    fp8_params, w = source_facts.get("fp8_params", {}), facts.glu_interleave(source_facts)
    fp8 = quantized or bool(fp8_params)
    if not fp8:  # high precision: any fc1 layout maps to gate and up rows
        return _Target(files, origin, dataclasses.replace(config, glu_interleave=w), False, False)
    config = config if quantized else hf_llama.fp8_config(config, hf_llama.FP8_QUANTIZATION, path)
    if w != config.glu_interleave:
        raise ValueError(
            f"the checkpoint's fc1 interleaves gate and up rows in runs of {w} (glu_interleave), so a 128-row FP8 "
            f"block of it mixes gate and up rows: an FP8 HF target needs glu_interleave {config.glu_interleave} "
            "(what torchside.models.llama.load_hf gives an FP8 HF checkpoint); requantizing is lossy and not done"
        )
    for ours in hf_llama.fp8_sources(config):
        held = fp8_params.get(ours)
        if held is None or (held.get("scheme"), held.get("fmt")) != (FP8_SCHEME, "e4m3"):
            fix = ("pass a config without quantization_config to export high precision weights" if held is None
                   else "converting another FP8 format would requantize (lossy), which is not done")  # fmt: skip
            what = "not FP8" if held is None else f"{held.get('scheme')}/{held.get('fmt')}"
            raise ValueError(
                f"model.{ours} is {what} in the checkpoint, but an FP8 HF checkpoint ({path}) holds every projection "
                f"weight as {FP8_SCHEME}/e4m3 bytes and scales (Float8BlockScaling's weights): {fix}"
            )
    return _Target(files, origin, config, True, not quantized)


def _expected(target: _Target) -> dict[str, tuple[int, ...]]:
    """Our key and shape of every tensor the HF target is made of (FP8 weights: their two buffers)."""
    fp8 = hf_llama.fp8_sources(target.config) if target.fp8 else {}
    expected = {}
    for ours, shape in hf_llama.our_shapes(target.config).items():
        if ours in fp8:
            expected[f"model.{ours}.rowwise_data"] = shape
            expected[f"model.{ours}.rowwise_scale_inv"] = tuple(-(-n // hf_llama.BLOCK) for n in shape)
        else:
            expected[f"model.{ours}"] = shape
    return expected


def check_target(plan: Plan, options: Mapping[str, Any], source_facts: Mapping[str, Any] | None = None) -> None:
    """ValueError before anything is written if the plan's tensors do not make an HF Llama of the given config."""
    if plan.owners != 1:
        raise ValueError("an HF target is written by one process; run without torch.distributed")
    target = _target(options, source_facts or {})
    expected = _expected(target)
    extra = [e.target.key for e in plan.entries if e.target.key not in expected]
    if extra:
        raise ValueError(_no_place_for(extra, target))
    check_against(plan, expected)
    parse_size(options.get("max_shard_size") or DEFAULT_MAX_SHARD_SIZE)


def _no_place_for(extra: list[str], target: _Target) -> str:
    """What is wrong when the checkpoint holds tensors (`extra`, our keys) the config's model has no place for."""
    head = "model.lm_head.weight"  # an untied model's own output head
    if head in extra and target.config.tie_word_embeddings:
        return (
            f"the checkpoint has its own output head ({head}), but {target.origin} says tie_word_embeddings: true "
            "(the head is the embedding, and HF stores no lm_head): pass the config.json of the model this checkpoint "
            "holds, or set tie_word_embeddings to false in it"
        )
    listed = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
    if target.fp8 and any(key.rpartition(".")[2] in FP8_BUFFERS for key in extra):
        return (
            f"{listed}: an FP8 HF checkpoint holds the rowwise FP8 buffers of the projection weights only "
            "(torchside's Float8BlockScaling weights, docs/hf.md); these have no place in it"
        )
    return (
        f"{listed}: the {hf_llama.ARCHITECTURE} of {target.origin} has no such tensor: pass the config.json of the "
        "model this checkpoint holds"
    )


def _nbytes(spec: safetensors_file.TensorSpec) -> int:
    name, dtype, shape = spec
    return TensorInfo(name, shape, dtype).nbytes


def _shards(specs: list[safetensors_file.TensorSpec], max_bytes: int) -> list[list[safetensors_file.TensorSpec]]:
    """transformers' sharding (huggingface_hub's split_state_dict_into_shards): in order, a tensor larger than
    max_bytes gets a shard of its own at once; the others fill the current shard, a new one when the next would not fit."""
    shards: list[list] = []
    current: list = []
    size = 0
    for spec in specs:
        nbytes = _nbytes(spec)
        if nbytes > max_bytes:
            shards.append([spec])
            continue
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += nbytes
    return shards + ([current] if current else [])


def write(job: WriteJob) -> None:
    """config.json, the safetensors file(s) and (sharded) the index, into the directory `job.path`."""
    target = _target(job.options, job.facts)
    config = target.config
    entries = {e.target.key: e for e in job.plan.entries}
    fp8 = hf_llama.fp8_sources(config) if target.fp8 else {}
    shapes = hf_llama.hf_shapes(config, target.fp8)
    of_ours = {}  # our key -> (its table entry, the pieces function of its rows)
    for ours, source in hf_llama.sources(config).items():
        if ours in fp8:
            of_ours[f"model.{ours}.rowwise_data"] = (source, hf_llama.row_pieces)
            of_ours[f"model.{ours}.rowwise_scale_inv"] = (source, hf_llama.block_pieces)
        else:
            of_ours[f"model.{ours}"] = (source, hf_llama.row_pieces)
    key_of = {piece.hf_name: key for key, (source, pieces) in of_ours.items()
              for piece in pieces(source, config, 0, entries[key].target.shape[0])}  # fmt: skip

    def dtype(name: str) -> str:  # FP8 bytes travel as uint8 (torchside.checkpoint.quantized_params)
        key = key_of[name]
        return "float8_e4m3fn" if key.endswith(".rowwise_data") else entries[key].target.dtype

    specs = [(name, dtype(name), shapes[name]) for name in hf_llama.hf_order(config, target.fp8)]
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
        for key, (source, pieces) in of_ours.items():
            for name, offset, rows in _row_blocks(job, entries[key], source, config, pieces, shapes):
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
    files = dict(target.files)
    if target.add_quantization:  # the model's config, saying how its weights are stored now
        hf_config = json.loads(files[hf_llama.CONFIG_FILE]) | {"quantization_config": hf_llama.FP8_QUANTIZATION}
        files[hf_llama.CONFIG_FILE] = json.dumps(hf_config, indent=2) + "\n"
    for name, text in files.items():
        (job.path / name).write_bytes(text.encode())


def _row_blocks(job: WriteJob, entry: PlanEntry, source: hf_llama.Source, config, pieces, shapes):
    """(HF name, byte offset in it, its rows) of one of our tensors, produced a dim-0 block at a time.

    A block has as many rows as the largest of the HF tensors it is made of (peak memory: about one
    HF tensor, not the fused one); its rows go to the HF tensors by `pieces` (`row_pieces`, the
    reader's table, or `block_pieces` for FP8 scales), in increasing HF row order (each HF tensor's
    CRC32 runs on in that order).
    """
    key, shape = entry.target.key, entry.target.shape
    block = max(shapes[piece.hf_name][0] for piece in pieces(source, config, 0, shape[0]))
    row_bytes = math.prod(shape[1:]) * itemsize(entry.target.dtype)
    for start in range(0, shape[0], block):
        stop = min(shape[0], start + block)
        values = job.produce(key, ((start, *[0] * (len(shape) - 1)), (stop - start, *shape[1:])))
        for piece in pieces(source, config, start, stop):
            rows = values[piece.dest : piece.dest + (piece.stop - piece.start) * piece.step : piece.step]
            yield piece.hf_name, piece.start * row_bytes, rows
