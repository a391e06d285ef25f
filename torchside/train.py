"""Train the Llama-style model on the synthetic corpus: `python -m torchside.train --config tiny --steps 100`.

One process per device; several through torchrun, e.g. FSDP 2 x TP 2 on 4 GPUs:

    torchrun --nproc-per-node 4 -m torchside.train --config 125m --dp 2 --tp 2 --recipe current --out runs/a

The mesh is (replicate, dp, tp) (axes named torchside.parallel.MESH_AXES, as JAX's) and must hold the
launcher's world size. Every rank builds batch `step` of the corpus (a pure function of the seed and
the step) and keeps its data-parallel rows; the model starts from one seeded single-device
initialization, whatever the mesh; each step is `train_step` (the demo's too). Output in
`--out`: `losses.jsonl` (one JSON object per step: step, loss, lr, grad_norm) and `losses.png`;
a summary (final loss, tokens/s, non-finite losses) as one JSON line on stdout. With
`--checkpoint-dir`, an async DCP checkpoint every `--checkpoint-every` steps; `--resume` continues
from the latest one, on any mesh: the steps before it stay in the log, the later ones are redone.

Losses are copied to the host once per `--log-every` steps, so that the GPU is never waited on.

`--cuda-graphs` (one CUDA device): after 3 eager warm-up steps the whole step (forward, backward, FP8
scale and amax-history updates, gradient clipping, FusedAdam with the learning rate and step counts on the
device) is captured once in a CUDA graph and replayed; see `GraphedTrainStep` and torchside.cuda_graphs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchside import checkpoint
from torchside.autocast import fp8_autocast
from torchside.checkpoint.commit import committed_steps
from torchside.corpus import SyntheticCorpus
from torchside.cuda_graphs import CapturedCall
from torchside.models.llama import LLAMA_CONFIGS, Llama
from torchside.models.llama_parallel import (
    LlamaMeshes,
    build_meshes,
    load_full_state,
    parallelize_llama,
    sum_data_parallel_gradients,
)
from torchside.modules import ModuleConfig
from torchside.optim import FusedAdam
from torchside.recipe import Recipe, recipe_from_name, recipe_names

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LOG_NAME, PLOT_NAME = "losses.jsonl", "losses.png"


@dataclass(frozen=True)
class TrainOptions:
    """One run; the command-line flags have the same names."""

    config: str = "tiny"
    steps: int = 100
    batch_size: int = 8  # global, split over the data-parallel ranks
    seq_len: int = 64
    lr: float = 3e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    recipe: str = "off"
    dp: int = 1
    tp: int = 1
    replicate: int = 1
    sequence_parallel: bool = False
    dtype: str = "fp32"
    device: str = "cpu"
    seed: int = 0
    out: str | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    keep_last: int = 2
    resume: bool = False
    log_every: int = 10
    progress: bool = True
    cuda_graphs: bool = False  # capture the whole step in a CUDA graph (GraphedTrainStep)

    def __post_init__(self) -> None:
        choices = {"config": LLAMA_CONFIGS, "recipe": recipe_names(), "dtype": DTYPES}
        for name, table in choices.items():
            if getattr(self, name) not in table:
                raise ValueError(f"TrainOptions({name}={getattr(self, name)!r}): use one of {', '.join(table)}")
        for name in ("steps", "batch_size", "seq_len", "dp", "tp", "replicate", "log_every", "keep_last"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainOptions({name}={value!r}): pass an integer >= 1")
        if self.batch_size % (self.dp * self.replicate):
            raise ValueError(
                f"TrainOptions(batch_size={self.batch_size}) must divide by the {self.dp * self.replicate} "
                "data-parallel ranks (dp * replicate): pick a multiple"
            )
        if self.sequence_parallel and self.seq_len % self.tp:
            raise ValueError(f"TrainOptions: sequence parallelism splits seq_len={self.seq_len} over tp={self.tp}")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ValueError("TrainOptions: --checkpoint-every and --resume need --checkpoint-dir")
        if self.cuda_graphs and (self.device != "cuda" or self.world_size > 1):
            raise ValueError(
                f"TrainOptions: --cuda-graphs captures the step of one CUDA device (got --device {self.device}, "
                f"{self.world_size} ranks): pass --device cuda without --dp/--tp/--replicate, or drop --cuda-graphs"
            )

    @property
    def world_size(self) -> int:
        return self.replicate * self.dp * self.tp


@dataclass(frozen=True)
class TrainSummary:
    """What a run reports: losses per step (from the first step of this process), speed, health."""

    first_step: int
    losses: list[float]
    final_loss: float  # mean of the last min(50, steps) losses
    loss_floor: float  # the corpus's best possible loss
    tokens_per_s: float  # after the first log_every steps (compilation, autotuning)
    nonfinite_losses: int
    nonfinite_params: int
    parameters: int


def learning_rate(options: TrainOptions, step: int) -> float:
    """Linear warmup, then cosine decay to a tenth (a function of the step: nothing to checkpoint)."""
    if step < options.warmup_steps:
        return options.lr * (step + 1) / options.warmup_steps
    progress = (step - options.warmup_steps) / max(1, options.steps - options.warmup_steps)
    return options.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---- setup


def _init_distributed(options: TrainOptions) -> None:
    """A process group when the mesh has more than one rank (torchrun's environment gives the rendezvous)."""
    if options.world_size == 1 or dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != options.world_size:
        raise ValueError(
            f"--replicate {options.replicate} x --dp {options.dp} x --tp {options.tp} = {options.world_size} "
            f"ranks, but the launcher started {world}: run torchrun --nproc-per-node {options.world_size}"
        )
    if options.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if options.device == "cuda" else "gloo")


