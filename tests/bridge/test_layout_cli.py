"""`shardbridge layout` and the pictures: rendered at width 100 into a string, compared with stored text."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from rich.console import Console

from bridge import cli, layout
from bridge.layout import MeshSpec, ShardMap, draw
from bridge.layout.text import parse_placements
from tests.bridge.layout_cases import load_golden

SEED_ARGS = ["layout", "--mesh", "dp=4,tp=2", "--shape", "8,16"]

ROW_PARALLEL_GRID = """\
╭─── torch: Shard(0), Shard(1) ───╮
│ ┌─────────────┬─────┬──────┐    │
│ │ dim0 \\ dim1 │ 0:8 │ 8:16 │    │
│ ├─────────────┼─────┼──────┤    │
│ │         0:2 │  0  │  1   │    │
│ ├─────────────┼─────┼──────┤    │
│ │         2:4 │  2  │  3   │    │
│ ├─────────────┼─────┼──────┤    │
│ │         4:6 │  4  │  5   │    │
│ ├─────────────┼─────┼──────┤    │
│ │         6:8 │  6  │  7   │    │
│ └─────────────┴─────┴──────┘    │
│ cells: ranks (rank = 2*dp + tp) │
╰─────────────────────────────────╯
"""


def render(renderable) -> str:
    buffer = io.StringIO()
    Console(file=buffer, width=100, color_system=None).print(renderable)
    return buffer.getvalue()


@pytest.fixture
def stdout(monkeypatch) -> io.StringIO:
    """What the CLI prints to its console, at width 100 without colour."""
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "Console", lambda: Console(file=buffer, width=100, color_system=None))
    return buffer


def test_text_grid_of_the_row_parallel_weight():
    row = layout.from_placements(MeshSpec((4, 2), ("dp", "tp")), parse_placements("Shard(0), Shard(1)"), (8, 16))
    assert render(draw.text_grid(row, "torch: Shard(0), Shard(1)")) == ROW_PARALLEL_GRID


def test_owner_grid_merges_blocks_and_marks_empty_and_partial_ranks():
    uneven = ShardMap.from_json(load_golden("dp4_tp2_column_uneven")["shard_map"])
    grid = draw.owner_grid(uneven)
    assert (grid.row_bounds, grid.col_bounds) == ((0, 1, 2, 3, 4, 5, 6), (0, 16))
    assert [row[0] for row in grid.holders] == [(0,), (2,), (4,), (1,), (3,), (5,)]
    assert "empty: 6,7" in render(draw.text_grid(uneven, "uneven"))
    partial = layout.from_placements(MeshSpec((2, 2), ("dp", "tp")), parse_placements("Partial(), Shard(0)"), (4,))
    assert draw.owner_grid(partial).holders == (((0, 2), (1, 3)),)
    assert "summands along dp" in render(draw.text_grid(partial, "partial"))


def test_layout_from_placements_prints_both_maps_the_spec_and_the_verdict(stdout):
    assert cli.main([*SEED_ARGS, "--placements", "_StridedShard(0,sf=2),Shard(0)"]) == 0
    text = stdout.getvalue()
    assert "JAX PartitionSpec P(('tp', 'dp'), None)" in text
    assert "verdict same layout" in text
    assert "│    1 │ dp=0,tp=1  │ 4 x 0:16 │ 4 x 0:16 │" in text  # rank 1 holds row 4 in both
    assert text.count("cells: ranks") == 2  # one grid per framework


def test_layout_from_a_transposed_pspec_gives_the_torch_placements(stdout):
    args = ["layout", "--mesh", "dp=4,tp=2", "--shape", "16,8", "--pspec", "(None,('tp','dp'))", "--transpose"]
    assert cli.main(args) == 0
    assert "torch placements _StridedShard(0, sf=2), Shard(0)" in stdout.getvalue()


def test_layout_json_holds_the_golden_shards(stdout):
    assert cli.main([*SEED_ARGS, "--pspec", "(('tp','dp'),None)", "--json"]) == 0
    report = json.loads(stdout.getvalue())
    golden = load_golden("dp4_tp2_column")
    assert report["torch"]["placements"] == golden["placements"]
    assert report["torch"]["shard_map"]["shards"] == golden["shard_map"]["shards"]
    assert report["jax"]["shard_map"]["shards"] == golden["shard_map"]["shards"]
    assert report["verdict"]["equal"] is True


def test_layout_without_a_jax_equivalent_says_why_and_exits_1(stdout):
    args = ["layout", "--mesh", "dp=4,tp=2", "--shape", "6,16", "--placements", "_StridedShard(0,sf=2),Shard(0)"]
    assert cli.main(args) == 1
    text = " ".join(stdout.getvalue().split())
    assert "JAX PartitionSpec (none)" in text
    assert "JAX rejects dims that do not divide evenly (pad dim 0 to 8)" in text


def test_layout_finds_the_jax_equivalent_torch_chunk_makes(stdout):
    """Finding 9: torch.chunk(4 rows, 3) gives 2, 2, 0 rows, which P(('tp','dp'), None) reproduces exactly."""
    args = ["layout", "--mesh", "dp=2,tp=2", "--shape", "4,6", "--placements", "_StridedShard(0,sf=3),Shard(0)"]
    assert cli.main(args) == 0
    text = " ".join(stdout.getvalue().split())
    assert "JAX PartitionSpec P(('tp', 'dp'), None)" in text and "same layout" in text


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mesh", "dp=4,tp=2", "--shape", "8,16", "--pspec", "('dp',None)", "--png", "/nonexistent/l.png"],
         "--png /nonexistent/l.png: directory /nonexistent does not exist"),  # fmt: skip
        (["--mesh", "dp=4,tq=2", "--shape", "8,16", "--pspec", "(('tp','dp'),None)"], "'tp' is not in the mesh"),
        (["--mesh", "dp=4,tp=2", "--shape", "8", "--placements", "Shard(1),Shard(0)"], "has 1 dims"),
        (["--mesh", "dp=4,tp=2", "--shape", "8,16", "--placements", "Shard(0),Sharp(1)"], "not a placement"),
        (["--mesh", "dp=4,tp=2", "--shape", "8,16", "--pspec", "(('tp','dp')"], "write it like"),
        (["--mesh", "dp=4,tp=2", "--shape", "6,16", "--pspec", "('dp',None)"], "JAX rejects"),
        (["--mesh", "dp=four", "--shape", "8,16", "--placements", "Shard(0)"], "dp = 'four' is not a size"),
        (["--mesh", "dp=4", "--shape", "8", "--placements", "Shard(0)", "--transpose"], "2-D weight"),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(stdout, capsys, args, message):
    assert cli.main(["layout", *args]) == 2
    errors = " ".join(capsys.readouterr().err.split())
    assert errors.startswith("error:") and message in errors and "Traceback" not in errors
    assert stdout.getvalue() == ""


def test_layout_png_has_one_panel_per_framework(stdout, tmp_path):
    from matplotlib.image import imread

    path = tmp_path / "layout.png"
    assert cli.main([*SEED_ARGS, "--placements", "_StridedShard(0,sf=2),Shard(0)", "--png", str(path)]) == 0
    image = imread(path)
    assert path.stat().st_size < 200_000
    assert image.shape[1] > 1.8 * image.shape[0]  # two square-ish panels side by side
    assert np.unique(image.reshape(-1, image.shape[-1]), axis=0).shape[0] >= 8  # a colour per rank at least
