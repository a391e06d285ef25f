"""Faults: processes killed mid-save, damaged files, a wrong model or optimizer; a failed load changes nothing.

Every failed load is checked the same way (`_load_fails`): the error type, a message naming the
damaged file or the differing key, nothing written under the checkpoint root, and every byte of
the model and optimizer (`live_bytes`: parameter shards, every FP8 buffer, module buffers, each
optimizer state tensor and hyperparameter, the RNG) equal to a copy taken before the load.

One process without a process group (DCP's single-process path), except: 2 FSDP2 ranks on threads
for a failed swap of sharded state; real processes where one must be killed with SIGKILL (a rank
of a 2-rank sync save; one process during a thread or a process async save).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.distributed import RankError, run_processes, run_threads
from tests.torchside.checkpoint.training import ADAM, build, gathered_state, live_bytes, local, topology, train
from tests.torchside.tp_stack import RECIPES
from torchside.checkpoint import app_state, commit, load, save, validate
from torchside.optim import FusedAdam, requantize_fp8_weights
from torchside.quantization import QuantizedTensor
from torchside.recipe import Float8CurrentScaling, Format

RECIPE = "delayed"


def _trained(seed: int = 1, fp8: bool = True, recipe: str = RECIPE):
    topo = topology("single")
    model, optimizer = build(topo, recipe, fp8, seed)
    train(model, optimizer, topo, recipe, 0, 1)
    return model, optimizer


def _files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _assert_same(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys(), sorted(set(expected) ^ set(actual))
    assert expected == actual, f"differing: {[k for k in expected if expected[k] != actual[k]]}"


def _load_fails(root: Path, model, optimizer, error: type[BaseException], match: str, verify: bool = True) -> str:
    """`load` raises `error` matching `match`, writes nothing and changes no byte; its message."""
    files, before = _files(root), live_bytes(model, optimizer)
    with pytest.raises(error, match=match) as raised:
        load(root, model, optimizer, verify=verify)
    _assert_same(before, live_bytes(model, optimizer))
    assert _files(root) == files
    return str(raised.value)


# ---- processes killed during a save: the last committed step loads, bitwise


def _pair_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))


def _save_then_die(rank, world_size, root, mode):
    """Save step 1 (committed), train, then die by SIGKILL while step 2 is being written."""
    from torchside.checkpoint import checksums

    multiprocessing.current_process().daemon = False  # run_processes' ranks are daemons: DCP's writer could not start
    topo = topology("fsdp2", _pair_mesh()) if world_size == 2 else topology("single")
    model, optimizer = build(topo, RECIPE, True, seed=1)
    train(model, optimizer, topo, RECIPE, 0, 1)
    save(root, model, optimizer, step=1, async_mode=mode).wait()
    train(model, optimizer, topo, RECIPE, 1, 1)
    if mode == "process":  # the writer is a process of its own: kill it and us once it has the state
        save(root, model, optimizer, step=2, async_mode=mode)
        for writer in multiprocessing.active_children():
            os.kill(writer.pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == world_size - 1:  # after DCP wrote this rank's shard, before its checksums and the commit
        checksums.file_checksum = lambda path: os.kill(os.getpid(), signal.SIGKILL)
    save(root, model, optimizer, step=2, async_mode=mode).wait()
    return "not killed"


def _assert_step_1_survives(root: Path) -> tuple:
    """Step 1 is the only committed step, and it loads (the unfinished step 2 reported): its model and optimizer."""
    assert commit.committed_steps(root) == [1]
    model, optimizer = build(topology("single"), RECIPE, True, seed=5)
    with pytest.warns(UserWarning, match="step-00000002.tmp"):
        result = load(root, model, optimizer)
    assert result.step == 1 and result.interrupted == (root / "step-00000002.tmp",)
    return model, optimizer


@pytest.mark.multiprocess
def test_a_rank_killed_mid_save_leaves_the_previous_step_loadable(tmp_path):
    with pytest.raises(RankError, match="Connection (closed|reset) by peer|exited with code -9"):
        run_processes(_save_then_die, 2, str(tmp_path), None, timeout=60)
    _assert_step_1_survives(tmp_path)


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", [pytest.param(None, marks=pytest.mark.grid, id="sync"), "thread", "process"])
def test_a_process_killed_mid_save_leaves_the_previous_step_exact(tmp_path, mode):
    with pytest.raises(RankError, match="exited with code -9"):
        run_processes(_save_then_die, 1, str(tmp_path), mode, timeout=120)
    loaded = gathered_state(*_assert_step_1_survives(tmp_path))
    reference = gathered_state(*_trained())  # step 1 of the same run, recomputed here
    _assert_same({k: v.tobytes() for k, v in reference.items()}, {k: v.tobytes() for k, v in loaded.items()})


# ---- damaged files: named, nothing changed


def _damage(kind: str, path: Path) -> None:
    if kind == "missing":
        path.unlink()
    elif kind == "truncated":
        os.truncate(path, path.stat().st_size // 2)
    else:  # one flipped bit in the middle: torch.load would not notice if it hits tensor bytes
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["missing", "truncated", "corrupted"])
def test_a_damaged_shard_is_named_and_the_model_is_unchanged(tmp_path, kind):
    saved_model, saved_optimizer = _trained()
    path = save(tmp_path, saved_model, saved_optimizer, step=1).path
    shard = path / "__0_0.distcp"
    _damage(kind, shard)
    _load_fails(tmp_path, *_trained(seed=2), ValueError, f"{shard}: {kind}")


def test_a_truncated_shard_read_unverified_is_a_value_error_naming_the_step(tmp_path):
    """verify=False skips the CRC32 pass: DCP's read fails instead, and says which checkpoint."""
    path = save(tmp_path, *_trained(), step=1).path
    _damage("truncated", path / "__0_0.distcp")
    _load_fails(tmp_path, *_trained(seed=2), ValueError, f"reading checkpoint {path} failed", verify=False)


