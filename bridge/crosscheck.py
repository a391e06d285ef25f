"""`verify` on a tensor-parallel mesh: the same model, weights and inputs in torch and JAX, sharded alike.

`shardbridge verify` runs the stacks through bridge.compare (bridge/model_compare/stacks.py) on meshes
without tp. This check stays for tp > 1 because compare runs whole models only: it checks what
compare cannot, that both frameworks split every parameter and activation alike over TP (and
FSDP/HSDP) and compute the same numbers from those shards (the "layout" check and the shard-by-shard
comparisons below). tests/bridge/test_runtime.py also runs it on data-parallel meshes.

Runs inside co-located processes (bridge.runtime). Per case (model, mesh, recipes, steps):

1. the torchside stack is built on meta, `parallelize`d over the torch mesh (FSDP or HSDP on the
   data axes, TP on `tp`) and loaded with seeded global values, each rank copying its shard;
2. its jaxside twin is placed by jaxside's rules on the JAX mesh of the same devices; the check
   "layout" compares, per parameter, where torch keeps it with where JAX does (transposed for a
   kernel); the torch shards then cross zero-copy (bridge.transfer) and map through
   bridge.params' rules into the JAX model;
3. every step both take the same batch (each DP rank its columns of a seeded [S, B, H] global;
   JAX the global array those columns form) and the output gradient dy, run forward and backward
   (torch: FSDP2 summing gradients over DP; JAX: d(sum(y * dy)) under jit), and FusedAdam /
   jaxside.optim.fused_adam steps; compared, in this order: each block's output, the input
   gradient, each weight gradient, each parameter and Adam moment after the step
   (bridge.numerics' tolerances, shard by shard).

JAX, Flax and jaxside are imported inside the functions that use them: each worker imports this
module when it unpickles `verify`, before bridge.runtime.initialize has chosen JAX's platform, and
JAX reads JAX_PLATFORMS once, when it is imported.
"""

from __future__ import annotations

import ctypes
import gc
import math
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

from bridge import layout, params, transfer, twins
from bridge.numerics import RECIPES, TensorCheck, VerifyReport, collect, tolerance
from bridge.runtime import jax_mesh
from torchside.autocast import fp8_autocast
from torchside.models.llama_parallel import LlamaMeshes, sum_data_parallel_gradients
from torchside.optim import FusedAdam
from torchside.parallel import parallelize
from twinspec.mesh import DP_REPLICATE, DP_SHARD, MESH_AXES, TP, MeshShape
from twinspec.plan import DEFAULT_PLAN, Plan
from twinspec.recipe import Recipe, recipe_from_name

HISTORY = 4  # DelayedScaling amax history rows
SEQUENCE, BATCH = 16, 8  # tokens per rank: SEQUENCE * BATCH / DP (a multiple of 32 for MXFP8's token blocks)
LR = 1e-3
ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")  # compared, and handed to the JAX twin after each step


@dataclass(frozen=True)
class VerifyCase:
    """One mesh and model, checked under each recipe for `steps` steps."""

    model: str
    layers: int
    hidden: int
    mesh: MeshShape
    recipes: tuple[str, ...]
    steps: int
    plan: Plan = DEFAULT_PLAN  # placement plan of both twins

    def __post_init__(self) -> None:
        unknown = [r for r in self.recipes if r not in RECIPES]
        if unknown or not self.recipes:
            raise ValueError(f"recipes {list(self.recipes)}: use some of {', '.join(RECIPES)}")
        if self.steps < 1:
            raise ValueError(f"steps={self.steps}: run at least 1")
        if BATCH % self.mesh.data_parallel_size:
            raise ValueError(
                f"mesh {self.mesh}: the batch of {BATCH} must divide over {self.mesh.data_parallel_size} DP ranks"
            )
        twins.check_spec(self.spec)

    @property
    def spec(self) -> twins.TwinSpec:
        return twins.TwinSpec(self.model, self.layers, self.hidden, self.mesh.tp, HISTORY, self.plan)


def case_recipe(name: str) -> Recipe | None:
    """The recipe object both frameworks run for a recipe name (delayed: verify's history length); None for off."""
    options = {"amax_history_len": HISTORY} if name == "delayed" else {}
    return recipe_from_name(name, **options)


