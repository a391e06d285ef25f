"""What `shardbridge demo` runs: one frozen options object, checked before any process starts."""

from __future__ import annotations

from dataclasses import dataclass

from bridge.numerics import RECIPES



@dataclass(frozen=True)
class DemoOptions:
    """The demo's knobs (the CLI flags have the same names)."""

    steps: int = 30
    recipe: str = "current"
    dp: int = 2  # training mesh: FSDP2 over dp x TP over tp
    tp: int = 2
    reload_dp: int = 2  # the reload topology: FSDP2 over reload_dp ranks, no TP
    batch_size: int = 8  # global sequences per step
    seq_len: int = 64
    lr: float = 1e-2
    out: str = "shardbridge-demo"
    device: str | None = None  # None: cuda where torch sees a GPU, else cpu

    def __post_init__(self) -> None:
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe {self.recipe!r}: use one of {', '.join(RECIPES)}")
        for name in ("steps", "dp", "tp", "reload_dp", "batch_size", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} {value!r}: pass an integer >= 1")
        if self.tp == 1 and self.reload_dp == self.dp:
            raise ValueError(
                f"--reload-dp {self.reload_dp} with --dp {self.dp} --tp 1 is the training topology: the reload must "
                "run on another one, pick another --reload-dp"
            )
        for ranks, what in ((self.dp, "--dp"), (self.reload_dp, "--reload-dp")):
            if self.batch_size % ranks:
                raise ValueError(f"--batch-size {self.batch_size} must divide over {what} {ranks} ranks")
        if self.seq_len % 32:
            raise ValueError(f"--seq-len {self.seq_len}: pass a multiple of 32 (MXFP8's and 1x128 blocks' tiles)")
        if not self.lr > 0:
            raise ValueError(f"--lr {self.lr}: pass a learning rate > 0")
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"--device {self.device!r}: use cpu or cuda")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp


__all__ = ["DemoOptions"]
