"""safetensors export/import in one process (the 4 -> 2 rank case is in test_resharding)."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tests.torchside.checkpoint.training import build, gathered_state, topology, train
from torchside.checkpoint import save
from torchside.checkpoint.safetensors_io import INDEX_FILE, export_safetensors, import_safetensors


def _trained(fp8: bool, seed: int = 1):
    model, optimizer = build(topology("single"), "delayed", fp8, seed)
    train(model, optimizer, topology("single"), "delayed", 0, 1)
    return model, optimizer


def _parameters(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("optim:") and ".fp8_" not in k}


def test_fp8_export_holds_bytes_and_scale_inv_and_imports_exact(tmp_path):
    """Keys in the checkpoint's (and convert's) scheme; and `shardbridge convert` reads the export as a source."""
    model, optimizer = _trained(fp8=True)
    save(tmp_path / "ckpt", model, optimizer, step=1)
    (path,) = export_safetensors(tmp_path / "ckpt", tmp_path / "out", dtype="fp8")
    with safe_open(path, framework="pt") as f:
        weight = model[0].qkv.weight
        data = f.get_tensor("model.0.qkv.weight.rowwise_data")
        assert data.dtype == torch.float8_e4m3fn  # safetensors' own F8 dtype, not U8
        assert torch.equal(data.view(torch.uint8), weight.rowwise_data.view(torch.uint8))
        assert torch.equal(f.get_tensor("model.0.qkv.weight.rowwise_scale_inv"), weight.rowwise_scale_inv)
        assert json.loads(f.metadata()["fp8:0.qkv.weight"])["scheme"] == "tensorwise"
    from bridge.convert import convert

    assert convert(path, "safetensors", tmp_path / "dcp", "dcp").source_verified
    fresh, fresh_optimizer = build(topology("single"), "delayed", True, seed=2)
    import_safetensors(tmp_path / "out", fresh)
    expected, imported = _parameters(gathered_state(model, optimizer)), gathered_state(fresh, fresh_optimizer)
    assert all(np.array_equal(v, imported[k]) for k, v in expected.items())


def test_sharded_fp32_and_bf16_exports_hold_the_parameters(tmp_path):
    model, optimizer = _trained(fp8=False)
    save(tmp_path / "ckpt", model, optimizer, step=1)
    files = export_safetensors(tmp_path / "ckpt", tmp_path / "fp32", dtype="fp32", max_shard_bytes=32 << 10)
    assert len(files) > 1 and (tmp_path / "fp32" / INDEX_FILE).exists()
    export_safetensors(tmp_path / "ckpt", tmp_path / "bf16", dtype="bf16")
    with safe_open(tmp_path / "bf16" / "model.safetensors", framework="pt") as f:
        for name, param in model.named_parameters():
            assert torch.equal(f.get_tensor(f"model.{name}"), param.detach().to(torch.bfloat16)), name
    fresh, _ = build(topology("single"), "delayed", False, seed=2)
    import_safetensors(tmp_path / "fp32", fresh)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name


def _header(path) -> dict:
    """The JSON header, parsed here by hand (the format: 8-byte length, then JSON)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length])


def test_fp8_export_labels_weights_with_f8_dtypes_and_records_crc32s(tmp_path):
    model, optimizer = _trained(fp8=True)
    save(tmp_path / "ckpt", model, optimizer, step=1)
    (path,) = export_safetensors(tmp_path / "ckpt", tmp_path / "out", dtype="fp8")
    header = _header(path)
    fp8_weights = [f"model.{k.removeprefix('fp8:')}.rowwise_data" for k in header["__metadata__"] if k.startswith("fp8:")]
    assert fp8_weights and {header[k]["dtype"] for k in fp8_weights} == {"F8_E4M3"}
    recorded = json.loads(header["__metadata__"]["shardbridge.crc32"])
    tensors = load_file(path)
    assert sorted(recorded) == sorted(tensors)
    for key, values in tensors.items():
        assert int(recorded[key], 16) == zlib.crc32(values.contiguous().view(torch.uint8).numpy().tobytes()), key


def test_import_refuses_a_corrupted_export(tmp_path):
    model, optimizer = _trained(fp8=False)
    save(tmp_path / "ckpt", model, optimizer, step=1)
    (path,) = export_safetensors(tmp_path / "ckpt", tmp_path / "out", dtype="fp32")
    header = _header(path)
    start = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    first, _ = header["model.0.proj.weight"]["data_offsets"]
    raw = bytearray(path.read_bytes())
    raw[start + first + 4] ^= 0xFF
    path.write_bytes(bytes(raw))
    fresh, _ = build(topology("single"), "delayed", False, seed=2)
    damaged = r"model.safetensors: tensor model.0.proj.weight has CRC32 [0-9a-f]{8}, but [0-9a-f]{8} was recorded"
    with pytest.raises(ValueError, match=damaged):
        import_safetensors(tmp_path / "out", fresh)
