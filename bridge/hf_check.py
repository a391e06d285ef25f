"""`verify --model llama --hf DIR`: one Hugging Face Llama checkpoint in torch and in JAX, compared.

Without tensor parallelism (tp = 1: one process, or data-parallel processes) the check is
`bridge.compare` (`compare_hf`, docs/verification.md): each process loads the whole model in both
frameworks (`torchside.models.llama.load_hf`, `jaxside.models.llama.load_hf` on its own device, fp32),
every block is teacher-forced against its derived bound, then the logits, under FP8 judged
noise-aware against both frameworks' FP8-off logits. Each side keeps the parameters it loaded
(`copy_params=False`), so a loader's difference is named by the first block it reaches. On several
processes each compares its rows of the tokens (bridge.model_compare.data_parallel).

On a tensor-parallel mesh (tp > 1) the check is `verify_hf`, because bridge.compare does not split a
model: in each co-located process (bridge.runtime) both frameworks load their own shards (torch:
FSDP2 over the data axes, TP on `tp`; JAX: the same devices' mesh), run the seeded tokens forward
under the recipe and compare the logits shard by shard (bridge.logits) against bridge.numerics'
forward tolerance. Both load in fp32 (bf16 and fp32 weights are exact in it; an FP8 block-scaled
checkpoint keeps its bytes and scales as torch FP8 parameters, while JAX dequantizes them, docs/hf.md),
so either check measures the two implementations, not bf16 rounding.

`check_input` runs before any process starts: the directory's config, index and headers
(twinspec.hf_llama.Checkpoint), the torch model built on "meta" for the TP size (its
modules refuse heads or ffn sizes TP does not divide; each recipe's tiles against its GEMM
weights' TP shards) and, on a TP mesh, an FP8 checkpoint's FSDP2 row shards against its 128-row
blocks and the JAX twin's shardings on an abstract mesh (JAX refuses dims the mesh does not divide).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from bridge.numerics import RECIPES, TensorCheck, VerifyReport, tolerance
from twinspec.mesh import MESH_AXES, MeshShape

if TYPE_CHECKING:  # the hints only: this module imports the frameworks where it uses them
    import torch

    from bridge.model_compare.data_parallel import DataParallel

TOKEN_SEED = 0


@dataclass(frozen=True)
class HFCase:
    """One checkpoint on one mesh, compared under each recipe on `batch_size` x `seq_len` random tokens."""

    path: str
    mesh: MeshShape
    recipes: tuple[str, ...] = ("off",)
    batch_size: int = 8
    seq_len: int = 32

    def __post_init__(self) -> None:
        check_forward_options(self.recipes, self.mesh, self.batch_size, self.seq_len)


def check_forward_options(recipes: tuple[str, ...], mesh: MeshShape, batch_size: int, seq_len: int) -> None:
    """The recipes and the token batch of a logits check on `mesh` (also bridge.plan_check's); ValueError with the fix."""
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown or not recipes:
        raise ValueError(f"recipes {list(recipes)}: use some of {', '.join(RECIPES)}")
    for name, value in (("batch-size", batch_size), ("seq-len", seq_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} {value!r}: pass an integer >= 1")
    if batch_size % mesh.data_parallel_size:
        raise ValueError(
            f"--batch-size {batch_size} must divide over the {mesh.data_parallel_size} data-parallel ranks"
        )
    if set(recipes) - {"off"} and seq_len % 32:
        raise ValueError(f"--seq-len {seq_len}: pass a multiple of 32 (MXFP8's and 1x128 blocks' tiles)")


def check_input(case: HFCase) -> None:
    """The checkpoint and the mesh, before any process starts (module docstring); ValueError with the fix."""
    from jax.sharding import AbstractMesh

    from twinspec.hf_llama import Checkpoint

    path = Path(case.path)
    if not path.is_dir():
        raise ValueError(
            f"--hf {case.path}: not a directory; pass a Hugging Face model directory (config.json, *.safetensors)"
        )
    checkpoint = Checkpoint(path)  # config, index, headers, names and shapes: ValueError naming the file
    if checkpoint.fp8 and set(case.recipes) != {"off"}:
        raise ValueError(
            f"--hf {case.path} is an FP8 block-scaled checkpoint: compare it with --recipe off (torch computes with "
            "the file's FP8 weights, JAX with their dequantized values; a recipe would requantize only JAX's)"
        )
    mesh = case.mesh
    sharded = mesh.tp > 1  # else bridge.compare: the whole model on every process
    # The sharded loaders pad the vocabulary to a multiple of tp x dp_shard (torchside.models.llama_hf).
    config = dataclasses.replace(checkpoint.config, vocab_multiple=mesh.tp * mesh.dp_shard if sharded else 1)
    try:
        model = _build_torch_on_meta(config, mesh.tp, checkpoint.fp8)
        _check_recipes_fit(model, case.recipes, mesh.tp)
        if sharded:
            _check_fp8_rows_fit(model, mesh.dp_shard)
            _jax_shardings(config, AbstractMesh(mesh.sizes, MESH_AXES))
    except ValueError as error:
        raise ValueError(f"--hf {case.path} on --mesh {mesh}: {error}") from error


def _build_torch_on_meta(config, tp: int, fp8: bool):
    """The torch Llama as torchside.models.llama_hf.load_hf builds it, on meta: its modules check the TP splits."""
    from torchside.autocast import quantized_model_init
    from torchside.models.llama import Llama
    from torchside.modules import ModuleConfig
    from torchside.recipe import Float8BlockScaling

    with quantized_model_init(enabled=fp8, recipe=Float8BlockScaling()):
        return Llama(config, device="meta", module_config=ModuleConfig(tp_size=tp))


def _check_recipes_fit(model, recipes, tp: int) -> None:
    """Each recipe's tiles against every GEMM weight's TP shard (a module's parameters have their TP-local shapes),
    as the first FP8 forward would check them inside the processes."""
    from torchside.parallel.placements import check_recipe_fits_shard
    from torchside.recipe import recipe_from_name

    for recipe in filter(None, map(recipe_from_name, recipes)):
        for module in model.modules():
            if getattr(module, "num_gemms", 0):
                for name, param in module.named_parameters(recurse=False):
                    if param.dim() == 2:
                        check_recipe_fits_shard(recipe, type(module).__name__, name, tuple(param.shape), tp)


def _check_fp8_rows_fit(model, dp_shard: int) -> None:
    """FSDP2 cuts each FP8 weight's TP shard into dp_shard row chunks (torch.chunk); a chunk must start on a
    128-row scale block, or the load fails inside the processes (torchside.quantization.storage)."""
    from twinspec.hf_llama import BLOCK

    for owner, module in model.named_modules():
        if getattr(module, "num_gemms", 0) and module.builds_fp8_weights:
            for name, param in module.named_parameters(recurse=False):
                rows = param.shape[0] if param.dim() == 2 else 0
                chunk = -(-rows // dp_shard)
                if chunk < rows and chunk % BLOCK:
                    raise ValueError(
                        f"{owner}.{name}: FSDP2 over dp_shard={dp_shard} cuts its {rows} FP8 rows (per TP rank) "
                        f"into {chunk}-row shards, which split its {BLOCK}-row scale blocks; pick a dp size whose "
                        f"shards hold whole blocks"
                    )


def _jax_shardings(config, mesh) -> None:
    """The twin's shardings on `mesh` (an AbstractMesh: no device is touched), which check every split dim."""
    from flax import nnx

    from jaxside.models.llama import Llama
    from jaxside.modules.placement import shardings

    shardings(nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0))), mesh)


