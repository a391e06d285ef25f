"""Model weights as safetensors: exported from a committed checkpoint, imported into any topology.

Key scheme (also in docs/checkpoints.md): the checkpoint's own keys, as `shardbridge convert`
writes them too (one dialect): `model.<fqn>` for a parameter (`model.0.qkv.bias`), and for an FP8
parameter its buffers under their checkpoint names.

- `dtype="fp32"` / `"bf16"`: every parameter as one full tensor `model.<fqn>` in that dtype. The
  values come from FusedAdam's `master_param` where the checkpoint has one (bf16: the master
  rounded to nearest), an FP8 parameter is dequantized (`q * scale_inv`), anything else is the
  saved parameter.
- `dtype="fp8"`: an FP8 parameter is `model.<fqn>.rowwise_data` = its rowwise bytes, [out, in]
  (`F8_E4M3` / `F8_E5M2`, safetensors' float8 dtypes; `U8` for NVFP4, two E2M1 values per byte,
  element 2i in the low nibble), plus `model.<fqn>.rowwise_scale_inv` (fp32 per tensor or per
  block, `U8` E8M0 exponents for MXFP8, E4M3 for NVFP4) and for NVFP4 `model.<fqn>.tensor_amax`
  (fp32, the global amax). Dequantize as docs/quantization.md says for the scheme named in the
  header. Other parameters keep their saved dtype.
- the header's `__metadata__` holds `format` = `shardbridge`, `dtype`, and per FP8 parameter
  `fp8:<fqn>` = JSON {scheme, fmt, shape, dtype, hadamard}; and the dialect's own tables
  (safetensors_file: real dtypes of `U8`-stored ones, each tensor's CRC32, checked on import).
- one file `model.safetensors`, or with `max_shard_bytes` files `model-0000i-of-0000n.safetensors`
  and `model.safetensors.index.json` ({"metadata", "weight_map": key -> file}).

Bounded memory: the layout of every file is computed from the checkpoint's metadata alone; rank 0
writes the headers, then rank r reads, converts and writes (at its offset) the tensors r, r + W, ...,
one at a time; rank 0 then fills in every file's CRC32 table. No rank holds more than one full
tensor. Import reads one tensor at a time too and keeps only this rank's shard of it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from torchside.checkpoint import commit, quantized_params, safetensors_file, validate
from torchside.checkpoint.checksums import tensor_crc32
from torchside.quantization import QuantizedStorage
from torchside.quantization.storage import BUFFER_FIELDS

EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": None}
_DATA_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}  # FP8 bytes (E2M1 pairs stay uint8)
_FP8_EXPORTED = ("rowwise_data", "rowwise_scale_inv", "tensor_amax")  # the buffers an FP8 export holds
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Entry:
    """One output tensor: its key, the checkpoint keys it is made from, its dtype and shape."""

    key: str
    sources: tuple[str, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    fp8_param: str | None = None  # the FP8 parameter it dequantizes (high-precision export)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def spec(self) -> safetensors_file.TensorSpec:
        return self.key, str(self.dtype).removeprefix("torch."), self.shape


def export_safetensors(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    dtype: str = "fp32",
    max_shard_bytes: int | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> list[Path]:
    """Write the model weights of a committed checkpoint as safetensors (every rank calls it); the files written."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export_safetensors(dtype={dtype!r}): use 'fp32', 'bf16' or 'fp8'")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"export_safetensors(max_shard_bytes={max_shard_bytes}): pass None or a positive size")
    _, step_path = commit.resolve(directory)
    metadata = commit.read_metadata(step_path)
    saved = validate.read_dcp_metadata(step_path).state_dict_metadata
    entries = _plan(saved, metadata["fp8_params"], dtype)
    files = _assign_files(entries, max_shard_bytes)
    header_metadata = {"format": "shardbridge", "dtype": dtype}
    header_metadata |= {f"fp8:{fqn}": json.dumps(facts) for fqn, facts in metadata["fp8_params"].items()}
    out = Path(out)
    use_dist = dist.is_initialized()
    rank, world = (dist.get_rank(process_group), dist.get_world_size(process_group)) if use_dist else (0, 1)
    layouts = {name: safetensors_file.layout([e.spec for e in members], header_metadata) for name, members in files.items()}
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        for name, layout in layouts.items():
            safetensors_file.create(out / name, layout)
        if len(files) > 1:
            weight_map = {e.key: name for name, members in files.items() for e in members}
            (out / INDEX_FILE).write_text(json.dumps({"metadata": header_metadata, "weight_map": weight_map}, indent=1))
    if use_dist:
        dist.barrier(group=process_group)
    owner = {e.key: name for name, members in files.items() for e in members}
    crcs = {}
    for entry in entries[rank::world]:
        values = _convert(entry, _read(step_path, entry, saved), metadata["fp8_params"])
        fd = os.open(out / owner[entry.key], os.O_WRONLY)
        try:
            crcs[entry.key] = safetensors_file.write_at(fd, layouts[owner[entry.key]].offsets[entry.key], values)
            os.fsync(fd)
        finally:
            os.close(fd)
    if use_dist:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, crcs, group=process_group)
        crcs = {key: crc for part in gathered for key, crc in part.items()}
    if rank == 0:
        for name, layout in layouts.items():
            safetensors_file.record_checksums(out / name, layout, crcs)
    if use_dist:
        dist.barrier(group=process_group)
    return [out / name for name in files]


