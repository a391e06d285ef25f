"""The demo's verdict: a row per check (measured against its tolerance, pass or fail, seconds), as a table and JSON."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.markup import escape
from rich.table import Table

REPORT_NAME, LOSS_PLOT_NAME = "report.json", "loss.png"


@dataclass(frozen=True)
class Check:
    """One check: what was measured, the limit it must stay within (<=), and how long its stage took."""

    name: str
    measured: float
    tolerance: float
    unit: str  # what `measured` counts ("rel. error", "tensors differ", ...)
    seconds: float
    detail: str = ""

    @property
    def passed(self) -> bool:
        return math.isfinite(self.measured) and self.measured <= self.tolerance


@dataclass
class DemoReport:
    """Every check of a run, the stage timings and where the pictures are."""

    options: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    losses: list[float] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(check.passed for check in self.checks)

    def to_json(self) -> dict[str, Any]:
        checks = [{**asdict(c), "passed": c.passed} for c in self.checks]
        return {"passed": self.passed, "options": self.options, "checks": checks, "timings": self.timings,
                "losses": self.losses, "files": self.files}  # fmt: skip

    def write(self, out: Path) -> Path:
        path = out / REPORT_NAME
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path


def _number(value: float) -> str:
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    return f"{value:.3g}" if 1e-2 <= abs(value) < 1e4 else f"{value:.2e}"


def table(report: DemoReport) -> Table:
    """The final table: check, measured, tolerance, verdict, seconds, detail."""
    result = Table(title="shardbridge demo")
    for name, justify in (("check", "left"), ("measured", "right"), ("tolerance", "right"), ("", "center"),
                          ("seconds", "right"), ("detail", "left")):  # fmt: skip
        result.add_column(name, justify=justify)
    for check in report.checks:
        verdict = "[green]pass[/]" if check.passed else "[bold red]FAIL[/]"
        measured = f"{_number(check.measured)} {check.unit}"
        result.add_row(escape(check.name), measured, f"<= {_number(check.tolerance)}", verdict,
                       f"{check.seconds:.1f}", escape(check.detail))  # fmt: skip
    return result


def plot_losses(losses: list[float], floor: float, path: Path, recipe: str) -> Path:
    """The training loss per step beside the corpus's floor (torchside.train's plot)."""
    from torchside.train import plot_loss_curves

    plot_loss_curves({f"{recipe}, FSDP2 x TP": losses}, path, floor=floor)
    return path


__all__ = ["LOSS_PLOT_NAME", "REPORT_NAME", "Check", "DemoReport", "plot_losses", "table"]
