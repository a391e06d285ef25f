"""A run's outputs: the loss log (`losses.jsonl`) and the loss plot (`losses.png`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from torchside.train.options import TrainOptions

LOG_NAME, PLOT_NAME = "losses.jsonl", "losses.png"


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
