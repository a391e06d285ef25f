"""The demo's first launch (one process per device): train the tiny Llama under FP8 on FSDP2 x TP, save it.

Every rank builds the seeded single-device model's shards (torchside.train's build steps, on a mesh
whose axes are named as jaxside's, so that bridge.transfer maps them onto the JAX mesh), trains
`steps` steps with FusedAdam on the synthetic corpus, starts an async DCP save, and, while the
files are written, hands the live model to bridge.demo_jax for the layout and numerics checks.
Rank 0 returns the trained parameters (full tensors) as the reference of the checkpoint checks.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from typing import Any

from bridge.demo_options import MESH_AXES, DemoOptions

CHECKPOINT_DIR = "dcp"


def build_llama(runtime, dp: int, tp: int, seed: int = 0):
    """The tiny Llama's shards on a (1, dp, tp) mesh named MESH_AXES, from rank 0's seeded initialization."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from torchside.models.llama import LLAMA_CONFIGS, Llama
    from torchside.models.llama_parallel import LlamaMeshes, load_full_state, parallelize_llama
    from torchside.modules import ModuleConfig

    config = LLAMA_CONFIGS["tiny"]
    full = None
    if dist.get_rank() == 0:
        torch.manual_seed(seed)
        full = Llama(config)
    world = init_device_mesh(runtime.device_type, (1, dp, tp), mesh_dim_names=MESH_AXES)
    data = world["dp_shard"] if dp > 1 else None
    tp_mesh = world["tp"] if tp > 1 else None
    if dp > 1 and tp > 1:
        weight = world["dp_shard", "tp"]._flatten("dp_shard_tp")  # as llama_parallel.build_meshes does
    else:
        weight = data if dp > 1 else tp_mesh
    meshes = LlamaMeshes(world, data, tp_mesh, weight)
    model = Llama(config, device="meta", module_config=ModuleConfig(tp_size=tp))
    with warnings.catch_warnings():  # materializing on a CPU mesh warns that DTensor RNG support is partial
        warnings.filterwarnings("ignore", message="DTensor random operators")
        parallelize_llama(model, meshes, device=runtime.torch_device)
    load_full_state(model, None if full is None else full.state_dict(), from_rank0=True)
    return model, meshes


def full_parameters(model) -> dict[str, Any]:
    """Every parameter as a full CPU tensor (a collective: every rank calls it)."""
    # Gathering a _StridedShard takes two all-gathers, which torch logs as a warning per parameter and rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}


def train_save_check(runtime, options: DemoOptions, out: str) -> dict[str, Any]:
    """Train, save asynchronously, cross-check in JAX; rank 0 returns losses, timings, checks and the reference."""
    import torch
    import torch.distributed as dist

    from bridge import demo_jax
    from torchside import checkpoint
    from torchside.corpus import SyntheticCorpus
    from torchside.models.llama import LLAMA_CONFIGS
    from torchside.models.llama_parallel import sum_data_parallel_gradients
    from torchside.train import RECIPES, TrainOptions, build_optimizer, learning_rate, local_batch, loss_of

    timings: dict[str, float] = {}
    started = time.perf_counter()
    train_options = TrainOptions(
        config="tiny", steps=options.steps, batch_size=options.batch_size, seq_len=options.seq_len, lr=options.lr,
        warmup_steps=min(3, options.steps), recipe=options.recipe, dp=options.dp, tp=options.tp,
        device=runtime.device_type,
    )  # fmt: skip
    model, meshes = build_llama(runtime, options.dp, options.tp)
    optimizer = build_optimizer(model, train_options)
    corpus = SyntheticCorpus(LLAMA_CONFIGS["tiny"].vocab_size)
    recipe = RECIPES[options.recipe]()
    timings["build"] = time.perf_counter() - started

    started, losses = time.perf_counter(), []
    with _progress(runtime.rank == 0, options.steps) as advance:
        for step in range(options.steps):
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(train_options, step)
            inputs, targets = local_batch(corpus, train_options, meshes, step)
            loss = loss_of(model, inputs, targets, recipe, dist.group.WORLD, options.batch_size * options.seq_len)
            sum_data_parallel_gradients(model, meshes)
            torch.nn.utils.clip_grad_norm_(model.parameters(), train_options.clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total = loss.detach().clone()
            dist.all_reduce(total)  # each DP rank holds its part of the mean, each TP rank a copy of it
            losses.append(total.item() / options.tp)
            advance(losses[-1])
    timings["train"] = time.perf_counter() - started

    started = time.perf_counter()
    handle = checkpoint.save(f"{out}/{CHECKPOINT_DIR}", model, optimizer, step=options.steps, async_mode="thread")
    timings["save (staging)"] = time.perf_counter() - started
    reference = full_parameters(model)  # while the files are written in the background
    started = time.perf_counter()
    jax_result = demo_jax.cross_check(runtime, model, meshes, options, corpus, out, reference)
    timings["JAX layouts + forward"] = time.perf_counter() - started
    started = time.perf_counter()
    path = handle.wait()
    dist.barrier()  # rank 0 published the step before anyone reports it
    timings["save (rest of the async write)"] = time.perf_counter() - started
    if runtime.rank != 0:
        return {}
    return {
        "losses": losses,
        "loss_floor": corpus.loss_floor(options.seq_len),
        "checkpoint": str(path),
        "reference": reference,
        "timings": timings,
        **jax_result,
    }


@contextlib.contextmanager
def _progress(show: bool, steps: int):
    """A rich progress bar on rank 0's stderr; yields `advance(loss)`."""
    if not show:
        yield lambda loss: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    columns += (TextColumn("{task.fields[status]}"),)
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("train", total=steps, status="")
        yield lambda loss: progress.update(task, advance=1, status=f"loss {loss:.3f}")


__all__ = ["CHECKPOINT_DIR", "build_llama", "full_parameters", "train_save_check"]
