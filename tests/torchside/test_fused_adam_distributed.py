"""FusedAdam on DTensor parameters: FSDP2 and FSDP2 x TP on 4 ranks, DCP resharding 4 -> 2 ranks.

The seed bug: optimizer states of DTensor parameters became plain tensors, so DCP saved them as
global tensors and a reload on another topology failed with a size mismatch. Here every state must
be a DTensor placed like its parameter, training must equal a single-process run, and a checkpoint
saved on 4 ranks (dp 2 x tp 2) must reload on 2 ranks (dp 2) with identical moments and masters.
Ranks are threads (torch's threaded process group) except the one `multiprocess` test (gloo).
"""

import re

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fp8kernels.adam_reference import split_master
from tests.distributed import RankError, run_processes, run_threads
from tests.torchside.fp8_adam_runs import assert_equal_to_one_process
from tests.torchside.fp8_adam_runs import train_sharded as train_fp8_sharded
from torchside.optim import FusedAdam

BATCH, STEPS = 8, 4
OPTIMIZER = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1)
# bf16 parameters with remainder masters and a bf16 moment: every state format DCP must carry exactly.
CHECKPOINT_OPTIMIZER = dict(OPTIMIZER, master_weights=True, store_param_remainders=True, exp_avg_dtype=torch.bfloat16)


class TinyMLP(nn.Module):
    """fc1 (column parallel), fc2 (row parallel), and a 3-row parameter: on 4 shards one is empty."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.fc1 = nn.Linear(8, 16, dtype=dtype)
        self.fc2 = nn.Linear(16, 8, dtype=dtype)
        self.gain = nn.Parameter(torch.ones(3, dtype=dtype))
        generator = torch.Generator().manual_seed(0)  # not the global RNG: threads share it
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))) * self.gain.sum()


def _batch(step: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 8, generator=generator).to(dtype), torch.randn(BATCH, 8, generator=generator).to(dtype)


def _train(model, optimizer, steps, dp_rank=0, dp_size=1, dtype=torch.float32):
    """Each dp rank takes its slice of the global batch; FSDP averages grads over dp."""
    rows = slice(dp_rank * BATCH // dp_size, (dp_rank + 1) * BATCH // dp_size)
    for step in range(steps):
        x, y = _batch(step, dtype)
        loss = ((model(x[rows]) - y[rows]).float() ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _parallelize(model, mesh_shape):
    """FSDP2 over dp; with a tp dimension, torch's own Colwise/RowwiseParallel first."""
    if len(mesh_shape) == 1:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp",))
        fully_shard(model, mesh=mesh)
        return mesh
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return mesh


def _train_sharded(rank, world_size, mesh_shape):
    model = TinyMLP()
    mesh = _parallelize(model, mesh_shape)
    optimizer = FusedAdam(model.parameters(), **OPTIMIZER)
    dp_rank = mesh["dp"].get_local_rank() if len(mesh_shape) == 2 else rank
    _train(model, optimizer, STEPS, dp_rank, mesh_shape[0])
    placements, empty_states = {}, 0
    for name, param in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            state = optimizer.state[param][key]
            assert isinstance(state, DTensor), f"{name}.{key} is a {type(state).__name__}"
            layout = (state.device_mesh, state.placements, state.shape)
            assert layout == (param.device_mesh, param.placements, param.shape), f"{name}.{key}"
            assert state.to_local().shape == param.to_local().shape
            empty_states += state.to_local().numel() == 0
        placements[name] = param.placements
    full = {name: param.full_tensor() for name, param in model.named_parameters()}
    return full, placements, empty_states


def _train_single_process():
    model = TinyMLP()
    optimizer = FusedAdam(model.parameters(), **OPTIMIZER)
    _train(model, optimizer, STEPS)
    return {name: param.detach() for name, param in model.named_parameters()}