def random_tokens(vocab_size: int, batch_size: int, seq_len: int):
    """Seeded token ids [B, S], the same in every process."""
    import torch

    return torch.randint(0, vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(TOKEN_SEED))


def verify_hf(runtime, case: HFCase) -> list[dict]:
    """Every recipe of the case in these processes (module docstring); the JSON reports, the same on every rank."""
    import jax.numpy as jnp
    import torch

    from bridge.runtime import jax_mesh
    from jaxside.models import llama as jax_llama
    from torchside.models import llama as torch_llama
    from torchside.models.llama_parallel import build_meshes

    mesh = case.mesh
    meshes = build_meshes(runtime.device_type, dp=mesh.dp_shard, tp=mesh.tp, replicate=mesh.dp_replicate)
    twin_mesh = jax_mesh(meshes.world)
    reports = []
    for recipe in case.recipes:
        started = time.perf_counter()
        # Loaded again for every recipe: each starts from the checkpoint with fresh FP8 scaling state.
        model = torch_llama.load_hf(
            case.path, mesh=meshes.data, tp_mesh=meshes.tp, device=runtime.torch_device, dtype=torch.float32
        )
        twin = jax_llama.load_hf(case.path, mesh=twin_mesh, dtype=jnp.float32)
        tokens = random_tokens(model.config.vocab_size, case.batch_size, case.seq_len)
        title = (f"llama {case.path}", str(mesh))
        report = logits_report(model, twin, meshes, twin_mesh, recipe, tokens, runtime.torch_device.type, title)
        reports.append(report.to_json())
        if runtime.rank == 0:
            verdict = "passed" if report.passed else "DIVERGED"
            check = report.checks[0]
            print(f"verify {case.path} {mesh} {recipe}: {verdict}, logits relative {check.relative:.2e} "
                  f"({time.perf_counter() - started:.1f} s)", file=sys.stderr, flush=True)  # fmt: skip
    return reports


