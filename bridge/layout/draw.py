"""Pictures of shard maps: a rich text grid for the terminal and a matplotlib PNG.

Both draw the same `owner_grid`: the tensor cut into rectangular blocks, each labelled
by the ranks (devices) holding it. Neighbouring rows or columns with the same holders
merge, so an 8x16 weight sharded by rows draws as 8 blocks, not 128 cells. Pictures
cover 1-D and 2-D tensors; a 1-D tensor draws as one row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich import box
from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from bridge.layout import ShardMap

# A block takes the colour of its first holder's rank (mod the palette).
_TERMINAL_COLOURS = ("red", "green", "blue", "magenta", "cyan", "yellow", "bright_red", "bright_green")
_PNG_COLOURMAP = "tab10"
_MAX_LABELLED_BLOCKS = 256  # beyond this a PNG's labels would overlap; colours still show the layout
_MAX_TEXT_ROWS, _MAX_TEXT_COLS = 64, 24  # a terminal grid larger than this says so instead of scrolling away


@dataclass(frozen=True)
class OwnerGrid:
    """Row and column intervals of the drawn tensor, and the ranks holding each block."""

    row_bounds: tuple[int, ...]  # block i spans rows row_bounds[i]:row_bounds[i+1]
    col_bounds: tuple[int, ...]
    holders: tuple[tuple[tuple[int, ...], ...], ...]  # [block row][block col] -> sorted ranks


def owner_grid(shard_map: ShardMap) -> OwnerGrid:
    """Who holds each block of a 1-D or 2-D tensor, with equal neighbours merged."""
    if len(shard_map.global_shape) not in (1, 2):
        raise ValueError(f"pictures cover 1-D and 2-D tensors; shape {shard_map.global_shape} needs --json instead")
    drawn = {c: (held if len(held) == 2 else (np.zeros(1, np.int64), *held)) for c, held in shard_map.indices.items()}
    rows, cols = (shard_map.global_shape if len(shard_map.global_shape) == 2 else (1, *shard_map.global_shape))
    row_bounds = _run_bounds([held[0] for held in drawn.values()], rows)
    col_bounds = _run_bounds([held[1] for held in drawn.values()], cols)
    # Bounds include every run edge, so a block is held whole or not at all: test its first element.
    holds = {
        shard_map.mesh.rank_of(c): np.outer(np.isin(row_bounds[:-1], held[0]), np.isin(col_bounds[:-1], held[1]))
        for c, held in drawn.items()
    }
    holders = [
        [tuple(sorted(rank for rank, mask in holds.items() if mask[i, j])) for j in range(len(col_bounds) - 1)]
        for i in range(len(row_bounds) - 1)
    ]
    row_bounds, holders = _merge_equal_neighbours(row_bounds, holders)
    col_bounds, transposed = _merge_equal_neighbours(col_bounds, [list(column) for column in zip(*holders)])
    holders = [list(row) for row in zip(*transposed)]
    return OwnerGrid(tuple(row_bounds), tuple(col_bounds), tuple(tuple(row) for row in holders))


def text_grid(shard_map: ShardMap, title: str) -> Panel:
    """A rich panel: the tensor's blocks, each showing the ranks that hold it."""
    grid = owner_grid(shard_map)
    shape = (len(grid.row_bounds) - 1, len(grid.col_bounds) - 1)
    if shape[0] > _MAX_TEXT_ROWS or shape[1] > _MAX_TEXT_COLS:
        note = f"{shape[0]} x {shape[1]} blocks: too many to draw here; see the PNG (--png) or the map (--json)"
        return Panel(Text(note), title=title, expand=False)
    table = Table(box=box.SQUARE, show_lines=True)
    table.add_column("dim0 \\ dim1" if len(shard_map.global_shape) == 2 else "", justify="right", style="dim")
    for start, stop in zip(grid.col_bounds, grid.col_bounds[1:]):
        table.add_column(_span(start, stop), justify="center")
    for i, (start, stop) in enumerate(zip(grid.row_bounds, grid.row_bounds[1:])):
        label = _span(start, stop) if len(shard_map.global_shape) == 2 else "dim0"
        table.add_row(label, *(_holder_text(ranks) for ranks in grid.holders[i]))
    return Panel(Group(table, Text(_legend(shard_map), style="dim")), title=title, expand=False)