def verify(runtime, cases: Sequence[VerifyCase], rules: Iterable[params.Rule] = params.RULES) -> list[dict]:
    """Every case and recipe in these processes; the JSON reports (the same on every rank)."""
    rules = tuple(rules)
    reports = []
    total = sum(len(case.recipes) for case in cases)
    for case in cases:
        if case.mesh.world_size != runtime.world_size:
            raise ValueError(
                f"mesh {case.mesh} needs {case.mesh.world_size} processes; {runtime.world_size} are running"
            )
        world = init_device_mesh(runtime.device_type, case.mesh.sizes, mesh_dim_names=MESH_AXES)
        mesh = jax_mesh(world)
        for recipe in case.recipes:
            started = time.perf_counter()
            report = _verify_recipe(runtime, world, mesh, case, recipe, rules)
            reports.append(report.to_json())
            _release_programs()
            if runtime.rank == 0:  # progress on long grids (the tables come at the end)
                first = report.first_divergence
                verdict = "passed" if report.passed else (
                    f"DIVERGED at {first.name} ({first.stage}, step {first.step}: relative {first.relative:.2e} "
                    f"against {first.tolerance.relative}, max abs {first.max_abs:.2e} against {first.tolerance.max_abs})"
                )  # fmt: skip
                print(f"verify [{len(reports)}/{total}] {case.mesh} {recipe}: {verdict} "
                      f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    return reports


def _release_programs() -> None:
    """Drop the recipe's compiled JAX programs and hand the heap their compiles freed back to the OS.

    XLA's CPU compile of a step peaks high and glibc keeps what it frees: NVFP4's 57k-line step took
    a process from 0.7 to 5.0 GiB and it stayed there (0.86 GiB after malloc_trim), so a 4-process
    grid of 12 cases was OOM-killed on a 23 GiB machine at its last case. Without the programs
    (CPU, dp=2, 7 cases) rank 0 grew 1.91 -> 1.95 GiB over the last five, 1.65 -> 2.13 with them kept.
    """
    import jax

    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc (macOS): its allocator returns memory on its own
        pass


@dataclass
class _Twins:
    torch_model: Any
    jax_model: Any
    pairs: list[params.ParamPair]
    shardings: dict[tuple, Any]  # JAX path -> where the JAX model keeps the parameter
    meshes: Any  # torchside's LlamaMeshes: the world mesh and its data and TP parts


def _verify_recipe(runtime, world, mesh, case: VerifyCase, recipe: str, rules) -> VerifyReport:
    from flax import nnx

    from jaxside.optim import fused_adam

    report = VerifyReport(case.model, str(case.mesh), recipe, case.steps, runtime.torch_device.type)
    fp8_recipe = case_recipe(recipe)
    models = _build_twins(runtime, world, mesh, case, rules, report)
    torch_optimizer = FusedAdam(models.torch_model.parameters(), lr=LR)
    jax_optimizer = nnx.Optimizer(models.jax_model, fused_adam(LR), wrt=nnx.Param)
    jax_step = _jax_step(fp8_recipe)
    for step in range(case.steps):
        x_local, dy_local = _batch(models.meshes, step, case.hidden, runtime.torch_device)
        x = x_local.clone().requires_grad_()
        with fp8_autocast(enabled=fp8_recipe is not None, recipe=fp8_recipe, amax_reduction_group=dist.group.WORLD):
            y, torch_outputs = models.torch_model(x)
        y.backward(dy_local)
        sum_data_parallel_gradients(models.torch_model, models.meshes)  # as JAX's: the full batch's sum
        jax_x, jax_dy = (_activation_to_jax(t, world, mesh) for t in (x_local, dy_local))
        jax_outputs, jax_dx, jax_grads = jax_step(models.jax_model, jax_optimizer, jax_x, jax_dy)
        replicas = case.mesh.tp  # activations are whole on every TP rank
        forward = [
            (f"layers.{i}", _activation_from_jax(out, world), theirs.detach(), replicas)
            for i, (out, theirs) in enumerate(zip(jax_outputs, torch_outputs))
        ]
        common = {"lr": LR, "steps_taken": step}
        collect(report, step, "forward", forward, **common)
        collect(
            report, step, "input_grad", [("input", _activation_from_jax(jax_dx, world), x.grad, replicas)], **common
        )
        torch_params = dict(models.torch_model.named_parameters())
        grads = {name: p.grad for name, p in torch_params.items()}
        collect(report, step, "weight_grad", _param_entries(models, _flat(jax_grads), grads), **common)
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)
        common["steps_taken"] = step + 1
        jax_params = params.jax_parameters(models.jax_model)
        collect(report, step, "param", _param_entries(models, jax_params, torch_params), **common)
        for moment in ADAM_MOMENTS:
            torch_moments = {name: torch_optimizer.state[p][moment] for name, p in torch_params.items()}
            jax_moments = _jax_moments(jax_optimizer, moment)
            collect(report, step, moment, _param_entries(models, jax_moments, torch_moments), **common)
        if step + 1 < case.steps:
            _start_jax_from_torch(models, torch_optimizer, jax_optimizer, mesh)
    return report


