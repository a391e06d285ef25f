"""`bridge.compare`'s report: a bridge.numerics.VerifyReport (same checks, same JSON) that renders its own table."""

from __future__ import annotations

from dataclasses import dataclass

from bridge.numerics import VerifyReport
from bridge.report_table import report_text


@dataclass
class CompareReport(VerifyReport):
    """Every check of one compare() call in order; `first_divergence` is the first that failed."""

    def table(self, width: int = 120) -> str:
        """The table `shardbridge verify` prints (the worst check of each stage, then the verdict), as text."""
        return report_text(self.to_json(), width)


__all__ = ["CompareReport"]
