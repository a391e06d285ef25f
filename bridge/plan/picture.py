"""The PNG of `shardbridge plan show`: bytes on every rank stacked by kind, and each mesh axis's traffic."""

from __future__ import annotations

from pathlib import Path

from bridge.plan.cost import KINDS, MEMORY_KINDS, PlanCost, per_axis

_MIB = 2**20


def save_png(path: str | Path, cost: PlanCost, title: str) -> Path:
    """Two panels: memory per rank (parameters, gradients, optimizer states) and bytes per axis and collective."""
    from matplotlib.figure import Figure  # lazy: matplotlib is slow to import

    figure = Figure(figsize=(11, 4.2), dpi=100, layout="constrained")
    memory_axes, comm_axes = figure.subplots(1, 2)
    ranks = list(range(cost.mesh.size))
    bottom = [0.0] * len(ranks)
    for kind in MEMORY_KINDS:
        heights = [b / _MIB for b in cost.memory()[kind]]
        memory_axes.bar(ranks, heights, bottom=bottom, label=kind)
        bottom = [a + b for a, b in zip(bottom, heights)]
    memory_axes.set_xticks(ranks)
    memory_axes.set_xlabel(f"rank on the mesh {cost.mesh} (row-major)")
    memory_axes.set_ylabel("MiB on the rank")
    memory_axes.set_title("memory per rank")
    memory_axes.legend(fontsize=8)
    table = per_axis(cost.communication.collectives)
    axes_names = list(table) or ["(none)"]
    bottom = [0.0] * len(axes_names)
    for kind in KINDS:
        heights = [table.get(name, {}).get(kind, 0) / _MIB for name in axes_names]
        comm_axes.bar(axes_names, heights, bottom=bottom, label=kind.replace("_", "-"))
        bottom = [a + b for a, b in zip(bottom, heights)]
    comm_axes.set_ylabel("MiB per rank per step")
    comm_axes.set_title("communication of one training step")
    comm_axes.legend(fontsize=8)
    figure.suptitle(title, fontsize=10)
    path = Path(path)
    figure.savefig(path)
    return path