def _plan(saved: dict, fp8_params: dict, dtype: str) -> list[_Entry]:
    """Every output tensor, in key order, from the checkpoint's metadata alone."""
    target = EXPORT_DTYPES[dtype]
    entries = []
    params = sorted({k.removeprefix("model.") for k in saved if k.startswith("model.")})
    for key in params:
        if key.rsplit(".", 1)[0] in fp8_params and key.rsplit(".", 1)[-1] in BUFFER_FIELDS:
            continue  # an FP8 parameter's buffer: handled with its parameter
        entry = saved[f"model.{key}"]
        master = f"optim.{key}.master_param"
        source = master if target is not None and master in saved else f"model.{key}"
        entries.append(_Entry(f"model.{key}", (source,), target or entry.properties.dtype, tuple(entry.size)))
    for fqn, facts in sorted(fp8_params.items()):
        if target is not None:
            master = f"optim.{fqn}.master_param"
            if master in saved:
                entries.append(_Entry(f"model.{fqn}", (master,), target, tuple(facts["shape"])))
                continue
            sources = tuple(f"model.{fqn}.{b}" for b in facts["buffers"] if not b.startswith("columnwise"))
            entries.append(_Entry(f"model.{fqn}", sources, target, tuple(facts["shape"]), fp8_param=fqn))
            continue
        if "rowwise_data" not in facts["buffers"]:
            raise ValueError(f"FP8 parameter {fqn} has no rowwise copy to export: quantize its weights rowwise")
        for buffer in _FP8_EXPORTED:
            if buffer in facts["buffers"]:
                entry = saved[f"model.{fqn}.{buffer}"]
                dtype = _DATA_DTYPES.get(facts["fmt"]) if buffer == "rowwise_data" else None
                key = f"model.{fqn}.{buffer}"
                entries.append(_Entry(key, (key,), dtype or entry.properties.dtype, tuple(entry.size)))
    return sorted(entries, key=lambda e: e.key)


