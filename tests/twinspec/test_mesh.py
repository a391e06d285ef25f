"""twinspec.mesh: one set of spellings for `--mesh` text and a placement plan's `[mesh]` table.

Every case is written twice, once as each entry point takes it (text and TOML), and both must give
the same mesh or the same error. The expected meshes are spelled out with MeshShape's own fields.
"""

from __future__ import annotations

import re

import pytest

from twinspec.mesh import MeshShape, mesh_from_table, parse_mesh, split_axis_sizes
from twinspec.plan import Plan

SPELLINGS = {  # --mesh text, the same [mesh] in TOML, the mesh both mean
    "FSDP x TP, short names": ("dp=2,tp=2", "dp = 2\ntp = 2", MeshShape(dp_shard=2, tp=2)),
    "HSDP, short names": ("rep=2,dp=2", "rep = 2\ndp = 2", MeshShape(dp_replicate=2, dp_shard=2)),
    "HSDP x TP, full names": (
        "dp_replicate=2,dp_shard=2,tp=2",
        "dp_replicate = 2\ndp_shard = 2\ntp = 2",
        MeshShape(dp_replicate=2, dp_shard=2, tp=2),
    ),
    "any order, spaces, one axis": (" tp = 4 ,", "tp = 4", MeshShape(tp=4)),
}


def _from_toml(tmp_path, mesh_table: str) -> MeshShape:
    path = tmp_path / "plan.toml"
    path.write_text(f"[mesh]\n{mesh_table}\n")
    return Plan.from_toml(path).mesh


@pytest.mark.parametrize("case", sorted(SPELLINGS))
def test_text_and_plan_table_read_the_same_spellings(tmp_path, case):
    text, table, expected = SPELLINGS[case]
    assert parse_mesh(text) == expected
    assert _from_toml(tmp_path, table) == expected


BAD = {  # --mesh text, the same [mesh] in TOML (None: TOML cannot say it), the error both give
    "unknown axis": ("pp=2", "pp = 2", "names an unknown axis 'pp': the axes are dp_replicate (or rep), dp_shard"),
    "not an integer": ("dp=two", 'dp = "two"', "dp = 'two' is not a size; pass an integer >= 1"),
    "a fraction": ("tp=1.5", "tp = 1.5", "is not a size; pass an integer >= 1"),
    "a boolean": ("tp=true", "tp = true", "is not a size; pass an integer >= 1"),
    "zero": ("dp=0", "dp = 0", "dp = 0 is not a size; pass an integer >= 1"),
    "negative": ("tp=-2", "tp = -2", "is not a size; pass an integer >= 1"),
    "alias and its axis": ("dp=2,dp_shard=2", "dp = 2\ndp_shard = 2", "gives dp_shard twice, as 'dp' and 'dp_shard'"),
    "rep and dp_replicate": (
        "dp_replicate=2,rep=2", "dp_replicate = 2\nrep = 2", "gives dp_replicate twice, as 'dp_replicate' and 'rep'"
    ),
    "one name twice": ("dp=2,dp=2", None, "gives dp twice; give each axis once"),
    "no '='": ("dp2,tp=2", None, "'dp2' is not name=size; write axes as name=size"),
    "no axis": (",", None, "names no axis; write axes as name=size"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_text_and_plan_table_refuse_the_same_mistakes(tmp_path, case):
    text, table, message = BAD[case]
    with pytest.raises(ValueError, match=re.escape(message)) as from_text:
        parse_mesh(text)
    assert str(from_text.value).startswith(f"mesh {text!r}")
    if table is not None:
        with pytest.raises(ValueError, match=re.escape(message)) as from_table:
            _from_toml(tmp_path, table)
        assert str(from_table.value).startswith(f"{tmp_path / 'plan.toml'}: [mesh]")


def test_toml_refuses_one_key_twice_itself(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        _from_toml(tmp_path, "dp = 2\ndp = 2")


def test_a_mesh_table_must_be_a_table():
    with pytest.raises(TypeError, match=r"\[mesh\] must be a table"):
        mesh_from_table([("dp", 2)])


def test_the_layout_spelling_keeps_any_names_in_their_order():
    """bridge.layout's meshes name their axes freely; the spelling rules are the same."""
    assert split_axis_sizes("tp=2,x=4") == [("tp", 2), ("x", 4)]
    with pytest.raises(ValueError, match="gives x twice"):
        split_axis_sizes("x=2,x=2")


@pytest.mark.parametrize(
    "shape, data_parallel, world, text",
    [
        (MeshShape(), 1, 1, "single"),
        (MeshShape(dp_shard=4), 4, 4, "dp_shard=4"),
        (MeshShape(dp_replicate=2, dp_shard=3, tp=2), 6, 12, "dp_replicate=2,dp_shard=3,tp=2"),
    ],
)
def test_mesh_shape_sizes_and_text(shape, data_parallel, world, text):
    assert (shape.data_parallel_size, shape.world_size, str(shape)) == (data_parallel, world, text)
    if text != "single":
        assert parse_mesh(text) == shape


def test_mesh_shape_refuses_a_size_below_one():
    with pytest.raises(ValueError, match=re.escape("MeshShape(tp=0): tp = 0 is not a size")):
        MeshShape(tp=0)
