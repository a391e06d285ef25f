"""`bridge.compare`'s report: a bridge.numerics.VerifyReport (same checks, same JSON) that renders its own table."""

from __future__ import annotations

import io
from dataclasses import dataclass

from bridge.numerics import VerifyReport


@dataclass
class CompareReport(VerifyReport):
    """Every check of one compare() call in order; `first_divergence` is the first that failed."""

    def table(self, width: int = 120) -> str:
        """The table `shardbridge verify` prints (the worst check of each stage, then the verdict), as text."""
        from rich.console import Console

        from bridge.commands.verify import render

        buffer = io.StringIO()
        render(Console(file=buffer, width=width, color_system=None, soft_wrap=True), self.to_json())
        return buffer.getvalue()


__all__ = ["CompareReport"]
