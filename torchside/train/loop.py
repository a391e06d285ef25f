"""The training loop: setup, the steps, checkpoints and the log, then the run's summary."""

from __future__ import annotations

import contextlib
import functools
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from torchside.corpus import SyntheticCorpus
from torchside.models.llama import LLAMA_CONFIGS, Llama
from torchside.recipe import recipe_from_name
from torchside.train.checkpointing import Checkpoints
from torchside.train.graphs import GraphedTrainStep
from torchside.train.options import TrainOptions, TrainSummary
from torchside.train.report import PLOT_NAME, LossLog, plot_loss_curves
from torchside.train.setup import build_model, build_optimizer, init_distributed
from torchside.train.step import train_step


def _progress(enabled: bool):
    if not enabled:
        return contextlib.nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    return Progress(*columns, TextColumn("{task.fields[status]}"), console=Console(stderr=True))


def _count_nonfinite(model: Llama) -> int:
    total = torch.zeros((), dtype=torch.long)
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += (~torch.isfinite(local.detach())).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(total)
    return int(total)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(options: TrainOptions) -> TrainSummary:
    """Run `options.steps` steps (from the latest checkpoint with `resume`); see the docstring of torchside.train."""
    init_distributed(options)
    device = torch.device(options.device)
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    corpus = SyntheticCorpus(LLAMA_CONFIGS[options.config].vocab_size, seed=options.seed)
    model, meshes = build_model(options)
    optimizer = build_optimizer(model, options)
    checkpoints = Checkpoints(options, model, optimizer)
    first_step = checkpoints.resume() if options.resume else 0
    recipe = recipe_from_name(options.recipe)
    if options.cuda_graphs:  # built after the resume, which loads the optimizer's lr values
        run_step = GraphedTrainStep(model, optimizer, corpus, options, recipe)
    else:
        run_step = functools.partial(train_step, model, optimizer, corpus, options, meshes, recipe)
    log = LossLog(options, first_step, device, writes=is_rank0)
    timed_from = min(first_step + options.log_every, options.steps)
    with _progress(options.progress and is_rank0) as progress:
        task = progress.add_task(options.recipe, total=options.steps, completed=first_step, status="") if progress else None
        for step in range(first_step, options.steps):
            if step == timed_from:
                _sync(device)
                started = time.perf_counter()
            log.add(step, *run_step(step))
            done = step + 1
            if done % options.log_every == 0 or done == options.steps:
                log.flush(options.tp)
            if progress is not None:
                status = f"loss {log.losses[-1]:.4f}" if log.losses else ""
                progress.update(task, completed=done, status=status)
            if options.checkpoint_every and done % options.checkpoint_every == 0 and done < options.steps:
                checkpoints.save(done)
    _sync(device)
    measured_steps = options.steps - timed_from
    tokens = measured_steps * options.batch_size * options.seq_len
    tokens_per_s = tokens / (time.perf_counter() - started) if measured_steps else math.nan
    checkpoints.close()
    summary = _summarize(options, corpus, model, log, first_step, tokens_per_s)
    if options.out and is_rank0:
        plot_loss_curves({options.recipe: [r["loss"] for r in log.records]}, Path(options.out, PLOT_NAME),
                         floor=summary.loss_floor)
    return summary


def _summarize(options, corpus, model, log, first_step, tokens_per_s) -> TrainSummary:
    losses = log.losses
    tail = [r["loss"] for r in log.records[-50:]]
    return TrainSummary(
        first_step=first_step,
        losses=losses,
        final_loss=sum(tail) / len(tail) if tail else math.nan,
        loss_floor=corpus.loss_floor(options.seq_len),
        tokens_per_s=tokens_per_s,
        nonfinite_losses=sum(not math.isfinite(x) for x in losses),
        nonfinite_params=_count_nonfinite(model),
        parameters=LLAMA_CONFIGS[options.config].num_parameters(),
    )