def build_model(options: TrainOptions) -> tuple[Llama, LlamaMeshes | None]:
    """The model on its mesh, starting from the seeded single-device initialization (built on rank 0)."""
    config = LLAMA_CONFIGS[options.config]
    dtype, device = DTYPES[options.dtype], torch.device(options.device)
    full_model = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.manual_seed(options.seed)
        full_model = Llama(config, params_dtype=dtype)  # on the CPU: the same values on any machine
    if options.world_size == 1:
        return full_model.to(device), None
    meshes = build_meshes(device.type, dp=options.dp, tp=options.tp, replicate=options.replicate)
    module_config = ModuleConfig(tp_size=options.tp, sequence_parallel=options.sequence_parallel)
    model = Llama(config, params_dtype=dtype, device="meta", module_config=module_config)
    with warnings.catch_warnings():  # materializing on a CPU mesh warns that DTensor RNG support is partial
        warnings.filterwarnings("ignore", message="DTensor random operators")
        parallelize_llama(model, meshes, device=device)
    load_full_state(model, None if full_model is None else full_model.state_dict(), from_rank0=True)
    return model, meshes


def build_optimizer(model: Llama, options: TrainOptions, *, capturable: bool | None = None) -> FusedAdam:
    """AdamW with decay on matrices only; fp32 masters for bf16 parameters; capturable (default: under --cuda-graphs)."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": options.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    capturable = options.cuda_graphs if capturable is None else capturable
    master_weights = options.dtype == "bf16"
    return FusedAdam(groups, lr=options.lr, betas=(0.9, 0.95), master_weights=master_weights, capturable=capturable)


# ---- one step


def _host_tokens(corpus: SyntheticCorpus, options: TrainOptions, meshes: LlamaMeshes | None, step: int):
    """This rank's data-parallel rows of batch `step` [b, S + 1] on the host (pinned for a CUDA device)."""
    tokens = corpus.batch(step, options.batch_size, options.seq_len)
    if meshes is not None:
        tokens = tokens.chunk(meshes.data_parallel_size)[meshes.data_parallel_rank()]
    if torch.device(options.device).type == "cuda":
        tokens = tokens.pin_memory()  # an asynchronous copy: the host runs ahead of the GPU
    return tokens


def local_batch(corpus: SyntheticCorpus, options: TrainOptions, meshes: LlamaMeshes | None, step: int):
    """(inputs [b, S], targets [b, S]) of this rank's data-parallel rows of batch `step`, on the device."""
    tokens = _host_tokens(corpus, options, meshes, step).to(options.device, non_blocking=True)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(
    model: Llama, inputs_BS, targets_BS, recipe: Recipe | None, amax_group, global_tokens: int
) -> torch.Tensor:
    """This rank's tokens' next-token cross entropy (fp32) over the global batch's `global_tokens`; backward done.

    Summed over the data-parallel ranks (as FSDP2 sums their gradients, see llama_parallel), it is the
    global mean. A vocab-split logits DTensor goes through torch's loss_parallel (no all-gather of V).
    """
    with fp8_autocast(enabled=recipe is not None, recipe=recipe, amax_reduction_group=amax_group):
        logits_SBV = model(inputs_BS)
    vocab_split = isinstance(logits_SBV, DTensor)
    with loss_parallel() if vocab_split else contextlib.nullcontext():
        token_losses = F.cross_entropy(logits_SBV.flatten(0, 1).float(), targets_BS.t().flatten(), reduction="sum")
        loss = token_losses / global_tokens
        loss.backward()
    return loss.to_local() if vocab_split else loss


