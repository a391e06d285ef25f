"""Faults: a rank killed mid-save, damaged shards, a wrong model; a failed load changes nothing.

One process without a process group (DCP's single-process path) except the SIGKILL test, where
2 gloo processes save and rank 1 kills itself after writing its shard file, before its checksum
file and the commit: the previous step must still load, and the broken one is reported.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from tests.distributed import RankError, run_processes
from tests.torchside.checkpoint.training import ADAM, build, gathered_state, local, topology, train
from torchside.checkpoint import commit, load, save
from torchside.optim import FusedAdam
from torchside.quantization import QuantizedTensor

RECIPE = "delayed"


def _trained(seed: int = 1, fp8: bool = True):
    topo = topology("single")
    model, optimizer = build(topo, RECIPE, fp8, seed)
    train(model, optimizer, topo, RECIPE, 0, 1)
    return model, optimizer


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    assert all(np.array_equal(a[k], b[k], equal_nan=True) for k in a), [k for k in a if not np.array_equal(a[k], b[k])]


def _save_then_die(rank, world_size, root):
    from torchside.checkpoint import checksums

    topo = topology("fsdp2", _pair_mesh())
    model, optimizer = build(topo, RECIPE, True, seed=1)
    train(model, optimizer, topo, RECIPE, 0, 1)
    save(root, model, optimizer, step=1)
    train(model, optimizer, topo, RECIPE, 1, 1)
    if rank == 1:  # after DCP wrote this rank's shard, before its checksums and the commit
        checksums.file_checksum = lambda path: os.kill(os.getpid(), signal.SIGKILL)
    save(root, model, optimizer, step=2)
    return "not killed"


def _pair_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


@pytest.mark.multiprocess
def test_a_rank_killed_mid_save_leaves_the_previous_step_loadable(tmp_path):
    with pytest.raises(RankError, match="Connection (closed|reset) by peer|exited with code -9"):
        run_processes(_save_then_die, 2, str(tmp_path), timeout=60)
    assert commit.committed_steps(tmp_path) == [1]
    model, optimizer = build(topology("single"), RECIPE, True, seed=5)
    with pytest.warns(UserWarning, match="step-00000002.tmp"):
        result = load(tmp_path, model, optimizer)
    assert result.step == 1 and result.interrupted == (tmp_path / "step-00000002.tmp",)


def _damage(kind: str, shard: Path) -> None:
    if kind == "missing":
        shard.unlink()
    elif kind == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    else:  # one flipped bit in the middle: torch.load would not notice if it hits tensor bytes
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["missing", "truncated", "corrupted"])
def test_a_damaged_shard_is_named_and_the_model_is_unchanged(tmp_path, kind):
    saved_model, saved_optimizer = _trained()
    path = save(tmp_path, saved_model, saved_optimizer, step=1).path
    shard = path / "__0_0.distcp"
    _damage(kind, shard)
    model, optimizer = _trained(seed=2)
    before = gathered_state(model, optimizer)
    with pytest.raises(ValueError, match=f"{shard}: {kind}"):
        load(tmp_path, model, optimizer)
    _assert_same(before, gathered_state(model, optimizer))


def test_a_wrong_model_lists_every_mismatched_key_and_is_unchanged(tmp_path):
    saved_model, saved_optimizer = _trained(fp8=False)
    save(tmp_path, saved_model, saved_optimizer, step=1)
    model, _ = _trained(seed=2)  # FP8 weights: other keys (buffers), same norms and biases
    del model[1]  # and one block fewer
    optimizer = FusedAdam([p for p in model.parameters() if not isinstance(local(p), QuantizedTensor)], **ADAM)
    before = gathered_state(model, optimizer)
    with pytest.raises(ValueError, match="mismatched keys") as error:
        load(tmp_path, model, optimizer)
    message = str(error.value)
    assert "missing from the checkpoint: model.0.qkv.weight.rowwise_data" in message
    assert "not in the model: model.0.qkv.weight" in message
    assert "not in the model: model.1.proj.bias" in message
    _assert_same(before, gathered_state(model, optimizer))


def test_latest_keep_last_and_the_metadata_are_json(tmp_path):
    model, optimizer = _trained()
    for step in (1, 2, 3):
        save(tmp_path, model, optimizer, step=step, extra={"run": "a"}, keep_last=2)
    assert commit.committed_steps(tmp_path) == [2, 3]
    fresh, fresh_optimizer = _trained(seed=2)
    result = load(tmp_path / "latest", fresh, fresh_optimizer)
    assert (result.step, result.metadata["extra"], result.interrupted) == (3, {"run": "a"}, ())
    _assert_same(gathered_state(model, optimizer), gathered_state(fresh, fresh_optimizer))
    with pytest.raises(ValueError, match="already committed"):
        save(tmp_path, model, optimizer, step=3)
    with pytest.raises(ValueError, match="no committed checkpoint"):
        load(tmp_path / "empty", fresh, fresh_optimizer)
