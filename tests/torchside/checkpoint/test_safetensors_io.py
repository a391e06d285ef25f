"""safetensors export/import in one process (the 4 -> 2 rank case is in test_resharding)."""

from __future__ import annotations

import json

import numpy as np
import torch
from safetensors import safe_open

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
    model, optimizer = _trained(fp8=True)
    save(tmp_path / "ckpt", model, optimizer, step=1)
    (path,) = export_safetensors(tmp_path / "ckpt", tmp_path / "out", dtype="fp8")
    with safe_open(path, framework="pt") as f:
        weight = model[0].qkv.weight
        assert torch.equal(f.get_tensor("0.qkv.weight").view(torch.uint8), weight.rowwise_data.view(torch.uint8))
        assert torch.equal(f.get_tensor("0.qkv.weight.scale_inv"), weight.rowwise_scale_inv)
        assert json.loads(f.metadata()["fp8:0.qkv.weight"])["scheme"] == "tensorwise"
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
            assert torch.equal(f.get_tensor(name), param.detach().to(torch.bfloat16)), name
    fresh, _ = build(topology("single"), "delayed", False, seed=2)
    import_safetensors(tmp_path / "fp32", fresh)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