def train_step(
    model: Llama,
    optimizer: FusedAdam,
    corpus: SyntheticCorpus,
    options: TrainOptions,
    meshes: LlamaMeshes | None,
    recipe: Recipe | None,
    step: int,
) -> tuple[float, torch.Tensor, torch.Tensor]:
    """Step `step` on its batch: (lr, this rank's part of the loss, global gradient norm), on the device.

    The amax group is the world: every rank casts with the single-device run's scales.
    """
    lr = learning_rate(options, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    inputs, targets = local_batch(corpus, options, meshes, step)
    amax_group = dist.group.WORLD if dist.is_initialized() else None
    loss = loss_of(model, inputs, targets, recipe, amax_group, options.batch_size * options.seq_len)
    sum_data_parallel_gradients(model, meshes)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), options.clip or math.inf)
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return lr, loss, grad_norm


class GraphedTrainStep:
    """train_step on one device, captured in a CUDA graph after 3 eager warm-up steps (`--cuda-graphs`).

    Static state the graph reads: the token buffer (refilled per step by an asynchronous copy), the
    learning rate (a device scalar in every param group: FusedAdam must be `capturable`) and the grads,
    allocated once and zeroed in place at the start of each step (backward then accumulates into them),
    because FusedAdam's launch tables hold their addresses. The FP8 state (DelayedScaling scales and amax
    histories, rolled by torch ops at the regions' ends) updates inside the graph. `capture=False` runs the
    same work eagerly: the reference a graphed run equals bit for bit. A call returns (lr, loss, grad norm)
    like train_step, the tensors copied out of the graph's static outputs.
    """

    def __init__(
        self,
        model: Llama,
        optimizer: FusedAdam,
        corpus: SyntheticCorpus,
        options: TrainOptions,
        recipe: Recipe | None,
        *,
        capture: bool = True,
    ) -> None:
        if not optimizer.capturable:
            raise ValueError("GraphedTrainStep needs FusedAdam(capturable=True): the step count and lr stay on the device")
        device = torch.device(options.device)
        self.model, self.optimizer, self.corpus, self.options, self.recipe = model, optimizer, corpus, options, recipe
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != device.type:
                raise ValueError(f"GraphedTrainStep: a parameter is on {p.device}, the step on {device}: move the model")
            p.grad = torch.zeros_like(p)
        self.grads = [p.grad for p in self.params]
        self.tokens = torch.zeros(options.batch_size, options.seq_len + 1, dtype=torch.long, device=device)
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        for group in optimizer.param_groups:
            group["lr"] = self.lr
        self.call = CapturedCall(self._step, capture=capture)

    def _step(self) -> tuple[torch.Tensor, torch.Tensor]:
        torch._foreach_zero_(self.grads)
        global_tokens = self.options.batch_size * self.options.seq_len
        loss = loss_of(self.model, self.tokens[:, :-1], self.tokens[:, 1:], self.recipe, None, global_tokens)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.options.clip or math.inf)
        self.optimizer.step()
        return loss.detach(), grad_norm

    def __call__(self, step: int) -> tuple[float, torch.Tensor, torch.Tensor]:
        lr = learning_rate(self.options, step)
        self.lr.fill_(lr)
        self.tokens.copy_(_host_tokens(self.corpus, self.options, None, step), non_blocking=True)
        loss, grad_norm = self.call()
        if any(grad is not p.grad for grad, p in zip(self.grads, self.params, strict=True)):
            raise RuntimeError("GraphedTrainStep: a parameter's .grad was replaced; the graph writes the old one")
        return lr, loss.clone(), grad_norm.clone()


# ---- checkpoints


class _Checkpoints:
    """Periodic async DCP saves and resume through torchside.checkpoint; idle without a directory."""

    def __init__(self, options: TrainOptions, model: Llama, optimizer: FusedAdam) -> None:
        self.directory = options.checkpoint_dir
        self.model, self.optimizer, self.keep_last = model, optimizer, options.keep_last
        self.pending: checkpoint.SaveHandle | None = None

    def resume(self) -> int:
        """Load the latest committed checkpoint (any mesh wrote it); the step to continue from, 0 if none."""
        if self.directory is None or not committed_steps(Path(self.directory)):
            return 0
        return checkpoint.load(self.directory, self.model, self.optimizer).step

    def save(self, step: int) -> None:
        """Stage `step` and write it in a background thread (the previous save is awaited first)."""
        self.pending = checkpoint.save(
            self.directory, self.model, self.optimizer, step=step, async_mode="thread", keep_last=self.keep_last
        )

    def close(self) -> None:
        """Wait for the last async save."""
        if self.pending is not None:
            self.pending.wait()


