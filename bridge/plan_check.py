"""`verify --model llama --plan PLAN`: the tiny Llama under a placement plan, in torch, in JAX and unsharded.

The verify stacks have no embedding or head, so a plan that places them (the embedding split by
hidden columns) runs here, on the whole model. In each co-located process (bridge.runtime):

1. one seeded initialization of torchside's tiny Llama (`LLAMA_CONFIGS["tiny"]`, `torch.manual_seed(SEED)`),
   whole on every process, is the state and the unsharded reference;
2. the torch Llama is built on "meta" under the plan, `parallelize_llama`d on the torch mesh (FSDP2 or
   HSDP on the data axes, TP on `tp`) and loaded with that state, each rank its shards;
3. the JAX twin is placed by the same plan on the JAX mesh of the same devices and takes torch's shards
   (zero-copy, bridge.params); its kernels start as zeros, so a parameter left out shows in the logits.

Checked under each recipe (fresh models: fresh FP8 scaling state), on --batch-size x --seq-len seeded
random tokens: per parameter, that JAX keeps on each device what torch keeps there ("layout", no
tolerance); the twin's logits against torch's ("forward", bridge.logits); torch's sharded logits against
the unsharded model's of the same rows ("unsharded"), both against bridge.numerics' forward tolerance.
The unsharded model runs each data-parallel rank's rows apart because that is what a rank's FP8 casts
see: an activation's amax is its rank's tokens' (as in the twin, jaxside.modules.tokens), a weight's is
the whole weight's (reduced over its shards).

`check_input` runs before any process starts: the plan against the torch model on "meta" (rules that
match nothing, mesh sizes other than the plan's [mesh], modes a module lacks: ValueError naming the
rule; the modules refuse heads TP does not divide) and the twin's shardings on an abstract mesh.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

from bridge.hf_check import check_forward_options, logits_report, random_tokens
from bridge.numerics import TensorCheck, tolerance
from twinspec.mesh import DP_SHARD, MESH_AXES, MeshShape
from twinspec.plan import Plan

SEED = 0


@dataclass(frozen=True)
class PlanCase:
    """The tiny Llama under `plan` on one mesh, compared under each recipe on `batch_size` x `seq_len` tokens."""

    plan: Plan
    mesh: MeshShape
    recipes: tuple[str, ...] = ("current",)
    batch_size: int = 8
    seq_len: int = 32
    name: str = "plan"  # the plan's name in the reports

    def __post_init__(self) -> None:
        check_forward_options(self.recipes, self.mesh, self.batch_size, self.seq_len)


def _config():
    from twinspec.llama import LLAMA_CONFIGS

    return LLAMA_CONFIGS["tiny"]


def _meta_model(case: PlanCase):
    from torchside.models.llama import Llama
    from torchside.modules import ModuleConfig

    return Llama(_config(), device="meta", module_config=ModuleConfig(tp_size=case.mesh.tp), plan=case.plan)


def check_input(case: PlanCase) -> None:
    """The plan against the model and the mesh, before any process starts (module docstring)."""
    from flax import nnx
    from jax.sharding import AbstractMesh

    from jaxside.models.llama import Llama
    from jaxside.modules.placement import shardings
    from torchside.parallel.plan import resolve

    resolve(_meta_model(case), case.plan, case.mesh)
    twin = nnx.eval_shape(lambda: Llama(_config(), plan=case.plan, rngs=nnx.Rngs(0)))
    shardings(twin, AbstractMesh(case.mesh.sizes, MESH_AXES), case.plan)


def verify_plan(runtime, case: PlanCase) -> list[dict]:
    """Every recipe of the case in these processes (module docstring); the JSON reports, the same on every rank."""
    import torch

    from bridge.runtime import jax_mesh
    from torchside.models.llama import Llama
    from torchside.models.llama_parallel import build_meshes

    mesh = case.mesh
    meshes = build_meshes(runtime.device_type, dp=mesh.dp_shard, tp=mesh.tp, replicate=mesh.dp_replicate)
    if meshes.data is None:  # FSDP over dp_shard even of size 1: every parameter a DTensor, as the layout check reads
        meshes = dataclasses.replace(meshes, data=meshes.world[DP_SHARD])
    twin_mesh = jax_mesh(meshes.world)
    torch.manual_seed(SEED)
    unsharded = Llama(_config()).to(runtime.torch_device)
    full = {name: p.detach().cpu() for name, p in unsharded.named_parameters()}
    tokens = random_tokens(_config().vocab_size, case.batch_size, case.seq_len)
    reports = []
    for recipe in case.recipes:
        started = time.perf_counter()
        model = _sharded(case, meshes, full, runtime.torch_device)
        twin, layouts = _twin(model, case.plan, twin_mesh, recipe)
        report = logits_report(model, twin, meshes, twin_mesh, recipe, tokens, runtime.torch_device.type,
                               (f"llama tiny, plan {case.name}", str(mesh)))  # fmt: skip
        report.checks[:0] = layouts
        report.checks.append(_unsharded_check(model, unsharded, meshes, recipe, tokens, runtime.torch_device.type))
        reports.append(report.to_json())
        if runtime.rank == 0:
            verdict = "passed" if report.passed else f"DIVERGED at {report.first_divergence.name}"
            print(f"verify plan {case.name} {mesh} {recipe}: {verdict} ({time.perf_counter() - started:.1f} s)",
                  file=sys.stderr, flush=True)  # fmt: skip
    return reports


def _sharded(case: PlanCase, meshes, full: dict, device):
    """The torch Llama under the plan on `meshes`, holding its shards of `full`."""
    from torchside.models.llama_parallel import load_full_state, parallelize_llama

    model = _meta_model(case)
    parallelize_llama(model, meshes, device=device, plan=case.plan)
    load_full_state(model, full)
    return model


def _twin(model, plan: Plan, mesh, recipe: str):
    """The JAX twin placed by `plan`, holding torch's parameters; the layout check of every parameter."""
    from flax import nnx

    import jaxside.modules as JM
    from bridge import params
    from bridge.demo.jax_side import jax_twin

    twin = jax_twin(model, plan)
    JM.place(twin, mesh, plan)
    shardings = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(JM.shardings(twin, mesh, plan))}
    torch_params = dict(model.named_parameters())
    pairs = params.pair_models(model, twin)
    limit = tolerance(recipe, "layout")
    layouts = []
    for pair in pairs:
        equal = params.same_layout(torch_params[pair.torch_name], pair, shardings[pair.jax_path], mesh)
        mismatch = 0.0 if equal else 1.0
        layouts.append(TensorCheck(0, "layout", pair.torch_name, mismatch, mismatch, False, limit, equal))
    params.load_into_jax(twin, params.torch_values_to_jax(torch_params, pairs, mesh, shardings))
    return twin, layouts


