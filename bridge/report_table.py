"""The table of a verify or compare report: the worst check of each stage, then the verdict or first divergence.

Library code (bridge.model_compare's CompareReport.table) and `shardbridge verify` print the same
text; the report is the JSON form of a bridge.numerics.VerifyReport.
"""

from __future__ import annotations

import io

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def render(console: Console, report: dict) -> None:
    """One table per (mesh, recipe): the worst check of each stage, and the first divergence."""
    steps = f", {report['steps']} steps" if report["steps"] else ""  # none: a forward only (--hf)
    title = f"{report['model']} on {report['mesh']}, recipe {report['recipe']}{steps}"
    table = Table(title=escape(title))
    table.add_column("stage", style="bold")
    table.add_column("checks", justify="right")
    table.add_column("worst relative", justify="right")
    table.add_column("worst max-abs", justify="right")
    table.add_column("worst tensor", overflow="fold")
    table.add_column("verdict")
    stages: dict[str, list[dict]] = {}
    for check in report["checks"]:
        stages.setdefault(check["stage"], []).append(check)
    for stage, checks in stages.items():
        worst = max(checks, key=lambda c: (not c["passed"], c["relative"]))
        failed = sum(not c["passed"] for c in checks)
        verdict = "[green]ok[/]" if not failed else f"[red]{failed} diverge[/]"
        table.add_row(stage, str(len(checks)), f"{worst['relative']:.2e}", f"{worst['max_abs']:.2e}",
                      escape(f"{worst['name']} (step {worst['step']})"), verdict)  # fmt: skip
    console.print(table)
    first = report["first_divergence"]
    if first is None:
        console.print("[bold green]verdict[/] torch and JAX agree within bridge.numerics' tolerances")
        return
    limit = first["tolerance"]
    console.print(
        f"[bold red]first divergence[/] step {first['step']}, {first['stage']}, layer {escape(first['layer'])}, "
        f"tensor {escape(first['name'])}: relative {first['relative']:.3e} (limit {limit['relative']}), "
        f"max-abs {first['max_abs']:.3e} (limit {limit['max_abs']}){', NaN' if first['nan'] else ''}",
        soft_wrap=True,
    )


def report_text(report: dict, width: int = 120) -> str:
    """What `render` prints, as plain text of `width` columns."""
    buffer = io.StringIO()
    render(Console(file=buffer, width=width, color_system=None, soft_wrap=True), report)
    return buffer.getvalue()


__all__ = ["render", "report_text"]
