"""Tensor parallelism inside the modules (2 threaded ranks, no FSDP), against one process on the same data.

The model is a 2-block stack standing in for TransformerLayer (whose TP comes later): each block is
x + Linear_row(LayerNormLinear_column(x)) (the attention's column/row pair), then x + LayerNormMLP(x).
Weights come from one seeded global tensor per parameter, cut by the placement table (so a wrong
table entry shows up as a wrong result); inputs and output grads are seeded globals, split by
sequence parallelism along dim 0 ([S, B, H]). Threads share torch's global RNG: every random
value here comes from an explicit Generator.

Bitwise (`test_*_exact`): with a per-tensor recipe the column-parallel GEMMs see the same FP8
operands as one process (amaxes reduced where a tensor is split), so their outputs and weight
grads are identical; the FP8-byte all-gather equals gathering high precision then casting.

Elsewhere only the order of fp32 sums differs (row-parallel partial sums, TP all-reduces), and the
stack matches within 1e-6 for recipes whose scales do not move with that noise (FP8 off, delayed,
block, MXFP8). Two are held to their own quantization error instead (twice the distance between
one-process FP8 and high precision): Float8CurrentScaling, where one FP8 byte flipped by a 1e-7
difference can hold the amax and re-scale every tensor downstream (one block alone is exact), and
NVFP4, whose activation shards each take their own global amax (only weights share one over their
amax group).
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from bridge.numerics import relative_error
from tests.distributed import run_threads
from tests.torchside.tp_stack import (
    FP32_ORDER,
    HELD_TO_OWN_ERROR,
    HISTORY,
    RECIPES,
    TP,
    B,
    F,
    H,
    S,
    global_values,
    load_shards,
    make_stack,
    one_step,
    seeded,
)
from torchside.autocast import fp8_autocast
from torchside.modules import LayerNorm, LayerNormLinear, LayerNormMLP, Linear, ModuleConfig, RMSNorm
from torchside.parallel import tp_comm
from torchside.quantization import Quantizer
from torchside.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

pytestmark = pytest.mark.usefixtures("reference_kernels")  # tests/conftest.py: what threaded ranks run


def _tp_step(rank, world_size, recipe, sequence_parallel, reference_values, fp8_all_gather=True):
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config = ModuleConfig(
        amax_history_len=HISTORY, tp_size=world_size, sequence_parallel=sequence_parallel, fp8_all_gather=fp8_all_gather
    )
    model = make_stack(config, tp_mesh)
    load_shards(model, reference_values)
    x, dy = seeded((S, B, H), 1), seeded((S, B, H), 2)
    if sequence_parallel:
        x, dy = x.chunk(world_size)[rank], dy.chunk(world_size)[rank]
    result = one_step(model, x, dy, recipe, dist.group.WORLD)
    params = dict(model.named_parameters())
    wrong_grads = [n for n, p in params.items() if not isinstance(p.grad, DTensor) or p.grad.placements != p.placements]
    return result, wrong_grads


def _reference_step(recipe) -> tuple[dict, dict]:
    model = make_stack(ModuleConfig(amax_history_len=HISTORY))
    values = global_values(model)
    load_shards(model, values)
    return values, one_step(model, seeded((S, B, H), 1), seeded((S, B, H), 2), recipe)


def _split_tokens(result: dict, sequence_parallel: bool, rank: int) -> dict:
    if not sequence_parallel:
        return result
    return result | {k: result[k].chunk(TP)[rank] for k in ("y", "dx")}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
@pytest.mark.parametrize("recipe_name", RECIPES)
def test_one_step_matches_one_process(recipe_name, sequence_parallel):
    recipe = RECIPES[recipe_name]
    values, expected = _reference_step(recipe)
    results = run_threads(_tp_step, TP, recipe, sequence_parallel, values)
    if recipe_name in HELD_TO_OWN_ERROR:
        _, high_precision = _reference_step(None)
        bound = {k: 2 * relative_error(expected[k], high_precision[k]) for k in expected}
    else:
        bound = dict.fromkeys(expected, FP32_ORDER)
    for rank, (result, wrong_grads) in enumerate(results):
        assert wrong_grads == [], "grads must be DTensors with their parameter's placements"
        want = _split_tokens(expected, sequence_parallel, rank)
        errors = {k: relative_error(result[k], want[k]) for k in want}
        assert all(errors[k] <= bound[k] for k in errors), {k: f"{e:.1e}" for k, e in errors.items() if e > bound[k]}


def _column_step(rank, world_size, recipe, values):
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config = ModuleConfig(amax_history_len=HISTORY, tp_size=world_size, parallel_mode="column", sequence_parallel=True)
    module = LayerNormLinear(H, F, config=config, tp_mesh=tp_mesh)
    load_shards(module, values)
    x, dy = seeded((S, B, H), 1).chunk(world_size)[rank], seeded((S, B, F), 2).chunk(world_size, dim=-1)[rank]
    result = one_step(module, x, dy, recipe, dist.group.WORLD)
    return result | {"local weight grad": module.weight.grad.to_local()}


@pytest.mark.parametrize("recipe_name", ["delayed", "current"])
def test_column_parallel_fp8_gemms_are_exact(recipe_name):
    recipe = RECIPES[recipe_name]
    module = LayerNormLinear(H, F, config=ModuleConfig(amax_history_len=HISTORY))
    params = module.named_parameters()
    values = {n: seeded(p.shape, i) * 0.05 + n.endswith("norm_weight") for i, (n, p) in enumerate(params)}
    load_shards(module, values)
    expected = one_step(module, seeded((S, B, H), 1), seeded((S, B, F), 2), recipe)
    for rank, result in enumerate(run_threads(_column_step, TP, recipe, values)):
        assert torch.equal(result["y"], expected["y"].chunk(TP, dim=-1)[rank])
        assert torch.equal(result["local weight grad"], expected["weight"].chunk(TP)[rank])
        assert torch.equal(result["bias"], expected["bias"])


# Per rank, the amax all-reduces of one step of the stack (2 blocks of 2 column and 2 row GEMMs), by how many
# amaxes each carries. Float8CurrentScaling reduces every split tensor's amax, one all-reduce per GEMM in
# the forward (input and weight together; an input gathered in high precision is whole: weight only) and
# one per column GEMM's output grad. DelayedScaling reduces once per region instead (larger all-reduces).
AMAX_ALL_REDUCES = {
    ("current", True): {2: 8, 1: 4},
    ("current", False): {2: 4, 1: 8},
    ("delayed", True): {},
    ("delayed", False): {},
}


@pytest.mark.parametrize("recipe_name", ["current", "delayed"])
def test_fp8_all_gather_sends_bytes_reduces_amaxes_once_per_gemm_and_equals_high_precision_exact(
    recipe_name, monkeypatch
):
    values, _ = _reference_step(None)
    gathered: list[tuple[int, torch.dtype]] = []
    amax_sizes: list[tuple[int, int]] = []
    lock = threading.Lock()
    original_gather, original_all_reduce = tp_comm.all_gather_dim0, dist.all_reduce

    def logged_gather(t, group):
        with lock:
            gathered.append((dist.get_rank(), t.dtype))
        return original_gather(t, group)

    def logged_all_reduce(t, *args, **kwargs):
        if t.numel() <= 2:  # amaxes (the norm grads' all-reduces carry H values)
            with lock:
                amax_sizes.append((dist.get_rank(), t.numel()))
        return original_all_reduce(t, *args, **kwargs)

    monkeypatch.setattr(tp_comm, "all_gather_dim0", logged_gather)
    monkeypatch.setattr(dist, "all_reduce", logged_all_reduce)
    results, dtypes = {}, {}
    for fp8_all_gather in (True, False):
        gathered.clear()
        amax_sizes.clear()
        results[fp8_all_gather] = run_threads(_tp_step, TP, RECIPES[recipe_name], True, values, fp8_all_gather)
        dtypes[fp8_all_gather] = sorted(str(dtype) for rank, dtype in gathered if rank == 0)
        sizes = collections.Counter(size for rank, size in amax_sizes if rank == 0)
        assert sizes == AMAX_ALL_REDUCES[recipe_name, fp8_all_gather], (fp8_all_gather, sizes)
    # forward: the input of each column GEMM (2 per block); backward: dy of each row GEMM (2 per block)
    assert dtypes == {True: ["torch.float32"] * 4 + ["torch.uint8"] * 4, False: ["torch.float32"] * 8}
    for (with_fp8, _), (with_high_precision, _) in zip(results[True], results[False], strict=True):
        assert all(torch.equal(with_fp8[k], with_high_precision[k]) for k in with_fp8)


def test_a_given_amax_needs_a_quantizer_that_reduces_one():
    quantizer = Quantizer(Float8CurrentScaling(), "input")  # no amax group
    with pytest.raises(ValueError, match="reduces none"):
        quantizer.quantize(torch.ones(4, 16), amax=torch.ones(1))


def _norm_step(rank, world_size, norm_class, values):
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    module = norm_class(H, config=ModuleConfig(tp_size=world_size, sequence_parallel=True), tp_mesh=tp_mesh)
    load_shards(module, values)
    x, dy = seeded((S, B, H), 1).chunk(world_size)[rank], seeded((S, B, H), 2).chunk(world_size)[rank]
    return one_step(module, x, dy, None)


@pytest.mark.parametrize("norm_class", [LayerNorm, RMSNorm])
def test_sequence_parallel_norms_sum_their_grads_over_tp(norm_class):
    module = norm_class(H)
    values = {n: seeded(p.shape, 7) * 0.1 + 1 for n, p in module.named_parameters()}
    load_shards(module, values)
    expected = one_step(module, seeded((S, B, H), 1), seeded((S, B, H), 2), None)
    for rank, result in enumerate(run_threads(_norm_step, TP, norm_class, values)):
        assert torch.equal(result["y"], expected["y"].chunk(TP)[rank])
        for name, _ in module.named_parameters():
            assert relative_error(result[name], expected[name]) <= FP32_ORDER


def _group_only_and_frozen(rank, world_size, values, x):
    column = ModuleConfig(tp_group=dist.group.WORLD, parallel_mode="column")  # a group, no mesh: plain shards
    plain = Linear(H, F, config=column)
    load_shards(plain, {n: v.chunk(world_size)[rank] for n, v in values.items()})
    frozen = Linear(H, F, config=column, tp_mesh=init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",)))
    load_shards(frozen, values)
    frozen.weight.requires_grad_(False)
    x = x.clone().requires_grad_()
    frozen(x).sum().backward()
    return {
        "plain shards": [type(p).__name__ for p in plain.parameters()],
        "plain output": plain(x).detach(),
        "frozen weight grad": frozen.weight.grad,
        "bias grad": (type(frozen.bias.grad).__name__, frozen.bias.grad.placements),
        "input grad": x.grad is not None,
    }


def test_a_tp_group_alone_gives_plain_shards_and_frozen_dtensor_weights_stay_frozen():
    reference = Linear(H, F)
    values = {n: seeded(p.shape, 3) for n, p in reference.named_parameters()}
    load_shards(reference, values)
    x = seeded((S, H), 4)
    expected = reference(x).detach()
    for rank, result in enumerate(run_threads(_group_only_and_frozen, TP, values, x)):
        assert result.pop("plain shards") == ["Parameter", "Parameter"]
        assert torch.equal(result.pop("plain output"), expected.chunk(TP, dim=-1)[rank])
        assert result == {"frozen weight grad": None, "bias grad": ("DTensor", (Shard(0),)), "input grad": True}


# (module, parameter) -> (placement on the TP mesh, global shape): docs/design.md's table for Linear(8, 16) & co.
EXPECTED_PLACEMENTS = {
    "column": {"weight": (Shard(0), (16, 8)), "bias": (Shard(0), (16,))},
    "row": {"weight": (Shard(1), (16, 8)), "bias": (Replicate(), (16,))},
    "replicated": {"weight": (Replicate(), (16, 8)), "bias": (Replicate(), (16,))},
    "layernorm_linear": {
        "layer_norm_weight": (Replicate(), (8,)),
        "layer_norm_bias": (Replicate(), (8,)),
        "weight": (Shard(0), (16, 8)),
        "bias": (Shard(0), (16,)),
    },
    "mlp": {
        "layer_norm_weight": (Replicate(), (8,)),
        "layer_norm_bias": (Replicate(), (8,)),
        "fc1_weight": (Shard(0), (16, 8)),
        "fc1_bias": (Shard(0), (16,)),
        "fc2_weight": (Shard(1), (8, 16)),
        "fc2_bias": (Replicate(), (8,)),
    },
    "rmsnorm": {"weight": (Replicate(), (8,))},
}


def _placements(rank, world_size):
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config = ModuleConfig(tp_size=world_size)
    column, row = (dataclasses.replace(config, parallel_mode=mode) for mode in ("column", "row"))
    modules = {
        "column": Linear(8, 16, config=column),
        "row": Linear(8, 16, config=row),
        "replicated": Linear(8, 16, config=config),
        "layernorm_linear": LayerNormLinear(8, 16, config=column),
        "mlp": LayerNormMLP(8, 16, config=config),
        "rmsnorm": RMSNorm(8, config=config),
    }
    found = {}
    for key, module in modules.items():
        module.set_device_mesh(tp_mesh=tp_mesh)
        params = module.named_parameters()
        aranges = {n: torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) for n, p in params}
        load_shards(module, aranges)
        for name, param in module.named_parameters():
            found[f"{key}.{name}"] = {
                "placements": param.placements,
                "global shape": tuple(param.shape),
                # DTensor's own view of what the shard map put on each rank
                "gathers back": torch.equal(param.full_tensor(), aranges[name]),
            }
    return found


def test_placements_follow_the_table_and_the_shard_map():
    for found in run_threads(_placements, TP):
        expected = {
            f"{key}.{name}": {"placements": (placement,), "global shape": shape, "gathers back": True}
            for key, params in EXPECTED_PLACEMENTS.items()
            for name, (placement, shape) in params.items()
        }
        assert found == expected


def _bad_meshes(rank, world_size):
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    column = ModuleConfig(tp_size=2, parallel_mode="column")
    cases = {
        "size": lambda: Linear(8, 8, config=ModuleConfig(tp_size=4, parallel_mode="column"), tp_mesh=world["tp"]),
        "2-D tp": lambda: Linear(8, 8, config=column, tp_mesh=world),
        "2-D weight": lambda: Linear(8, 8, config=column, weight_mesh=world),
        "no group": lambda: Linear(8, 8, config=column)(torch.ones(2, 8)),
        "recipe": lambda: _forward_under(Linear(8, 96, config=column, tp_mesh=world["tp"]), MXFP8BlockScaling()),
        "delayed group": lambda: _forward_under(
            LayerNormLinear(64, 64, config=dataclasses.replace(column, sequence_parallel=True), tp_mesh=world["tp"]),
            DelayedScaling(amax_history_len=1024),
        ),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return messages


def _forward_under(module, recipe):
    with fp8_autocast(recipe=recipe):
        module(torch.ones(32, module.in_features))


def test_bad_meshes_and_shapes_say_what_to_do():
    expected = {
        "size": "ModuleConfig(tp_size=2)",
        "2-D tp": "pass a 1-D mesh",
        "2-D weight": "pass a 1-D mesh",
        "no group": "set_device_mesh(tp_mesh=...)",
        "recipe": "multiple of 32 * tp_size",
        "delayed group": "amax_reduction_group",
    }
    for messages in run_threads(_bad_meshes, 4):
        assert {k: expected[k] in v for k, v in messages.items()} == dict.fromkeys(expected, True), messages