def _start_jax_from_torch(models: _Twins, torch_optimizer, jax_optimizer, mesh) -> None:
    """The JAX twin takes torch's parameters and Adam moments: the next step is compared from one state.

    Left to run free, the two would drift apart and later checks would measure the drift (bridge.numerics).
    """
    from flax import nnx

    _load_torch_parameters(models, mesh)
    moments = params.optimizer_states_to_jax(torch_optimizer, models.torch_model, models.pairs, mesh, models.shardings)
    flat = dict(nnx.to_flat_state(nnx.state(jax_optimizer)))
    for moment in ADAM_MOMENTS:
        for path, value in moments[moment].items():
            flat[("opt_state", moment, *path)].set_value(value)
    nnx.update(jax_optimizer, nnx.from_flat_state(flat))


def _load_torch_parameters(models: _Twins, mesh) -> None:
    """The JAX model's parameters become torch's (zero-copy transfer, then each pair's layout)."""
    torch_params = dict(models.torch_model.named_parameters())
    values = params.torch_values_to_jax(torch_params, models.pairs, mesh, models.shardings)
    params.load_into_jax(models.jax_model, values)


def _build_twins(runtime, world, mesh, case: VerifyCase, rules, report: VerifyReport) -> _Twins:
    from flax import nnx

    import jaxside.modules as JM

    spec = case.spec
    dist.barrier()  # JAX's collectives below (placement) must not wait long for a late process
    torch_model = twins.build_torch(spec)
    # FSDP over dp_shard even of size 1: every parameter is a DTensor, as the checks below expect.
    dp_mesh = world[DP_REPLICATE, DP_SHARD] if case.mesh.dp_replicate > 1 else world[DP_SHARD]
    meshes = LlamaMeshes(world, dp_mesh, world[TP] if case.mesh.tp > 1 else None, weight=None)
    layers = list(torch_model.layers)
    parallelize(torch_model, dp_mesh, tp_mesh=meshes.tp, blocks=layers, device=runtime.torch_device, plan=case.plan)
    _load_seeded_values(torch_model)
    jax_model = twins.build_jax(spec)
    JM.place(jax_model, mesh, case.plan)
    pairs = params.pair_models(torch_model, jax_model, rules)
    placed = JM.shardings(jax_model, mesh, case.plan)
    shardings = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(placed)}
    models = _Twins(torch_model, jax_model, pairs, shardings, meshes)
    _check_layouts(models, mesh, report)
    _load_torch_parameters(models, mesh)
    return models


def _check_layouts(models: _Twins, mesh, report: VerifyReport) -> None:
    """Per parameter: does JAX keep on each device what torch keeps there (the kernel transposed)?"""
    torch_params = dict(models.torch_model.named_parameters())
    for pair in models.pairs:
        equal = params.same_layout(torch_params[pair.torch_name], pair, models.shardings[pair.jax_path], mesh)
        mismatch = 0.0 if equal else 1.0
        limit = tolerance(report.recipe, "layout")
        report.checks.append(TensorCheck(0, "layout", pair.torch_name, mismatch, mismatch, False, limit, equal))


def seeded_values(model) -> dict[str, torch.Tensor]:
    """Seeded global values of every parameter (norm weights near 1), on the CPU."""
    generator = torch.Generator().manual_seed(5)
    values = {}
    for name, param in model.named_parameters():
        scale = 0.05 if param.dim() == 2 else 0.1
        values[name] = torch.randn(param.shape, generator=generator) * scale + (param.dim() == 1 and "weight" in name)
    return values