def _assign_files(entries: list[_Entry], max_shard_bytes: int | None) -> dict[str, list[_Entry]]:
    groups: list[list[_Entry]] = [[]]
    for entry in entries:
        full = sum(e.nbytes for e in groups[-1])
        if max_shard_bytes is not None and groups[-1] and full + entry.nbytes > max_shard_bytes:
            groups.append([])
        groups[-1].append(entry)
    if len(groups) == 1:
        return {SINGLE_FILE: groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": g for i, g in enumerate(groups)}


def _read(step_path: Path, entry: _Entry, saved: dict) -> dict[str, Tensor]:
    """The full tensors `entry` is made from (this rank alone reads them)."""
    target = {}
    for source in entry.sources:
        meta = saved[source]
        target[source] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    dcp.load(_nest(target), checkpoint_id=str(step_path), no_dist=True)
    return target


def _nest(flat: dict[str, Tensor]) -> dict:
    nested: dict = {}
    for key, value in flat.items():
        top, rest = key.split(".", 1)
        nested.setdefault(top, {})[rest] = value
    return nested


def _convert(entry: _Entry, sources: dict[str, Tensor], fp8_params: dict) -> Tensor:
    if entry.fp8_param is None:
        (values,) = sources.values()
        if values.dtype.itemsize == entry.dtype.itemsize == 1:
            return values.view(entry.dtype)  # bytes kept: FP8 data saved as uint8 is labelled with its format
        return values.to(entry.dtype)
    facts = fp8_params[entry.fp8_param]
    buffers = {key.rsplit(".", 1)[-1]: t for key, t in sources.items()}
    rows, cols = facts["shape"]
    storage = QuantizedStorage(facts["scheme"], facts["fmt"], rows, cols, facts["hadamard"], **buffers)
    return storage.dequantize(torch.float32).to(entry.dtype)


# ---------------------------------------------------------------------------------------- import


def import_safetensors(path: str | os.PathLike, model: nn.Module) -> None:
    """Load exported weights into `model` on any topology (every rank reads only what it keeps)."""
    files = _files_by_key(Path(path))
    header = _header_metadata(files)
    fp8_facts = {k.removeprefix("fp8:"): json.loads(v) for k, v in header.items() if k.startswith("fp8:")}
    params = dict(model.named_parameters())
    missing = sorted(p for p in params if f"model.{p}" not in files and f"model.{p}.rowwise_data" not in files)
    if missing:
        raise ValueError(f"{path} lacks weights of this model: {', '.join(missing[:20])}")
    for fqn, param in params.items():
        if fqn in fp8_facts and header.get("dtype") == "fp8":
            # A sharded export may put an FP8 weight's bytes and its scales in different files.
            keys = {buffer: f"model.{fqn}.{buffer}" for buffer in _FP8_EXPORTED if f"model.{fqn}.{buffer}" in files}
            buffers = {buffer: _file_tensor(files, key) for buffer, key in keys.items()}
            _import_fp8(model, fqn, param, fp8_facts[fqn], buffers)
        else:
            _import_values(model, fqn, param, _file_tensor(files, f"model.{fqn}"))


def _file_tensor(files: dict[str, Path], key: str) -> Tensor:
    """Tensor `key` as stored, checked against the file's CRC32 table where it has one."""
    with safe_open(files[key], framework="pt") as f:
        values = f.get_tensor(key)
    recorded = safetensors_file.read_header(files[key]).recorded_crcs()
    if recorded is not None and tensor_crc32(values) != recorded.get(key):
        raise ValueError(
            f"{files[key]}: tensor {key} has CRC32 {tensor_crc32(values):08x}, but {recorded.get(key, 0):08x} was "
            "recorded when it was written: the file is corrupted; export it again"
        )
    return values


def _files_by_key(path: Path) -> dict[str, Path]:
    if path.is_dir():
        index = path / INDEX_FILE
        if index.exists():
            return {k: path / v for k, v in json.loads(index.read_text())["weight_map"].items()}
        path = path / SINGLE_FILE
    if not path.exists():
        raise ValueError(f"{path} does not exist: pass a .safetensors file or a directory written by export_safetensors")
    with safe_open(path, framework="pt") as f:
        return dict.fromkeys(f.keys(), path)


def _header_metadata(files: dict[str, Path]) -> dict[str, str]:
    with safe_open(next(iter(files.values())), framework="pt") as f:
        return f.metadata() or {}


def _shard(param: Tensor, full: Tensor) -> Tensor:
    """This rank's part of a full tensor laid out like `param` (no communication)."""
    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()


def _check_shape(fqn: str, param: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(param.shape) != tuple(shape):
        raise ValueError(f"{fqn}: shape {tuple(shape)} in the file, {tuple(param.shape)} in the model")


def _import_values(model: nn.Module, fqn: str, param: Tensor, full: Tensor) -> None:
    _check_shape(fqn, param, full.shape)
    local = quantized_params.local_of(param)
    values = _shard(param, full.to(local.dtype)).to(local.device)
    if quantized_params.is_quantized(param):
        module, attribute = fqn.rsplit(".", 1)
        model.get_submodule(module).quantize_weight_(attribute, values)
        return
    with torch.no_grad():
        local.copy_(values)


def _import_fp8(model: nn.Module, fqn: str, param: Tensor, facts: dict, buffers: dict[str, Tensor]) -> None:
    _check_shape(fqn, param, facts["shape"])
    if "rowwise_scale_inv" in buffers and buffers["rowwise_scale_inv"].dtype == torch.uint8 and facts["scheme"] == "mxfp8":
        buffers["rowwise_scale_inv"] = buffers["rowwise_scale_inv"].view(torch.float8_e8m0fnu)
    buffers["rowwise_data"] = buffers["rowwise_data"].view(torch.uint8)  # F8_E4M3 / F8_E5M2 in the file: raw bytes here
    rows, cols = facts["shape"]
    full = QuantizedStorage(facts["scheme"], facts["fmt"], rows, cols, facts["hadamard"], **buffers)
    local = quantized_params.local_of(param)
    same_layout = quantized_params.is_quantized(param) and local.quantized_storage.metadata()[:2] == (
        facts["scheme"],
        facts["fmt"],
    )
    if not same_layout or local.quantized_storage.columnwise and facts["scheme"] not in quantized_params.TRANSPOSED_COLUMNWISE:
        _import_values(model, fqn, param, full.dequantize(torch.float32))  # re-quantized if the model is FP8
        return
    target = quantized_params.empty_storage_like(param)
    for key, tensor in quantized_params.buffer_tensors(fqn, param, target).items():
        name = key.rsplit(".", 1)[-1]
        source = getattr(full, name)
        with torch.no_grad():
            quantized_params.local_of(tensor).copy_(_shard(tensor, source) if isinstance(tensor, DTensor) else source)
    quantized_params.copy_into_param(param, target)