def _garble_json(path: Path) -> None:
    path.write_text(path.read_text()[:-7] + "}{[")


def _without_metadata_checksum(step: Path) -> None:
    """As saved before `.metadata` had a recorded checksum."""
    metadata = json.loads((step / "shardbridge.json").read_text())
    metadata.pop(validate.DCP_METADATA_CHECKSUM, None)
    (step / "shardbridge.json").write_text(json.dumps(metadata))


def _garble_entries(path: Path) -> None:
    """Valid JSON whose entries are not what save writes: a group without its parameter names, a list of facts."""
    metadata = json.loads(path.read_text())
    metadata["param_groups"] = [{"lr": 0.1}]
    metadata["fp8_params"] = ["weight"]
    path.write_text(json.dumps(metadata))


DAMAGED_FILES = {  # name: (file, damage, message)
    "metadata-missing": (".metadata", "missing", "is missing"),
    "metadata-truncated": (".metadata", "truncated", "is damaged"),
    "metadata-flipped": (".metadata", "corrupted", "is damaged .*CRC32 differ"),
    "metadata-flipped-unrecorded": (".metadata", "first-byte", "is damaged .*UnpicklingError"),
    "metadata-truncated-unrecorded": (".metadata", "truncated-unrecorded", "is damaged"),
    "shardbridge-garbled": ("shardbridge.json", _garble_json, "is damaged .*JSONDecodeError"),
    "shardbridge-truncated": ("shardbridge.json", "truncated", "is damaged"),
    "shardbridge-not-an-object": ("shardbridge.json", lambda p: p.write_text("[1, 2]"), "JSON object was expected"),
    "shardbridge-wrong-entries": ("shardbridge.json", _garble_entries, "is damaged .*param_groups is not .*fp8_params"),
    "checksums-garbled": ("__0_checksums.json", _garble_json, "is damaged .*JSONDecodeError"),
    "checksums-wrong-entry": ("__0_checksums.json", lambda p: p.write_text('{"__0_0.distcp": 7}'), "not \\[size"),
}


@pytest.mark.parametrize("case", DAMAGED_FILES)
def test_a_damaged_metadata_file_is_named_and_the_model_is_unchanged(tmp_path, case):
    name, damage, message = DAMAGED_FILES[case]
    step = save(tmp_path, *_trained(), step=1).path
    path = step / name
    if damage == "first-byte":  # pickle's PROTO opcode: unpickling fails at once
        _without_metadata_checksum(step)
        path.write_bytes(b"\x90" + path.read_bytes()[1:])
    elif damage == "truncated-unrecorded":
        _without_metadata_checksum(step)
        _damage("truncated", path)
    else:
        damage(path) if callable(damage) else _damage(damage, path)
    text = _load_fails(tmp_path, *_trained(seed=2), ValueError, message)
    assert str(path) in text and "load another step" in text