@pytest.mark.parametrize(
    ("mesh_shape", "fc1_weight_placements"),
    [((4,), "(Shard(dim=0),)"), ((2, 2), "(_StridedShard(dim=0, sf=2), Shard(dim=0))")],
    ids=["fsdp4", "fsdp2xtp2"],
)
def test_states_are_placed_like_params_and_training_matches_one_process(mesh_shape, fc1_weight_placements):
    results = run_threads(_train_sharded, 4, mesh_shape)
    expected = _train_single_process()
    for full, placements, empty_states in results:
        assert str(placements["fc1.weight"]) == fc1_weight_placements
        for name, value in full.items():
            torch.testing.assert_close(value, expected[name], rtol=1e-5, atol=1e-6)
    # gain has 3 rows on 4 dp shards: the last dp rank has an empty shard, and empty states, and steps fine.
    assert [empty for _, _, empty in results] == ([0, 0, 0, 2] if mesh_shape == (4,) else [0, 0, 0, 0])


def _save(rank, world_size, path):
    model = TinyMLP(torch.bfloat16)
    mesh = _parallelize(model, (2, 2))
    optimizer = FusedAdam(model.parameters(), **CHECKPOINT_OPTIMIZER)
    _train(model, optimizer, 3, mesh["dp"].get_local_rank(), 2, torch.bfloat16)
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _full_optimizer_state(optim_state)


def _load(rank, world_size, path):
    model = TinyMLP(torch.bfloat16)
    _parallelize(model, (2,))  # another topology: dp 2, no tp
    optimizer = FusedAdam(model.parameters(), **CHECKPOINT_OPTIMIZER)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    exported = optimizer.state_dict()["state"]
    for index, param in enumerate(model.parameters()):
        stored = optimizer.state[param]
        assert stored["exp_avg"].dtype == torch.bfloat16 and stored["master_param"].dtype == torch.int16
        assert stored["master_param"].placements == param.placements
        master = exported[index]["master_param"].to_local()
        assert torch.equal(param.to_local(), split_master(master)[0])  # the param is the master, rounded
    return _full_optimizer_state(get_state_dict(model, optimizer)[1])


def _full_optimizer_state(optim_state):
    """{fqn: {state name: global values}}, gathered from the shards; numpy, so that a gloo process
    can return it by value (a tensor would travel as shared memory that dies with the process)."""
    full = {}
    for fqn, values in optim_state["state"].items():
        full[fqn] = {}
        for key, value in values.items():
            assert key == "step" or isinstance(value, DTensor), f"{fqn}.{key} is not a DTensor"
            full[fqn][key] = (value.full_tensor() if isinstance(value, DTensor) else value).numpy(force=True)
    return full


def _assert_same_optimizer_state(saved, loaded):
    assert saved.keys() == loaded.keys()
    for fqn in saved:
        assert saved[fqn].keys() == loaded[fqn].keys() == {"step", "exp_avg", "exp_avg_sq", "master_param"}
        for key, value in saved[fqn].items():
            assert value.dtype == np.float32 and np.array_equal(loaded[fqn][key], value), f"{fqn}.{key}"


def test_dcp_saved_on_4_ranks_reloads_on_2_ranks_exactly(tmp_path):
    saved = run_threads(_save, 4, str(tmp_path))
    loaded = run_threads(_load, 2, str(tmp_path))
    for result in loaded:
        _assert_same_optimizer_state(saved[0], result)


def _save_then_train_fp8(rank, world_size, path):
    return _save(rank, world_size, path), train_fp8_sharded(rank, world_size)


def _load_then_train_fp8(rank, world_size, path):
    return _load(rank, world_size, path), train_fp8_sharded(rank, world_size)