def seeded_batch(step: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's seeded global x and dy [S, B, H], on the CPU."""
    generator = torch.Generator().manual_seed(1000 + step)
    x, dy = (torch.randn(SEQUENCE, BATCH, hidden, generator=generator) for _ in range(2))
    return x, dy


def _load_seeded_values(model) -> None:
    """`seeded_values`, each rank copying its shard (by the shard map)."""
    with torch.no_grad():
        for name, values in seeded_values(model).items():
            param = model.get_parameter(name)
            shard_map = layout.from_dtensor(param)
            local = param._local_tensor
            local.copy_(values[shard_map.selectors(tuple(param.device_mesh.get_coordinate()))].to(local.device))


def _activation_placements() -> list:
    return [Shard(1), Shard(1), Replicate()]  # batch over (dp_replicate, dp_shard), whole on every TP rank


def _batch(meshes, step: int, hidden: int, device) -> tuple[Any, Any]:
    """This rank's batch columns of the step's seeded global x and dy [S, B, H]."""
    rank, ranks = meshes.data_parallel_rank(), meshes.data_parallel_size
    columns = (t.chunk(ranks, dim=1)[rank] for t in seeded_batch(step, hidden))
    return tuple(t.contiguous().to(device) for t in columns)


def _activation_to_jax(local, world, mesh):
    global_shape = (SEQUENCE, BATCH, local.shape[-1])
    return transfer.local_to_jax(local, world, _activation_placements(), global_shape, mesh)


def _activation_from_jax(array, world):
    import jax

    sharding = transfer.equivalent_sharding(world, _activation_placements(), tuple(array.shape), array.sharding.mesh)
    return transfer.local_from_jax(jax.device_put(array, sharding))


def _replicas(dtensor) -> int:
    mesh = dtensor.device_mesh
    return math.prod(mesh.size(d) for d, p in enumerate(dtensor.placements) if isinstance(p, Replicate))


def _param_entries(models: _Twins, jax_values: dict, torch_tensors: dict) -> list[tuple]:
    """(torch name, JAX value's local shard in torch's layout, torch's local shard, replicas) per parameter."""
    like = dict(models.torch_model.named_parameters())
    present = [p for p in models.pairs if p.jax_path in jax_values and torch_tensors.get(p.torch_name) is not None]
    as_torch = params.jax_values_to_torch(jax_values, present, like)
    return [
        (p.torch_name, as_torch[p.torch_name]._local_tensor, torch_tensors[p.torch_name]._local_tensor,
         _replicas(like[p.torch_name]))
        for p in present
    ]  # fmt: skip


def _flat(state) -> dict:
    from flax import nnx

    return {tuple(path): v.get_value() for path, v in nnx.to_flat_state(state)}


def _jax_moments(optimizer, moment: str) -> dict:
    """{parameter path: the Adam moment} from an nnx.Optimizer over jaxside.optim.fused_adam."""
    return _flat(getattr(optimizer.opt_state, moment))


def _jax_step(recipe):
    """One training step: forward, backward of sum(y * dy), the FP8 bookkeeping, the Adam update.

    Compiled ahead of the first call, then every process waits for the others (a torch barrier):
    XLA's gloo collectives give up on a peer that is late by more than their own timeout, and
    processes compiling on shared cores can finish far apart.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec

    import jaxside.modules as JM
    from jaxside import xla_options

    def loss(model, x, dy, placed: _Placement):
        with JM.fp8_autocast(enabled=recipe is not None, recipe=recipe):
            y, outputs = model(x)
        y = jax.lax.with_sharding_constraint(y, placed.activations)  # laid out as dy: no resharding for the sum
        return jnp.sum(y * dy), outputs

    def step(graphdef, state, x, dy, placed: _Placement):
        model, optimizer = nnx.merge(graphdef, state)
        (grads, dx), outputs = nnx.grad(loss, argnums=(nnx.DiffState(0, JM.GRAD_FILTER), 1), has_aux=True)(
            model, x, dy, placed
        )
        param_grads = JM.finish_backward(model, grads, recipe)
        optimizer.update(model, param_grads)
        # The new state where the old one was: the next call reuses this program.
        new_state = jax.lax.with_sharding_constraint(nnx.state((model, optimizer)), placed.state)
        return new_state, outputs, dx, param_grads

    jitted = xla_options.jit(step, static_argnums=(0, 4))  # (the options FP8 steps compile with)
    compiled: dict[tuple, Any] = {}

    def run(model, optimizer, x, dy):
        graphdef, state = nnx.split((model, optimizer))
        # What is not placed yet (the optimizer's step count) is replicated; the program keeps it there.
        replicated = NamedSharding(x.sharding.mesh, PartitionSpec())
        placed = lambda a: a.sharding if isinstance(a.sharding, NamedSharding) else replicated  # noqa: E731
        placement = _Placement(jax.tree.map(placed, state), x.sharding)
        state = jax.device_put(state, placement.state)
        key = (graphdef, placement)
        if key not in compiled:
            compiled[key] = jitted.lower(graphdef, state, x, dy, placement).compile()
            dist.barrier()
        new_state, outputs, dx, param_grads = compiled[key](state, x, dy)
        nnx.update((model, optimizer), new_state)
        return outputs, dx, param_grads

    return run


class _Placement:
    """Where the step keeps its state and activations: a static jit argument, equal when the shardings are."""

    def __init__(self, state, activations) -> None:
        import jax

        self.state, self.activations = state, activations
        leaves, treedef = jax.tree.flatten(state)
        self._key = (treedef, tuple(leaves), activations)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Placement) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


__all__ = [
    "BATCH", "HISTORY", "LR", "SEQUENCE", "VerifyCase", "case_recipe", "seeded_batch", "seeded_values", "verify"
]