@pytest.mark.grid
def test_any_flipped_byte_of_unrecorded_metadata_is_named_or_harmless(tmp_path):
    """Without a recorded checksum a flip can only be caught by what it breaks: every one of them is."""
    saved_model, saved_optimizer = _trained()
    step = save(tmp_path, saved_model, saved_optimizer, step=1).path
    _without_metadata_checksum(step)
    original = (step / ".metadata").read_bytes()
    expected = gathered_state(saved_model, saved_optimizer)
    model, optimizer = _trained(seed=2)
    for position in range(0, len(original), 97):
        flipped = bytearray(original)
        flipped[position] ^= 0x10
        (step / ".metadata").write_bytes(bytes(flipped))
        before = live_bytes(model, optimizer)
        try:
            load(tmp_path, model, optimizer)
        except ValueError as error:
            assert str(step) in str(error), position
            _assert_same(before, live_bytes(model, optimizer))
            continue
        loaded = gathered_state(model, optimizer)  # the flip hit bytes DCP does not use
        assert all(loaded[k].tobytes() == expected[k].tobytes() for k in expected), position
        model, optimizer = _trained(seed=2)


# ---- another model, optimizer or recipe: every difference listed, nothing changed


def test_a_wrong_model_lists_every_mismatched_key_and_is_unchanged(tmp_path):
    saved_model, saved_optimizer = _trained(fp8=False)
    save(tmp_path, saved_model, saved_optimizer, step=1)
    model, _ = _trained(seed=2)  # FP8 weights: other keys (buffers), same norms and biases
    del model[1]  # and one block fewer
    optimizer = FusedAdam([p for p in model.parameters() if not isinstance(local(p), QuantizedTensor)], **ADAM)
    message = _load_fails(tmp_path, model, optimizer, ValueError, "does not fit this model")
    assert "missing from the checkpoint: model.0.qkv.weight.rowwise_data" in message
    assert "not in the model: model.0.qkv.weight" in message
    assert "not in the model: model.1.proj.bias" in message


def test_a_model_of_other_widths_lists_every_shape_and_is_unchanged(tmp_path):
    save(tmp_path, *_trained(fp8=False), step=1)
    topo = topology("single")
    model, optimizer = build(topo, RECIPE, False, seed=2, widths=(64, 256))
    train(model, optimizer, topo, RECIPE, 0, 1)
    message = _load_fails(tmp_path, model, optimizer, ValueError, "does not fit this model")
    assert "model.0.mlp.fc1_weight: shape (128, 64) in the checkpoint, (256, 64) in the model" in message
    assert "optim.0.mlp.fc2_weight.exp_avg: shape (64, 128) in the checkpoint, (64, 256) in the model" in message


def test_a_fresh_model_and_optimizer_are_unchanged_by_a_failed_load(tmp_path):
    """torch gives a fresh optimizer its states with a step at lr 0 while building the load target."""
    save(tmp_path, *_trained(fp8=False), step=1)
    model, optimizer = build(topology("single"), RECIPE, True, seed=2)
    assert not optimizer.state
    _load_fails(tmp_path, model, optimizer, ValueError, "missing from the checkpoint: model.0.qkv.weight.rowwise_data")
    assert not optimizer.state


def _two_groups(model, optimizer):
    """The same model and optimizer settings, the biases and norms in a second group without weight decay."""
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": matrices}, {"params": others, "weight_decay": 0.0}]
    optimizer = FusedAdam(groups, master_weights=True, **ADAM)
    requantize_fp8_weights(optimizer, model)
    return model, optimizer


