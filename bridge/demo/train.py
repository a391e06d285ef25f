"""The demo's first launch (one process per device): train the tiny Llama under FP8 on FSDP2 x TP, save it.

Every rank builds the seeded single-device model's shards and trains `steps` steps with FusedAdam on
the synthetic corpus through torchside.train's own `build_model` and `train_step` (its mesh axes are
named as jaxside's, so bridge.transfer maps them onto the JAX mesh), starts an async DCP save and,
while the files are written, hands the live model to bridge.demo.jax_side for the layout and numerics checks.
Rank 0 returns the trained parameters (full tensors) as the reference of the checkpoint checks.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

from bridge.demo.options import DemoOptions

CHECKPOINT_DIR = "dcp"


def full_parameters(model) -> dict[str, Any]:
    """Every parameter as a full CPU tensor (a collective: every rank calls it)."""
    # Gathering a _StridedShard takes two all-gathers, which torch logs as a warning per parameter and rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return {name: p.full_tensor().detach().cpu() for name, p in model.named_parameters()}


def train_save_check(runtime, options: DemoOptions, out: str) -> dict[str, Any]:
    """Train, save asynchronously, cross-check in JAX; rank 0 returns losses, timings, checks and the reference."""
    import torch.distributed as dist

    from bridge.demo import jax_side
    from torchside import checkpoint
    from torchside.corpus import SyntheticCorpus
    from torchside.models.llama import LLAMA_CONFIGS
    from torchside.recipe import recipe_from_name
    from torchside.train import LossLog, TrainOptions, build_model, build_optimizer, train_step

    timings: dict[str, float] = {}
    started = time.perf_counter()
    train_options = TrainOptions(
        config="tiny", steps=options.steps, batch_size=options.batch_size, seq_len=options.seq_len, lr=options.lr,
        warmup_steps=min(3, options.steps), recipe=options.recipe, dp=options.dp, tp=options.tp,
        device=runtime.device_type,
    )  # fmt: skip
    model, meshes = build_model(train_options)
    optimizer = build_optimizer(model, train_options)
    corpus = SyntheticCorpus(LLAMA_CONFIGS["tiny"].vocab_size)
    recipe = recipe_from_name(options.recipe)  # the one recipe object of this process: training and both logits
    timings["build"] = time.perf_counter() - started

    started, log = time.perf_counter(), LossLog(train_options, 0, runtime.torch_device, writes=False)
    with _progress(runtime.rank == 0, options.steps) as advance:
        for step in range(options.steps):
            log.add(step, *train_step(model, optimizer, corpus, train_options, meshes, recipe, step))
            log.flush(options.tp)  # every step: the bar shows the loss
            advance(log.losses[-1])
    losses = log.losses
    timings["train"] = time.perf_counter() - started

    started = time.perf_counter()
    handle = checkpoint.save(f"{out}/{CHECKPOINT_DIR}", model, optimizer, step=options.steps, async_mode="thread")
    timings["save (staging)"] = time.perf_counter() - started
    reference = full_parameters(model)  # while the files are written in the background
    started = time.perf_counter()
    jax_result = jax_side.cross_check(runtime, model, meshes, options, recipe, corpus, out, reference)
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


__all__ = ["CHECKPOINT_DIR", "full_parameters", "train_save_check"]
