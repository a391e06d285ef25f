"""A run's checkpoints: periodic async DCP saves and the resume."""

from __future__ import annotations

from pathlib import Path

from torchside import checkpoint
from torchside.checkpoint.commit import committed_steps
from torchside.models.llama import Llama
from torchside.optim import FusedAdam
from torchside.train.options import TrainOptions


class Checkpoints:
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