def save_png(path: str | Path, panels: Sequence[tuple[str, ShardMap]]) -> Path:
    """Write one picture with a panel per (title, map), side by side; returns the path."""
    from matplotlib import colormaps  # lazy: matplotlib is slow to import
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    figure = Figure(figsize=(4.6 * len(panels), 4.0), dpi=100, layout="constrained")
    colours = colormaps[_PNG_COLOURMAP]
    for axes, (title, shard_map) in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels):
        grid = owner_grid(shard_map)
        label_blocks = (len(grid.row_bounds) - 1) * (len(grid.col_bounds) - 1) <= _MAX_LABELLED_BLOCKS
        for i, (top, bottom) in enumerate(zip(grid.row_bounds, grid.row_bounds[1:])):
            for j, (left, right) in enumerate(zip(grid.col_bounds, grid.col_bounds[1:])):
                ranks = grid.holders[i][j]
                face = colours(ranks[0] % colours.N) if ranks else "white"
                axes.add_patch(Rectangle((left, top), right - left, bottom - top, facecolor=face, edgecolor="black"))
                if label_blocks:
                    axes.text((left + right) / 2, (top + bottom) / 2, _holder_label(ranks), ha="center", va="center")
        axes.set_xlim(0, grid.col_bounds[-1])
        axes.set_ylim(grid.row_bounds[-1], 0)  # row 0 on top, as a matrix is written
        if label_blocks:  # block edges as ticks, unless there are too many to read
            axes.set_xticks(grid.col_bounds)
            axes.set_yticks(grid.row_bounds)
        axes.set_xlabel(("dim 1" if len(shard_map.global_shape) == 2 else "dim 0") + f"\n{_legend(shard_map)}")
        axes.set_ylabel("dim 0" if len(shard_map.global_shape) == 2 else "")
        axes.set_title(title, fontsize=9)
    path = Path(path)
    figure.savefig(path)
    return path


def _run_bounds(held_per_coordinate: list[np.ndarray], size: int) -> list[int]:
    """0, `size`, and every start and end of a run of consecutive held indices."""
    bounds = {0, size}
    for held in held_per_coordinate:
        if len(held) == 0:
            continue
        breaks = np.flatnonzero(np.diff(held) != 1) + 1
        bounds.update(held[np.r_[0, breaks]].tolist())
        bounds.update((held[np.r_[breaks - 1, len(held) - 1]] + 1).tolist())
    return sorted(bounds)


def _merge_equal_neighbours(bounds: list[int], rows: list[list]) -> tuple[list[int], list[list]]:
    kept_bounds, kept_rows = [bounds[0]], []
    for stop, row in zip(bounds[1:], rows):
        if kept_rows and kept_rows[-1] == row:
            kept_bounds[-1] = stop
        else:
            kept_rows.append(row)
            kept_bounds.append(stop)
    return kept_bounds, kept_rows


def _legend(shard_map: ShardMap) -> str:
    """What the cells mean, plus what the blocks cannot show: ranks holding nothing, Partial axes."""
    notes = [f"cells: ranks{_rank_formula(shard_map)}"]
    idle = [shard_map.mesh.rank_of(c) for c in shard_map.indices if 0 in shard_map.local_shape(c)]
    if idle:
        notes.append(f"empty: {_holder_label(tuple(sorted(idle)))}")
    if shard_map.partial_axes:
        notes.append(f"summands along {','.join(shard_map.partial_axes)}")
    return "; ".join(notes)


def _rank_formula(shard_map: ShardMap) -> str:
    """` (rank = 2*dp + tp)` for a mesh in rank order; empty otherwise."""
    mesh = shard_map.mesh
    if mesh.ranks != tuple(range(mesh.size)) or mesh.size == 1:
        return ""
    strides = [int(np.prod(mesh.shape[i + 1 :])) for i in range(mesh.ndim)]
    terms = [
        name if stride == 1 else f"{stride}*{name}"
        for name, stride, size in zip(mesh.axis_names, strides, mesh.shape)
        if size > 1
    ]
    return f" (rank = {' + '.join(terms)})"


def _span(start: int, stop: int) -> str:
    return str(start) if stop == start + 1 else f"{start}:{stop}"


def _holder_label(ranks: tuple[int, ...]) -> str:
    return ",".join(str(r) for r in ranks) if ranks else "-"


def _holder_text(ranks: tuple[int, ...]) -> Text:
    style = _TERMINAL_COLOURS[ranks[0] % len(_TERMINAL_COLOURS)] if ranks else "dim"
    return Text(_holder_label(ranks), style=style)