# In CI the same functions run on threads (test_dcp_saved_on_4_ranks_reloads_on_2_ranks_exactly, and
# test_fused_adam_fp8's test_sharded_fp8_weights_equal_one_process_bit_for_bit); FusedAdam states with FP8
# weights resharded by DCP on gloo processes: checkpoint/test_resharding's launch.
@pytest.mark.grid
@pytest.mark.multiprocess
def test_gloo_processes_reshard_dcp_4_to_2_and_train_fp8_weights(tmp_path, fp8_adam_one_process):
    """The DCP test, then test_fused_adam_fp8's sharded FP8 training (FSDP(2) x TP(2), then FSDP(2)) in the
    same processes (reference kernels, inherited from the fixture: the FP8 comparison needs the same arithmetic)."""
    saved = run_processes(_save_then_train_fp8, 4, str(tmp_path))
    loaded = run_processes(_load_then_train_fp8, 2, str(tmp_path))
    _assert_same_optimizer_state(saved[0][0], loaded[1][0])
    assert_equal_to_one_process([fp8 for _, fp8 in saved], fp8_adam_one_process)
    assert_equal_to_one_process([fp8 for _, fp8 in loaded], fp8_adam_one_process)


def _mixing_fails(rank, world_size):
    model = TinyMLP()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = FusedAdam(model.parameters())
    param = model.fc1.weight
    param.grad = param.full_tensor()  # a plain tensor for a DTensor parameter
    with pytest.raises(TypeError, match="cannot be mixed"):
        optimizer.step()
    param.grad = None
    optimizer.step()  # nothing to update, but builds no state either
    plain_state = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16, 8), "exp_avg_sq": torch.zeros(16, 8)}
    state_dict = {"state": {0: plain_state}, "param_groups": optimizer.state_dict()["param_groups"]}
    with pytest.raises(TypeError, match="cannot be mixed"):
        optimizer.load_state_dict(state_dict)
    return True


def test_mixing_dtensor_and_plain_tensors_raises():
    assert run_threads(_mixing_fails, 2) == [True, True]


# ---- the seed bug, reproduced: FSDP(4) -> FSDP(2) through the optimizer's own state_dict


class OneVector(nn.Module):
    """One 256-element parameter: a 64-element shard on 4 ranks, 128 on 2 (the seed's sizes)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(-1.0, 1.0, 256))

    def forward(self, x):
        return (self.weight * x).square().sum()


def _one_vector_checkpoint(rank, world_size, path, steps, as_plain_tensors):
    """FSDP over all ranks; `steps` steps then dcp.save, or (steps=0) dcp.load; the full exp_avg after it.

    `as_plain_tensors` puts each state's local shard in the state dict, as the seed's optimizer did.
    """
    model = OneVector()
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = FusedAdam(model.parameters(), **OPTIMIZER)
    for step in range(max(steps, 1)):  # one step on a fresh optimizer makes the states a load fills in
        model(torch.linspace(0.5, 2.0, 256) * (step + 1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    state_dict = optimizer.state_dict()
    if as_plain_tensors:
        state_dict["state"] = {
            index: {key: v.to_local() if isinstance(v, DTensor) else v for key, v in state.items()}
            for index, state in state_dict["state"].items()
        }
    if steps:
        dcp.save({"optimizer": state_dict}, checkpoint_id=path)
    else:
        dcp.load({"optimizer": state_dict}, checkpoint_id=path)
        optimizer.load_state_dict(state_dict)
    return {key: optimizer.state_dict()["state"][0][key].full_tensor() for key in ("exp_avg", "exp_avg_sq")}


def test_seed_bug_fsdp4_checkpoint_loads_on_2_ranks(tmp_path):
    saved = run_threads(_one_vector_checkpoint, 4, str(tmp_path / "dtensor"), 3, False)
    loaded = run_threads(_one_vector_checkpoint, 2, str(tmp_path / "dtensor"), 0, False)
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(loaded[0][key], saved[0][key]) and torch.equal(loaded[1][key], saved[0][key])
    # The seed's plain-tensor states fail exactly as reported: the check above would catch the bug.
    run_threads(_one_vector_checkpoint, 4, str(tmp_path / "plain"), 3, True)
    message = (
        "Size mismatch between saved torch.Size([64]) and current: torch.Size([128]) "
        "for optimizer.state.0.exp_avg"
    )
    with pytest.raises(RankError, match=re.escape(message)):
        run_threads(_one_vector_checkpoint, 2, str(tmp_path / "plain"), 0, True)