# ---- outputs


def _read_log(path: Path, before_step: int) -> list[dict]:
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r["step"] < before_step]


def plot_loss_curves(curves: dict[str, Sequence[float]], path: Path, *, floor: float | None = None) -> None:
    """Loss per step of each run (label -> losses from step 0) on one log-scale PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import ScalarFormatter

    figure, axes = plt.subplots(figsize=(8, 4.5))
    for label, losses in curves.items():
        axes.plot(range(len(losses)), losses, label=label, linewidth=1)
    if floor is not None:
        axes.axhline(floor, color="grey", linestyle="--", linewidth=1, label=f"corpus floor {floor:.3f}")
    axes.set(xlabel="step", ylabel="cross entropy (nats)", yscale="log")
    axes.yaxis.set_major_formatter(ScalarFormatter())
    axes.yaxis.set_minor_formatter(ScalarFormatter())
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


class LossLog:
    """Per-step records, held on the device and flushed (one host copy, one all-reduce) every log_every steps."""

    def __init__(self, options: TrainOptions, first_step: int, device: torch.device, writes: bool) -> None:
        self.options, self.device = options, device
        self.path = Path(options.out, LOG_NAME) if options.out and writes else None
        self.records = _read_log(self.path, first_step) if self.path else []
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
        self.pending: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []
        self.losses: list[float] = []

    def add(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self.pending.append((step, lr, loss.detach().float(), grad_norm.detach().float()))

    def flush(self, tp: int) -> None:
        if not self.pending:
            return
        losses = torch.stack([loss for _, _, loss, _ in self.pending])
        if dist.is_initialized():  # each DP rank holds a part of the mean, each TP rank a copy of it
            dist.all_reduce(losses)
            losses /= tp
        norms = torch.stack([norm for _, _, _, norm in self.pending])  # global already
        records = [
            {"step": step, "loss": loss, "lr": lr, "grad_norm": norm}
            for (step, lr, _, _), loss, norm in zip(self.pending, losses.tolist(), norms.tolist(), strict=True)
        ]
        self.pending.clear()
        self.losses.extend(r["loss"] for r in records)
        self.records.extend(records)
        if self.path:
            with self.path.open("a") as log:
                log.writelines(json.dumps(r) + "\n" for r in records)


# ---- the loop


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
    """Run `options.steps` steps (from the latest checkpoint with `resume`); see the module docstring."""
    _init_distributed(options)
    device = torch.device(options.device)
    is_rank0 = not dist.is_initialized() or dist.get_rank() == 0
    corpus = SyntheticCorpus(LLAMA_CONFIGS[options.config].vocab_size, seed=options.seed)
    model, meshes = build_model(options)
    optimizer = build_optimizer(model, options)
    checkpoints = _Checkpoints(options, model, optimizer)
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


# ---- command line


def parse_args(argv: Sequence[str] | None = None) -> TrainOptions:
    """TrainOptions from flags named like its fields (--batch-size, --no-progress, ...)."""
    parser = argparse.ArgumentParser(prog="python -m torchside.train", description=__doc__.split("\n\n")[0])
    for field in dataclasses.fields(TrainOptions):
        flag = "--" + field.name.replace("_", "-")
        if field.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default)
        else:
            kind = {"int": int, "float": float}.get(field.type, str)
            parser.add_argument(flag, type=kind, default=field.default)
    args = parser.parse_args(argv)
    try:
        return TrainOptions(**vars(args))
    except ValueError as error:
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    summary = train(options)
    if not dist.is_initialized() or dist.get_rank() == 0:
        report = dataclasses.asdict(summary)
        del report["losses"]
        print(json.dumps(report), flush=True)
    if dist.is_initialized():
        # Every rank past its last collective (rank 0 was still plotting) before any tears gloo down: a rank
        # destroying its groups while a peer still uses them aborted the process ("terminate called without an
        # active exception", seen twice in CI on the 2-rank resume test).
        dist.barrier()
        dist.destroy_process_group()
    return 0 if summary.nonfinite_losses == 0 and summary.nonfinite_params == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
