"""The model a plan is priced on: torch as built on the mesh, and its JAX twin's parameter specs.

`build` builds the model on the meta device and hands it to `place`, the one function that decides
where parameters live: by a placement plan (`read_plan`: twinspec.plan.Plan, issue 33), or without
one by the built-in placement. The JAX twin's specs come from the same plan.
`fake_world` gives a CLI process the ranks of a whole mesh without starting any: torch's fake
process group, as rank 0, whose collectives do nothing. `parallelize` then materializes rank 0's
shards on the CPU (our modules' `reset_parameters` refuses the meta device), so a `plan show` costs
1/(dp x tp) of the model's memory and no communication.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from twinspec.mesh import MESH_AXES, MeshShape
from twinspec.plan import DEFAULT_PLAN, Plan

if TYPE_CHECKING:
    from torch import nn

    from torchside.models.llama_parallel import LlamaMeshes

MODELS = ("transformer", "llama")
DTYPES = ("fp32", "bf16")
MOMENT_DTYPES = ("fp32", "bf16", "fp16", "e4m3")  # FusedAdam's moment formats (torchside.optim.moment_formats)
HISTORY = 4  # DelayedScaling amax history rows of the twins (as verify builds them)


@dataclass(frozen=True)
class PlanOptions:
    """What to build and how it trains: model and sizes, mesh, precision, and the step's batch."""

    model: str = "transformer"
    mesh: MeshShape = dataclasses.field(default_factory=MeshShape)
    layers: int = 2  # transformer
    hidden: int = 256  # transformer (heads of bridge.twins.HEAD_DIM, ffn 4x)
    config: str = "tiny"  # llama: a key of LLAMA_CONFIGS
    sequence_parallel: bool = False
    dtype: str = "fp32"  # parameters, and the activations of the step
    fp8_params: str | None = None  # a recipe name: GEMM weights built as FP8 parameters (quantized_model_init)
    master_weights: bool | None = None  # FusedAdam's; None: for bf16 and FP8 parameters (as torchside.train)
    exp_avg_dtype: str = "fp32"
    exp_avg_sq_dtype: str = "fp32"
    batch: int = 8  # global sequences per step, split over the data-parallel ranks
    seq: int = 16  # tokens per sequence

    def __post_init__(self) -> None:
        choices = {"model": MODELS, "dtype": DTYPES, "exp_avg_dtype": MOMENT_DTYPES, "exp_avg_sq_dtype": MOMENT_DTYPES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r}: use one of {', '.join(allowed)}")
        for name in ("layers", "hidden", "batch", "seq"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: pass an integer >= 1")
        if self.batch % self.mesh.data_parallel_size:
            raise ValueError(
                f"--batch {self.batch} must divide over the {self.mesh.data_parallel_size} data-parallel ranks of "
                f"{self.mesh}"
            )
        if self.sequence_parallel and self.seq % self.mesh.tp:
            raise ValueError(f"sequence parallelism splits --seq {self.seq} over tp={self.mesh.tp}: pick a multiple")
        if self.fp8_params is not None:
            from torchside.recipe import recipe_names

            if self.fp8_params not in recipe_names(fp8_off=False):
                names = ", ".join(recipe_names(fp8_off=False))
                raise ValueError(f"--fp8-params {self.fp8_params!r}: use a recipe, one of {names}")
            if self.master_weights is False:
                raise ValueError("FP8 parameters train on fp32 master weights: drop --no-master-weights")
        if self.model == "transformer":
            from bridge import twins

            twins.check_spec(self.twin_spec)
            if self.dtype != "fp32":
                raise ValueError(
                    f"--dtype {self.dtype}: the transformer twin trains in fp32 (as verify); use --model llama"
                )
            if (4 * self.hidden) % self.mesh.tp or (self.hidden // twins.HEAD_DIM) % self.mesh.tp:
                raise ValueError(f"--mesh {self.mesh}: tp={self.mesh.tp} must divide the heads and ffn of --hidden")
        else:
            from twinspec.llama import LLAMA_CONFIGS

            if self.config not in LLAMA_CONFIGS:
                raise ValueError(f"--config {self.config!r}: use one of {', '.join(LLAMA_CONFIGS)}")

    @property
    def twin_spec(self):
        from bridge import twins

        return twins.TwinSpec(
            self.model, self.layers, self.hidden, self.mesh.tp, HISTORY, sequence_parallel=self.sequence_parallel
        )

    @property
    def keeps_master(self) -> bool:
        if self.master_weights is None:
            return self.dtype == "bf16" or self.fp8_params is not None
        return self.master_weights

    def torch_dtype(self, name: str):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "e4m3": torch.float8_e4m3fn}[name]


@dataclass
class BuiltModel:
    """The torch model as built on this rank, its meshes, the optimizer it trains with, its JAX twin's specs."""

    options: PlanOptions
    model: nn.Module
    meshes: LlamaMeshes
    optimizer: Any  # torchside.optim.FusedAdam
    jax_specs: dict[str, JaxSpec]


@dataclass(frozen=True)
class JaxSpec:
    """Where the JAX twin keeps a torch parameter: its name there, its PartitionSpec, and whether dims swap."""

    name: str
    pspec: Any  # jax.sharding.PartitionSpec
    transposes: bool


def build(options: PlanOptions, device: str = "cpu", plan=None) -> BuiltModel:
    """The model placed on this process's ranks by `plan` (None: the default plan; a process group of the
    mesh's size must be up)."""
    from torchside.models.llama_parallel import build_meshes
    from torchside.optim import FusedAdam, requantize_fp8_weights

    plan = plan or DEFAULT_PLAN
    meshes = build_meshes("cpu", dp=options.mesh.dp_shard, tp=options.mesh.tp, replicate=options.mesh.dp_replicate)
    model = place(options, _unplaced_model(options, plan), meshes, device, plan)
    optimizer = FusedAdam(
        model.parameters(),
        master_weights=options.keeps_master,
        exp_avg_dtype=options.torch_dtype(options.exp_avg_dtype),
        exp_avg_sq_dtype=options.torch_dtype(options.exp_avg_sq_dtype),
    )
    if options.fp8_params is not None:
        requantize_fp8_weights(optimizer, model)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return BuiltModel(options, model, meshes, optimizer, jax_specs(options, shapes, plan))


def place(options: PlanOptions, model: nn.Module, meshes: LlamaMeshes, device: str, plan) -> nn.Module:
    """Where every parameter lives: by `plan` (twinspec.plan.Plan)."""
    if options.model == "llama":
        from torchside.models.llama_parallel import parallelize_llama

        return parallelize_llama(model, meshes, device=device, plan=plan)
    from torchside.parallel import parallelize

    blocks = list(model.layers)
    return parallelize(
        model, meshes.data, tp_mesh=meshes.tp, weight_mesh=meshes.weight, blocks=blocks, device=device, plan=plan
    )


def _unplaced_model(options: PlanOptions, plan) -> nn.Module:
    """The model on the meta device (Llama: its units' TP modes from `plan`); GEMM weights FP8 under `fp8_params`."""
    from torchside.autocast import quantized_model_init
    from torchside.recipe import recipe_from_name

    if options.fp8_params is None:
        return _meta_model(options, plan)
    history = {"amax_history_len": HISTORY} if options.fp8_params == "delayed" else {}
    with quantized_model_init(enabled=True, recipe=recipe_from_name(options.fp8_params, **history)):
        return _meta_model(options, plan)


def _meta_model(options: PlanOptions, plan) -> nn.Module:
    import torch

    if options.model == "transformer":
        from bridge import twins

        # on meta, in fp32 as verify builds it (a plan: its TP modes per block)
        return twins.build_torch(dataclasses.replace(options.twin_spec, plan=plan))
    from twinspec.llama import LLAMA_CONFIGS
    from torchside.models import Llama
    from torchside.modules import ModuleConfig

    module_config = ModuleConfig(
        amax_history_len=HISTORY, tp_size=options.mesh.tp, sequence_parallel=options.sequence_parallel
    )
    config, dtype = LLAMA_CONFIGS[options.config], options.torch_dtype(options.dtype)
    return Llama(config, params_dtype=dtype, device=torch.device("meta"), module_config=module_config, plan=plan)


def jax_specs(options: PlanOptions, torch_shapes: dict[str, tuple[int, ...]], plan) -> dict[str, JaxSpec]:
    """Per torch parameter, its twin's name and PartitionSpec by `plan` (shapes only: no devices)."""
    import jax
    from flax import nnx

    import jaxside.modules as JM
    from bridge import params

    jax_model = nnx.eval_shape(lambda: _jax_model(options, plan))
    mesh = jax.sharding.AbstractMesh(options.mesh.sizes, MESH_AXES)
    placed = JM.shardings(jax_model, mesh, plan=plan)
    shardings = {tuple(path): v.get_value() for path, v in nnx.to_flat_state(placed)}
    shapes = {path: tuple(value.shape) for path, value in params.jax_parameters(jax_model).items()}
    pairs = params.pair_parameters(torch_shapes, shapes)
    return {p.torch_name: JaxSpec(p.jax_name, shardings[p.jax_path].spec, p.layout.transposes) for p in pairs}


def _jax_model(options: PlanOptions, plan):
    if options.model == "transformer":
        from bridge import twins

        return twins.build_jax(dataclasses.replace(options.twin_spec, plan=plan))
    import jax.numpy as jnp
    from flax import nnx

    from jaxside.models.llama import Llama
    from twinspec.llama import LLAMA_CONFIGS

    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[options.dtype]
    return Llama(LLAMA_CONFIGS[options.config], params_dtype=dtype, rngs=nnx.Rngs(0), plan=plan)


def read_plan(path: str):
    """The placement plan in a TOML file (twinspec.plan.Plan; ValueError naming the file, and the rule or what it is)."""
    try:
        return Plan.from_toml(path)
    except OSError as error:  # missing, a folder, unreadable
        reason = error.strerror or type(error).__name__
        raise ValueError(f"{path}: {reason.lower()}; pass a TOML placement plan (examples/plans/)") from error
    except UnicodeDecodeError as error:  # a binary file such as a .npy
        raise ValueError(
            f"{path}: not a text file (byte {error.object[error.start]:#04x} at {error.start} is not UTF-8); pass a "
            "TOML placement plan (examples/plans/)"
        ) from error


def plan_sequence_parallel(plan) -> bool:
    """Whether a plan's rules turn sequence parallelism on (the model must be built with it)."""
    return plan is not None and any(rule.sequence_parallel for rule in plan.rules)


@contextlib.contextmanager
def fake_world(size: int) -> Iterator[None]:
    """This process as rank 0 of a `size`-rank fake process group (collectives do nothing), for the block."""
    import torch.distributed as dist

    from bridge import _torch_compat

    if dist.is_initialized():
        raise ValueError("a process group is already up: build the plan's model inside it (bridge.plan.build.build)")
    dist.init_process_group("fake", store=_torch_compat.fake_store(), rank=0, world_size=size)
    try:
        yield
    finally:
        dist.destroy_process_group()


__all__ = [
    "MODELS",
    "BuiltModel",
    "JaxSpec",
    "PlanOptions",
    "build",
    "fake_world",
    "jax_specs",
    "place",
    "read_plan",
]