def test_an_optimizer_with_other_param_groups_is_refused_and_unchanged(tmp_path):
    """Issue 29, finding 2: saved with 2 groups, loaded into 1, this used to overwrite the model first."""
    topo = topology("single")
    model, optimizer = _two_groups(*build(topo, RECIPE, True, seed=1))
    train(model, optimizer, topo, RECIPE, 0, 1)
    save(tmp_path, model, optimizer, step=1)
    message = _load_fails(tmp_path, *_trained(seed=2), ValueError, "optimizer param groups: 2 in the checkpoint")
    assert "1 in the optimizer" in message


def test_another_fp8_format_with_the_same_buffers_is_refused_and_unchanged(tmp_path, monkeypatch):
    """E5M2 and E4M3 weights have the same buffer names, shapes and dtypes: only the recorded format differs."""
    monkeypatch.setitem(RECIPES, "current_e5m2", Float8CurrentScaling(fp8_format=Format.E5M2))
    save(tmp_path, *_trained(recipe="current_e5m2"), step=1)
    message = "0.qkv.weight: FP8 .*'e5m2'.* in the checkpoint"
    _load_fails(tmp_path, *_trained(seed=2, recipe="current"), ValueError, message)


# ---- a failure in the middle of the swap: rolled back


def _interrupt_optimizer_swap(*args, **kwargs):
    raise KeyboardInterrupt("Ctrl-C in the swap")  # after the model and the FP8 buffers were overwritten


def test_an_interrupt_in_the_middle_of_the_swap_changes_nothing(tmp_path, monkeypatch):
    save(tmp_path, *_trained(), step=1)
    monkeypatch.setattr(app_state, "set_optimizer_state_dict", _interrupt_optimizer_swap)
    _load_fails(tmp_path, *_trained(seed=2), KeyboardInterrupt, "Ctrl-C in the swap")


def _fail_swap_on_two_ranks(rank, world_size, root, failing_ranks):
    topo = topology("fsdp2", _pair_mesh())
    model, optimizer = build(topo, RECIPE, True, seed=1)
    train(model, optimizer, topo, RECIPE, 0, 1)
    save(root, model, optimizer, step=1)
    model, optimizer = build(topo, RECIPE, True, seed=2)
    train(model, optimizer, topo, RECIPE, 0, 2)
    before = live_bytes(model, optimizer)
    with pytest.raises(RuntimeError, match="swap failed") as raised:
        load(root, model, optimizer)
    return str(raised.value), before == live_bytes(model, optimizer)


@pytest.mark.parametrize("failing_ranks", [(0, 1), (1,)], ids=["every-rank", "one-rank"])
def test_a_failed_swap_of_fsdp2_shards_changes_no_shard_on_any_rank(tmp_path, monkeypatch, failing_ranks):
    swap = app_state.set_optimizer_state_dict

    def fail_on_some_ranks(*args, **kwargs):
        if dist.get_rank() in failing_ranks:
            raise RuntimeError("swap failed here")
        return swap(*args, **kwargs)

    monkeypatch.setattr(app_state, "set_optimizer_state_dict", fail_on_some_ranks)
    results = run_threads(_fail_swap_on_two_ranks, 2, str(tmp_path), failing_ranks)
    assert [unchanged for _, unchanged in results] == [True, True]
    expected = ["swap failed here" if r in failing_ranks else "the swap failed on 1 other rank" for r in range(2)]
    assert all(text.startswith(start) for (text, _), start in zip(results, expected, strict=True)), results


def test_latest_keep_last_and_the_metadata_are_json(tmp_path):
    model, optimizer = _trained()
    for step in (1, 2, 3):
        save(tmp_path, model, optimizer, step=step, extra={"run": "a"}, keep_last=2)
    assert commit.committed_steps(tmp_path) == [2, 3]
    fresh, fresh_optimizer = _trained(seed=2)
    result = load(tmp_path / "latest", fresh, fresh_optimizer)
    assert (result.step, result.metadata["extra"], result.interrupted) == (3, {"run": "a"}, ())
    saved, loaded = gathered_state(model, optimizer), gathered_state(fresh, fresh_optimizer)
    _assert_same({k: v.tobytes() for k, v in saved.items()}, {k: v.tobytes() for k, v in loaded.items()})
    with pytest.raises(ValueError, match="already committed"):
        save(tmp_path, model, optimizer, step=3)
    with pytest.raises(ValueError, match="no committed checkpoint"):
        load(tmp_path / "empty", fresh, fresh_optimizer)
