"""Placement plans build the same layouts in both frameworks: the example plans and the default one.

For each plan, the torch Llama is built and parallelized under it on torch's threaded process group
and on gloo processes (FSDP2 x TP 2 x 2, or HSDP x TP 2 x 2 x 2), its JAX twin's shardings come from
the same plan on 8 host devices, and for every parameter:

- the live DTensor holds on each rank what JAX's `devices_indices_map` puts on that device (the
  bridge's shard-map comparison, `bridge.params.same_layout`);
- the local values, loaded from one full state, are the elements at JAX's indices: a check
  through neither framework's layout code;
- where the plan changes the built-in layout, the torch placements are the ones written out below;
- the model computes what the unsharded model computes from the same state: logits and gradients
  (every rank gets the same tokens, so FSDP2's average over data-parallel ranks is the gradient).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from torch.distributed.tensor import Replicate, Shard

from bridge import layout, params
from tests.distributed import run_processes, run_threads
from torchside.parallel._torch_compat import make_strided_shard
from twinspec.mesh import DP_REPLICATE, DP_SHARD, MESH_AXES, TP, MeshShape
from twinspec.plan import DEFAULT_PLAN, Plan, torch_name

pytestmark = pytest.mark.usefixtures("reference_kernels")  # tests/conftest.py: what threaded ranks run

PLANS_DIR = Path(__file__).parents[2] / "examples" / "plans"
EXAMPLES = sorted(path.stem for path in PLANS_DIR.glob("*.toml"))
DEFAULT_MESH = MeshShape(dp_shard=2, tp=2)  # the default plan names no mesh: FSDP2 x TP 2 x 2

# Written out from the plans' meaning, on the (dp_shard, tp) or (dp_replicate, dp_shard, tp) mesh.
STRIDED_0, STRIDED_1 = make_strided_shard(0, 2), make_strided_shard(1, 2)
EXPECTED_PLACEMENTS = {
    "fsdp_dim1_down_proj": {
        "layers.0.self_attention.proj.weight": (STRIDED_1, Shard(1)),
        "layers.1.layernorm_mlp.fc2_weight": (STRIDED_1, Shard(1)),
        "layers.1.layernorm_mlp.fc1_weight": (STRIDED_0, Shard(0)),  # untouched
    },
    "attention_replicated_mlp_tp": {
        "layers.0.self_attention.layernorm_qkv.weight": (Shard(0), Replicate()),
        "layers.0.self_attention.proj.weight": (Shard(0), Replicate()),
        "layers.1.layernorm_mlp.fc1_weight": (STRIDED_0, Shard(0)),
        "layers.1.layernorm_mlp.fc2_weight": (Shard(0), Shard(1)),
    },
    "embedding_hidden_split": {
        "embedding.weight": (Replicate(), Shard(0), Shard(1)),  # HSDP x TP: hidden columns over tp
        "layers.0.self_attention.proj.weight": (Replicate(), Shard(0), Shard(1)),
    },
}


def _built_in_placements(name: str) -> tuple:
    """docs/design.md's table under FSDP2 on (dp_shard, tp), by what each Llama parameter is (not by the plan code)."""
    if "norm" in name.rsplit(".", 1)[-1] or name == "norm.weight":
        return Shard(0), Replicate()  # norm weights: replicated over tp
    if name.endswith(("proj.weight", "fc2_weight")):
        return Shard(0), Shard(1)  # row-parallel: input features over tp
    return STRIDED_0, Shard(0)  # the embedding, QKV, fc1: rows over tp, FSDP dim 0 on top


def _plan(name: str) -> Plan:
    return DEFAULT_PLAN if name == "default" else Plan.from_toml(PLANS_DIR / f"{name}.toml")


def _sizes(plan: Plan) -> dict[str, int]:
    return (DEFAULT_MESH if plan.mesh is None else plan.mesh).axis_sizes