def compare_hf(case: HFCase, device: torch.device | str, dp: DataParallel | None = None) -> list[dict]:
    """The case through bridge.compare (module docstring); the JSON reports, one per recipe.

    device: torch's device. dp: this process's rank of a data-parallel mesh
    (bridge.model_compare.data_parallel.DataParallel), which compares its rows of the tokens; None: one process.
    """
    import jax
    import jax.numpy as jnp
    import torch

    from bridge.model_compare.core import compare_here
    from jaxside.models import llama as jax_llama
    from jaxside.sharding import make_mesh
    from torchside.models import llama as torch_llama

    this_device = make_mesh(devices=jax.local_devices()[:1])  # the whole model on this process's device
    reports = []
    for recipe in case.recipes:  # loaded again for each: fresh FP8 scaling state
        model = torch_llama.load_hf(case.path, device=device, dtype=torch.float32)
        twin = jax_llama.load_hf(case.path, mesh=this_device, dtype=jnp.float32)
        tokens = random_tokens(model.config.vocab_size, case.batch_size, case.seq_len)
        tokens = (tokens if dp is None else dp.rows(tokens)).to(device)
        report = compare_here(model, twin, tokens, recipe=recipe, backward=False, copy_params=False, dp=dp)
        report.model, report.mesh = f"llama {case.path}", str(case.mesh)
        reports.append(report.to_json())
    return reports


def compare_hf_ranks(runtime, case: HFCase) -> list[dict]:
    """`compare_hf` as one rank of the co-located data-parallel processes (bridge.runtime.launch's worker)."""
    from bridge.model_compare.data_parallel import rank_of

    return compare_hf(case, runtime.torch_device, rank_of(runtime))


def logits_report(
    model, twin, meshes, mesh, recipe: str, tokens, device_type: str, title: tuple[str, str] = ("llama", "")
) -> VerifyReport:
    """The report of one logits check: torch's Llama against the JAX twin on `tokens` (bridge.logits).

    title: the report's (model, mesh) names.
    """
    from bridge.logits import check_logits
    from twinspec.recipe import recipe_from_name

    report = VerifyReport(*title, recipe, 0, device_type)
    relative, max_abs, nan = check_logits(model, twin, meshes, mesh, recipe_from_name(recipe), tokens)
    limit = tolerance(recipe, "forward", device_type=device_type)
    passed = limit.passes(relative, max_abs, nan)
    report.checks.append(TensorCheck(0, "forward", "logits", relative, max_abs, nan, limit, passed))
    return report


__all__ = [
    "HFCase", "check_forward_options", "check_input", "compare_hf", "compare_hf_ranks", "logits_report",
    "random_tokens", "verify_hf",
]
