"""The options of one training run, what it reports, and its learning-rate schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from torchside.models.llama import LLAMA_CONFIGS
from torchside.recipe import recipe_names

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
# inductor generates code; aot_eager (AOTAutograd's forward and backward graphs, their ops run eagerly) and eager
# (Dynamo's graph only) find where a difference or a failure comes from.
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
CUDA_GRAPH_COMPILE_MODES = ("reduce-overhead", "max-autotune")  # the modes that capture CUDA graphs themselves


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
    compile: bool = False  # torch.compile each TransformerLayer (fullgraph), before FSDP2 (setup.compile_blocks)
    compile_mode: str = "default"  # torch.compile's mode; reduce-overhead graphs each block (CUDA)
    compile_backend: str = "inductor"  # torch.compile's backend; aot_eager runs the traced ops as eagerly

    def __post_init__(self) -> None:
        choices = {
            "config": LLAMA_CONFIGS,
            "recipe": recipe_names(),
            "dtype": DTYPES,
            "compile_mode": COMPILE_MODES,
            "compile_backend": COMPILE_BACKENDS,
        }
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
        for name, default in (("compile_mode", "default"), ("compile_backend", "inductor")):
            if getattr(self, name) != default and not self.compile:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"TrainOptions: {flag} {getattr(self, name)} applies to --compile: add --compile")
        if self.compile_mode != "default" and self.compile_backend != "inductor":
            raise ValueError(f"TrainOptions: --compile-mode {self.compile_mode} is inductor's: drop it or the backend")
        if self.cuda_graphs and self.compile_mode in CUDA_GRAPH_COMPILE_MODES:
            raise ValueError(
                f"TrainOptions: --cuda-graphs captures the whole step, --compile-mode {self.compile_mode} captures "
                "each block again: pass --compile-mode default with --cuda-graphs, or drop --cuda-graphs"
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