def _jax_side(plan: Plan, sizes: dict[str, int]):
    """The JAX twin's parameter shardings under `plan` (on 8 host devices) and its parameters' shapes, by path."""
    from flax import nnx

    from jaxside.models.llama import LLAMA_CONFIGS, Llama
    from jaxside.modules.placement import shardings
    from jaxside.sharding import make_mesh

    mesh = make_mesh(*(sizes[axis] for axis in MESH_AXES))
    model = nnx.eval_shape(lambda: Llama(LLAMA_CONFIGS["tiny"], plan=plan, rngs=nnx.Rngs(0)))
    placed = dict(nnx.to_flat_state(shardings(model, mesh, plan)))
    jax_shapes = {path: tuple(value.shape) for path, value in params.jax_parameters(model).items()}
    return {path: placed[path].get_value() for path in jax_shapes}, jax_shapes


TOKENS = np.random.default_rng(0).integers(0, 256, size=(2, 8))


def _full_state(shapes: dict[str, tuple[int, ...]]):
    """Seeded values, distinct everywhere, for every parameter."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(shape, generator=generator) * 0.1 for name, shape in sorted(shapes.items())}


def _logits_and_grads(model, full_tensor):
    """Logits, gradients, and per layer whether FSDP2 freed its gathered weights after forward."""
    import torch

    logits = model(torch.from_numpy(TOKENS))
    # Gathered, a weight is a DTensor over tp alone; resharded, over the data-parallel axes too.
    resharded = [len(getattr(layer.layernorm_mlp.fc1_weight, "placements", ())) > 1 for layer in model.layers]
    logits = full_tensor(logits)
    (logits.double().sin().sum()).backward()
    grads = {name: full_tensor(p.grad).numpy() for name, p in model.named_parameters()}
    return logits.detach().numpy(), grads, resharded


def _torch_side(rank, world_size, plan: Plan, sizes: dict[str, int], full, jax_specs, jax_shapes):
    """On each rank: per parameter (name, placements, local values, same layout as JAX?), logits and gradients.

    JAX's shardings arrive as PartitionSpecs (picklable, for gloo processes) and are set on this rank's own
    JAX mesh of the same sizes."""
    from jax.sharding import NamedSharding
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from jaxside.sharding import make_mesh
    from torchside.models.llama import LLAMA_CONFIGS, Llama
    from torchside.models.llama_parallel import build_meshes, parallelize_llama
    from torchside.modules import ModuleConfig

    meshes = build_meshes("cpu", dp=sizes[DP_SHARD], tp=sizes[TP], replicate=sizes[DP_REPLICATE])
    module_config = ModuleConfig(tp_size=sizes[TP])
    model = Llama(LLAMA_CONFIGS["tiny"], device="meta", module_config=module_config, plan=plan)
    parallelize_llama(model, meshes, device="cpu", plan=plan)
    set_model_state_dict(model, dict(full), options=StateDictOptions(full_state_dict=True, strict=False))
    torch_shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    pairs = {pair.torch_name: pair for pair in params.pair_parameters(torch_shapes, jax_shapes)}
    jax_mesh = make_mesh(*(sizes[axis] for axis in MESH_AXES))
    layouts = [
        (
            name,
            tuple(p.placements),
            p.to_local().detach().numpy(),
            params.same_layout(p, pairs[name], NamedSharding(jax_mesh, jax_specs[pairs[name].jax_path]), jax_mesh),
        )
        for name, p in model.named_parameters()
    ]
    return layouts, _logits_and_grads(model, lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t)


def _one_process(full):
    from torchside.models.llama import LLAMA_CONFIGS, Llama

    model = Llama(LLAMA_CONFIGS["tiny"])
    model.load_state_dict(full, strict=False)
    return _logits_and_grads(model, lambda t: t)


@pytest.mark.parametrize("plan_name", ["default", *EXAMPLES])
def test_a_plan_builds_the_same_shards_in_torch_and_jax(plan_name):
    _check_plan_builds(plan_name, run_threads)


# Real processes: each rank its own address space and gloo's collectives, so a shard reaches a rank only
# through FSDP2's and DTensor's communication (threads share one heap). Grid only: 25-45 s a plan on the
# shared 2-core machine (4 or 8 processes importing torch and JAX), over CI's budget; the threaded test
# above runs every plan in CI.
@pytest.mark.grid
@pytest.mark.multiprocess
@pytest.mark.parametrize("plan_name", EXAMPLES)
def test_a_plan_builds_the_same_shards_on_gloo_processes(plan_name):
    _check_plan_builds(plan_name, run_processes)


def _check_plan_builds(plan_name: str, run) -> None:
    """Build under the plan on `run`'s ranks (threads or gloo processes); check every rank's parameters and outputs."""
    plan = _plan(plan_name)
    sizes = _sizes(plan)
    jax_shardings, jax_shapes = _jax_side(plan, sizes)
    world = math.prod(sizes.values())
    full = _full_state(_global_shapes(jax_shapes))
    jax_specs = {path: sharding.spec for path, sharding in jax_shardings.items()}
    outcomes = run(_torch_side, world, plan, sizes, full, jax_specs, jax_shapes)
    per_rank = [layouts for layouts, _ in outcomes]

    pairs = params.pair_parameters(_global_shapes(jax_shapes), jax_shapes)
    by_name = {pair.torch_name: (pair.jax_path, pair) for pair in pairs}
    for rank, results in enumerate(per_rank):
        for name, placements, local, same in results:
            assert same, f"{plan_name}: {name} {placements} is not where JAX's plan spec puts it"
            path, pair = by_name[name]
            flax_shape = jax_shapes[path]
            jax_map = layout.from_named_sharding(jax_shardings[path], flax_shape)
            coordinate = next(c for c in jax_map.mesh.coordinates() if jax_map.mesh.rank_of(c) == rank)
            indices = jax_map.indices[coordinate]
            expected = full[name].numpy()[np.ix_(*(indices[::-1] if pair.layout.transposes else indices))]
            np.testing.assert_array_equal(local, expected, err_msg=f"{plan_name}: {name} on rank {rank}")
    placements = {name: placements for name, placements, _, _ in per_rank[0]}
    if plan_name == "default":  # every parameter where the built-in table puts it
        assert placements == {name: _built_in_placements(name) for name in placements}
    for name, expected in EXPECTED_PLACEMENTS.get(plan_name, {}).items():
        assert placements[name] == expected, f"{plan_name}: {name} is {placements[name]}, not {expected}"
    reference_logits, reference_grads, _ = _one_process(full)
    for rank, (_, (logits, grads, resharded)) in enumerate(outcomes):
        np.testing.assert_allclose(logits, reference_logits, rtol=1e-5, atol=1e-6, err_msg=f"logits, rank {rank}")
        assert grads.keys() == reference_grads.keys() == full.keys()
        assert resharded == [plan_name != "attention_replicated_mlp_tp"] * 2  # its rule: reshard_after_forward = false
        for name, grad in grads.items():
            np.testing.assert_allclose(
                grad, reference_grads[name], rtol=1e-4, atol=1e-6, err_msg=f"{name}, rank {rank}"
            )


def _global_shapes(jax_shapes):
    """The torch shapes of the JAX parameters: a 2-D kernel is its torch weight transposed."""
    return {
        torch_name(params.dotted(path), len(shape)): tuple(shape[::-1]) if len(shape) == 2 else tuple(shape)
        for path, shape in jax_shapes.items()
    }


def test_a_bad_plan_fails_in_both_frameworks_before_anything_is_placed():
    """The same ValueError from the torch and the JAX model, the torch one still all on the meta device."""
    from flax import nnx

    from jaxside.models.llama import Llama as JaxLlama
    from jaxside.modules.placement import shardings
    from jaxside.sharding import make_mesh
    from torchside.models.llama import LLAMA_CONFIGS, Llama
    from torchside.models.llama_parallel import parallelize_llama

    bad = Plan.from_dict({"rule": [{"match": "*norm*", "fsdp_dim": 1}]})
    message = "rule 0 (match '*norm*') gives layers.0.layernorm_mlp.layer_norm_weight fsdp_dim=1, but it has 1 dim(s)"
    model = Llama(LLAMA_CONFIGS["tiny"], device="meta")
    with pytest.raises(ValueError, match=re.escape(message)):
        parallelize_llama(model, None, device="cpu", plan=bad)
    assert all(p.is_meta for p in model.parameters())
    jax_model = nnx.eval_shape(lambda: JaxLlama(LLAMA_CONFIGS["tiny"], rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=re.escape(message)):
        shardings(jax_model, make_mesh(), bad)