def _unsharded_check(model, unsharded, meshes, recipe: str, tokens, device_type: str) -> TensorCheck:
    """torch's sharded logits of this rank's rows against the unsharded model's of the same rows (module docstring)."""
    import torch
    from torch.distributed.tensor import DTensor

    from bridge.logits import torch_logits
    from bridge.numerics import local_stats, reduce_stats
    from torchside.autocast import fp8_autocast
    from torchside.recipe import recipe_from_name

    fp8 = recipe_from_name(recipe)
    rows = tokens.chunk(meshes.data_parallel_size)[meshes.data_parallel_rank()]
    with torch.no_grad():
        ours = torch_logits(model, meshes, fp8, tokens)
        with fp8_autocast(enabled=fp8 is not None, recipe=fp8):
            reference = unsharded(rows.to(next(unsharded.parameters()).device))
    ours = ours.full_tensor() if isinstance(ours, DTensor) else ours  # whole on every TP rank
    ((relative, max_abs, nan),) = reduce_stats(local_stats(ours, reference, meshes.world.size(2))[None])
    limit = tolerance(recipe, "forward", device_type=device_type)
    return TensorCheck(0, "unsharded", "logits", relative, max_abs, nan, limit, limit.passes(relative, max_abs, nan))


__all__ = ["PlanCase", "check_input", "verify_plan"]
