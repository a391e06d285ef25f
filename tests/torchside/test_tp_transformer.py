"""A 2-layer TransformerLayer stack under FSDP, HSDP, FSDP x TP and HSDP x TP: 5 training steps against one process.

Model: hidden 64, 4 heads in 2 GQA groups, ffn 128, LayerNorm, gelu, biases; data [S=16, B=8, 64]
(2 sequences per data-parallel rank at DP=4, 4 at DP=2), so every rank's GEMMs see 32 tokens (whole
MXFP8 tiles). The training loop and value loading are test_fsdp_tp's: SGD with momentum, FP8 weights
re-cast from fp32 masters after each step. Losses and final parameters are held to 1e-6 (fp32 sums
in another order) for FP8 off, Float8BlockScaling and MXFP8, whose power-of-2 scales do not move
with that noise; to twice one process's own quantization error (FP8 against FP8 off) for
DelayedScaling and Float8CurrentScaling, whose scales (fmax / amax, not a power of 2) move with a
1e-7 change of an amax, enough to flip an FP8 byte and feed it downstream (and current scaling
takes each DP rank's own activation amax), and for NVFP4 (per-shard global amax). On CUDA every
FP8 recipe gets the latter bound: each rank's GEMMs run at other shapes than one process's, cuBLAS
and the Triton autotuner pick another kernel per shape, so even the forward's fp32 sums differ in
the last bit and can flip an FP8 byte (measured on 2 H200s: Float8BlockScaling under FSDP2 moved
the losses 2.4e-5, the weights up to 1.2e-4).

Bitwise: none of the 5-step cases, and they cannot be: FSDP2 reduce-scatters weight gradients that
each DP rank summed over its own tokens, and row-parallel GEMMs (proj, fc2) add TP partial sums,
so the fp32 additions run in another order than one process's. (The column-parallel GEMMs alone
are bitwise: test_tensor_parallel's `test_*_exact`.)

Each mesh runs all its cases in one threaded world (the reference kernels: the Triton interpreter
is not thread-safe); the 8-rank HSDP x TP world is `slow`. The NCCL variant runs the 2-rank meshes
on 2 GPUs with the Triton kernels (`gpu`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from bridge.layout import from_dtensor
from bridge.numerics import relative_error
from tests.distributed import run_processes, run_threads
from tests.torchside.fsdp_tp_training import dp_coordinate, load_values, train
from tests.torchside.tp_stack import (
    FP32_ORDER,
    HISTORY,
    RECIPES,
    TP,
    H,
    S,
    global_values,
    load_shards,
    one_step,
    seeded,
)
from torchside.autocast import fp8_autocast, quantized_model_init
from torchside.modules import GroupedLinear, LayerNormMLP, ModuleConfig, TransformerConfig, TransformerLayer
from torchside.parallel import parallelize
from torchside.parallel._torch_compat import make_strided_shard
from torchside.quantization import FALLBACK_CALLS

HEADS, GROUPS, FFN, B = 4, 2, 128, 8
MESHES = {  # name: (shape, dim names); "tp" is the TP dim, the others data-parallel (replicate, shard)
    "fsdp2": ((2,), ("dp",)),
    "tp2": ((2,), ("tp",)),
    "fsdp4": ((4,), ("dp",)),
    "hsdp2x2": ((2, 2), ("rep", "dp")),
    "fsdp2xtp2": ((2, 2), ("dp", "tp")),
    "hsdp2x2xtp2": ((2, 2, 2), ("rep", "dp", "tp")),
}
# (recipe, FP8 weights) pairs a mesh can train. FP8 weights leave out Float8BlockScaling (FSDP2 would cut
# its 128-row weight tiles: every shard here has fewer rows) and NVFP4 (a weight cannot be re-cast
# shard by shard after fully_shard: FP8Module._weight_quantizer says so).
# Recipes whose scales move with fp32-order noise, held to twice one process's own FP8 error (docstring).
SCALES_MOVE = ("delayed", "current", "nvfp4")
RECIPE_CASES = [(r, False) for r in RECIPES] + [(r, True) for r in ("delayed", "current", "mxfp8")]
# What CI runs (the rest of every mesh's cross product is `slow`): each mesh, each recipe, SP on and
# off and FP8 weights on and off appear at least once, in about 60 s of this 2-core machine.
CI_CASES = {  # mesh: [(sequence parallel, recipe, FP8 weights)]; every recipe once, FP8 weights on each mesh
    "fsdp4": [(False, "nvfp4", False), (False, "current", True)],
    "hsdp2x2": [(False, "block", False), (False, "mxfp8", True)],
    "fsdp2xtp2": [(False, "off", False), (False, "delayed", True), (True, "delayed", False), (True, "current", True)],
    "hsdp2x2xtp2": [],
}  # fmt: skip

pytestmark = pytest.mark.usefixtures("reference_kernels")  # tests/conftest.py: what threaded ranks run


def make_stack(module_config: ModuleConfig, tp_mesh=None, device=None) -> nn.Sequential:
    config = TransformerConfig(module_config=module_config)
    return nn.Sequential(
        *(TransformerLayer(H, FFN, HEADS, num_gqa_groups=GROUPS, config=config, tp_mesh=tp_mesh, device=device)
          for _ in range(2))
    )  # fmt: skip


def _batch(step: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded((S, B, H), 100 + step).to(device), seeded((S, B, H), 200 + step).to(device)


def _to_cpu(values: dict) -> dict:
    return {name: t.detach().cpu() for name, t in values.items()}


def reference(recipe_name: str, fp8_weights: bool, device="cpu") -> tuple[dict, list[float], dict]:
    """(initial values, losses, final values) of the one-process run."""
    recipe = RECIPES[recipe_name]
    with quantized_model_init(enabled=fp8_weights, recipe=recipe):
        model = make_stack(ModuleConfig(amax_history_len=HISTORY), device=device)
    values = {n: v.to(device) for n, v in global_values(model).items()}
    load_values(model, values)
    losses, final = train(model, lambda step: _batch(step, device), recipe, None, 1)
    return _to_cpu(values), losses, _to_cpu(final)


cached_reference = functools.cache(reference)


def build_meshes(device_type: str, shape, names):
    """(world, data-parallel mesh or None, tp mesh or None, weight mesh: every rank that shards a weight)."""
    world = init_device_mesh(device_type, shape, mesh_dim_names=names)
    dp_names = tuple(n for n in names if n != "tp")
    tp = world["tp"] if "tp" in names else None
    sharding = (*dp_names[-1:], *(("tp",) if tp is not None else ()))
    weight_mesh = world[sharding]._flatten("_".join(sharding)) if len(sharding) > 1 else world[sharding[0]]
    return world, (world[dp_names] if dp_names else None), tp, weight_mesh


def train_sharded(meshes, names, sequence_parallel, recipe_name, fp8_weights, values):
    """This rank's (losses, final full values on rank 0) of the sharded run on `meshes` (build_meshes')."""
    world, dp_mesh, tp_mesh, weight_mesh = meshes
    device_type = world.device_type
    device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    tp_size = 1 if tp_mesh is None else tp_mesh.size()
    config = ModuleConfig(amax_history_len=HISTORY, tp_size=tp_size, sequence_parallel=sequence_parallel)
    with quantized_model_init(enabled=fp8_weights, recipe=RECIPES[recipe_name]):
        model = make_stack(config, tp_mesh, device=device)
    load_values(model, {n: v.to(device) for n, v in values.items()})
    parallelize(model, dp_mesh, weight_mesh=weight_mesh, device=device)
    dp_rank, dp_size = dp_coordinate(world, names) if dp_mesh is not None else (0, 1)
    tp_rank = 0 if tp_mesh is None else tp_mesh.get_local_rank()

    def batch(step):
        x, target = (t.chunk(dp_size, dim=1)[dp_rank] for t in _batch(step, device))
        if sequence_parallel:
            x, target = x.chunk(tp_size)[tp_rank], target.chunk(tp_size)[tp_rank]
        return x, target

    losses, final = train(model, batch, RECIPES[recipe_name], dist.group.WORLD, dp_size)
    duplicated = 1 if sequence_parallel else tp_size  # without SP every TP rank holds every token
    return [loss / duplicated for loss in losses], _to_cpu(final) if dist.get_rank() == 0 else None


def _mesh_cases(mesh_name: str) -> list[tuple[bool, str, bool]]:
    """(sequence parallel, recipe, FP8 weights) for every case of a mesh: SP on and off where there is TP."""
    shape, names = MESHES[mesh_name]
    sequence_parallel = (False, True) if "tp" in names else (False,)
    # FP8 MXFP8 weights shard in whole 32-row tiles: 64-row weights over 4 FSDP ranks cannot.
    fsdp_shards = shape[names.index("dp")] if "dp" in names else 1
    whole_tiles = H // fsdp_shards % 32 == 0
    return [(sp, r, fp8) for sp in sequence_parallel for r, fp8 in RECIPE_CASES if whole_tiles or (r, fp8) != ("mxfp8", True)]


def _train_cases(rank, world_size, mesh_name, cases, references, device_type="cpu"):
    """Every case of one mesh in one world: {case: (this rank's losses, final values on rank 0)}."""
    shape, names = MESHES[mesh_name]
    meshes = build_meshes(device_type, shape, names)  # once: modules compare meshes by identity
    results = {}
    for case in cases:
        _, recipe_name, fp8_weights = case
        results[case] = train_sharded(meshes, names, *case, references[recipe_name, fp8_weights][0])
    return results


def _bounds(recipe_name: str, fp8_weights: bool, references, device_type: str) -> tuple[float, dict[str, float]]:
    """(loss bound, parameter bounds): fp32 order, or twice one process's own FP8 error (module docstring)."""
    _, expected_losses, expected = references[recipe_name, fp8_weights]
    fp8_bytes_can_flip = recipe_name in SCALES_MOVE or (device_type == "cuda" and recipe_name != "off")
    if not fp8_bytes_can_flip:
        return FP32_ORDER, dict.fromkeys(expected, FP32_ORDER)
    _, high_precision_losses, high_precision = references["off", False]
    loss_bound = 2 * max(abs(a - b) / b for a, b in zip(expected_losses, high_precision_losses, strict=True))
    return loss_bound, {n: 2 * relative_error(expected[n], high_precision[n]) for n in expected}


def check_mesh(mesh_name: str, references: dict, results_per_rank: list[dict], device_type: str = "cpu") -> None:
    """Every case's losses (every rank) and final parameters (rank 0) within its bounds."""
    failures = []
    for case, (_, final) in results_per_rank[0].items():
        _, recipe_name, fp8_weights = case
        _, expected_losses, expected = references[recipe_name, fp8_weights]
        loss_bound, bounds = _bounds(recipe_name, fp8_weights, references, device_type)
        loss_error = max(
            abs(a - b) / b for results in results_per_rank for a, b in zip(results[case][0], expected_losses)
        )
        errors = {n: relative_error(final[n], expected[n]) for n in expected}
        bad = {n: f"{e:.1e} > {bounds[n]:.1e}" for n, e in errors.items() if e > bounds[n]}
        if loss_error > loss_bound or bad:
            failures.append(f"{mesh_name} {case}: loss {loss_error:.1e} (bound {loss_bound:.1e}) {bad}")
    assert not failures, "\n".join(failures)


def _test_cases() -> list:
    """(mesh, its cases) params: the CI subset of each mesh, then the rest of its cross product as `slow`."""
    params = []
    for mesh_name, ci in CI_CASES.items():
        rest = [case for case in _mesh_cases(mesh_name) if case not in ci]
        if ci:
            params.append(pytest.param(mesh_name, ci, id=f"{mesh_name}-ci"))
        params.append(pytest.param(mesh_name, rest, id=f"{mesh_name}-rest", marks=[pytest.mark.slow, pytest.mark.grid]))
    return params


@pytest.mark.parametrize("mesh_name, cases", _test_cases())
def test_five_steps_of_a_transformer_stack_match_one_process(mesh_name, cases):
    references = {key: cached_reference(*key) for key in {(r, fp8) for _, r, fp8 in cases} | {("off", False)}}
    fallbacks = sum(FALLBACK_CALLS.values())
    world_size = math.prod(MESHES[mesh_name][0])
    results = run_threads(_train_cases, world_size, mesh_name, cases, references, timeout=900)
    assert sum(FALLBACK_CALLS.values()) == fallbacks, "an FP8 weight went through the dequantize fallback"
    check_mesh(mesh_name, references, results)



# ---- the other modules' splits: GroupedLinear (column, row), the gated LayerNormMLP

SPLITS = [32, 0, 64]  # rows per expert: whole MXFP8 tiles, one expert empty
T = sum(SPLITS)


def _grouped_step(module, x, dy, recipe):
    x = x.clone().requires_grad_()
    with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=dist.group.WORLD):
        y = module(x, SPLITS)
    y.backward(dy)
    grads = {n: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for n, p in module.named_parameters()}
    return {"y": y.detach(), "dx": x.grad} | grads


def _split_steps(rank, world_size, recipe_name, values):
    """{module: (this rank's step with its tensors split like the module, parameter placements)}."""
    tp_mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    config = ModuleConfig(amax_history_len=HISTORY, tp_size=world_size)
    recipe = RECIPES[recipe_name]
    x, dy = seeded((T, H), 1), seeded((T, FFN), 2)
    found = {}
    for mode in ("column", "row"):
        experts = GroupedLinear(3, H, FFN, config=dataclasses.replace(config, parallel_mode=mode), tp_mesh=tp_mesh)
        load_shards(experts, values["grouped"])
        x_in, dy_in = (x, dy.chunk(world_size, -1)[rank]) if mode == "column" else (x.chunk(world_size, -1)[rank], dy)
        found[f"grouped {mode}"] = _grouped_step(experts, x_in, dy_in, recipe), _placements(experts)
    sequence_parallel = dataclasses.replace(config, sequence_parallel=True)
    mlp = LayerNormMLP(H, FFN, activation="swiglu", config=sequence_parallel, tp_mesh=tp_mesh)
    load_shards(mlp, values["swiglu"])
    x, dy = (seeded((S, B, H), seed).chunk(world_size)[rank] for seed in (1, 2))
    found["swiglu"] = one_step(mlp, x, dy, recipe, dist.group.WORLD), _placements(mlp)
    return found


def _placements(module) -> dict:
    return {n: p.placements for n, p in module.named_parameters()}


def _one_process_steps(recipe_name):
    recipe = RECIPES[recipe_name]
    config = ModuleConfig(amax_history_len=HISTORY)
    experts, mlp = GroupedLinear(3, H, FFN, config=config), LayerNormMLP(H, FFN, activation="swiglu", config=config)
    values = {"grouped": global_values(experts), "swiglu": global_values(mlp)}
    load_shards(experts, values["grouped"])
    load_shards(mlp, values["swiglu"])
    expected = {"grouped": _grouped_step(experts, seeded((T, H), 1), seeded((T, FFN), 2), recipe),
                "swiglu": one_step(mlp, seeded((S, B, H), 1), seeded((S, B, H), 2), recipe)}  # fmt: skip
    return values, expected


# What each rank's tensors are of the one-process ones: (y split dim, dx split dim); None = whole.
SPLIT_DIMS = {"grouped column": (-1, None), "grouped row": (None, -1), "swiglu": (0, 0)}


@pytest.mark.parametrize("recipe_name", ["off", "current", "mxfp8"])
def test_grouped_linear_and_gated_mlp_split_over_tp_match_one_process(recipe_name):
    values, expected = _one_process_steps(recipe_name)
    gated = Shard(0)  # fc1's rows alternate gate, up: a contiguous chunk holds whole pairs
    want_placements = {
        "grouped column": {f"{k}{g}": (Shard(0),) for k in ("weight", "bias") for g in range(3)},
        "grouped row": {f"{k}{g}": p for k, p in (("weight", (Shard(1),)), ("bias", (Replicate(),))) for g in range(3)},
        "swiglu": {"layer_norm_weight": (Replicate(),), "layer_norm_bias": (Replicate(),), "fc1_weight": (gated,),
                   "fc1_bias": (gated,), "fc2_weight": (Shard(1),), "fc2_bias": (Replicate(),)},
    }  # fmt: skip
    failures = []
    for rank, found in enumerate(run_threads(_split_steps, TP, recipe_name, values)):
        for name, (result, placements) in found.items():
            assert placements == want_placements[name], name
            want = dict(expected[name.split()[0]])
            for key, dim in zip(("y", "dx"), SPLIT_DIMS[name], strict=True):
                want[key] = want[key] if dim is None else want[key].chunk(TP, dim)[rank]
            errors = {k: relative_error(result[k], want[k]) for k in want}
            failures += [f"rank {rank} {name} {k}: {e:.1e}" for k, e in errors.items() if e > FP32_ORDER]
    assert not failures, failures


# ---- bad input, and FSDP2 over a gated fc1


def _gated_fsdp_and_bad_inputs(rank, world_size):
    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp4 = ModuleConfig(tp_size=4)
    column = ModuleConfig(tp_size=2, parallel_mode="column")
    layer = functools.partial(TransformerLayer, H, FFN, HEADS, num_gqa_groups=GROUPS)
    swiglu = TransformerConfig(activation="swiglu", module_config=ModuleConfig(tp_size=2))
    cases = {
        "tp size": lambda: layer(config=TransformerConfig(module_config=tp4), tp_mesh=world["tp"]),
        "2-D tp": lambda: layer(config=TransformerConfig(module_config=ModuleConfig(tp_size=2)), tp_mesh=world),
        "gqa groups": lambda: layer(num_gqa_groups=1, config=TransformerConfig(module_config=ModuleConfig(tp_size=2))),
        "layer mode": lambda: layer(config=TransformerConfig(module_config=column)),
        "experts sp": lambda: GroupedLinear(2, H, FFN, config=dataclasses.replace(column, sequence_parallel=True)),
        "experts recipe": lambda: _experts_under(GroupedLinear(2, H, 96, config=column, tp_mesh=world["tp"])),
    }
    messages = {}
    for name, build in cases.items():
        try:
            build()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    model = parallelize(layer(config=swiglu, tp_mesh=world["tp"]), world["dp"])  # biases included
    fc1 = model.layernorm_mlp.fc1_weight
    values = torch.arange(fc1.numel(), dtype=torch.float32).reshape(fc1.shape)
    with torch.no_grad():
        fc1.to_local().copy_(values[from_dtensor(fc1).selectors(tuple(world.get_coordinate()))])
    model.unshard()  # FSDP2's all-gather must rebuild this rank's TP chunk: whole (gate, up) row pairs
    gathered = torch.equal(model.layernorm_mlp.fc1_weight.to_local(), values.chunk(2)[world["tp"].get_local_rank()])
    model.reshard()
    return messages, fc1.placements, torch.equal(fc1.full_tensor(), values), gathered


def _experts_under(module):
    with fp8_autocast(recipe=RECIPES["mxfp8"]):
        module(torch.ones(32, H), [32, 0])


def test_bad_tp_inputs_say_what_to_do_and_fsdp_shards_a_gated_fc1_like_any_column_weight():
    expected = {
        "tp size": "ModuleConfig(tp_size=2)",
        "2-D tp": "pass a 1-D mesh",
        "gqa groups": "num_gqa_groups=1 (key/value heads) does not divide by tp_size=2",
        "layer mode": "leave parallel_mode None",
        "experts sp": "sequence_parallel=False",
        "experts recipe": "multiple of 32 * tp_size",
    }
    for messages, placements, full, gathered in run_threads(_gated_fsdp_and_bad_inputs, 4):
        assert {k: expected[k] in v for k, v in messages.items()} == dict.fromkeys(expected, True), messages
        assert placements == (make_strided_shard(0, 2), Shard(0))  # FSDP2 over TP's Shard(0): split factor tp
        assert full and gathered


# ---- NCCL on 2 GPUs: the 2-rank meshes, every case, Triton kernels


def _nccl_parity(rank, world_size, mesh_name, cases):
    device = torch.device("cuda", rank)
    keys = {(r, fp8) for _, r, fp8 in cases} | {("off", False)}
    references = {key: reference(*key, device=device) for key in keys}  # on this rank's GPU, same kernels
    return references, _train_cases(rank, world_size, mesh_name, cases, references, "cuda")


@pytest.mark.gpu
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (ask the device tool for nvidia-h200-x2)")
@pytest.mark.parametrize("mesh_name", ["fsdp2", "tp2"])
def test_nccl_on_two_gpus_matches_one_process(mesh_name):
    per_rank = run_processes(_nccl_parity, 2, mesh_name, _mesh_cases(mesh_name), backend="nccl", timeout=600)
    check_mesh(mesh_name, per_rank[0][0], [results for _, results in per_rank], "cuda")
