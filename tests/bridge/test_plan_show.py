"""`shardbridge plan show` and `plan compare`: exit codes, the table, JSON, the picture.

Expected sizes are counted by hand for the one-block transformer twin (hidden 64, ffn 256, fp32):

    weights and biases split over dp and tp (/4): qkv 192x64 + 192, proj 64x64, fc1 256x64 + 256,
                                                  fc2 64x256                                  = 49600
    split over dp only (/2; norms, row biases):   2 x (64 + 64) norms + 64 + 64 biases        = 384
    on dp=2,tp=2 every rank holds 49600 / 4 + 384 / 2 = 12592 elements = 50368 bytes;
    on dp=4 every rank holds (49600 + 384) / 4 = 12496 elements = 49984 bytes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from bridge import cli

SMALL = ["--model", "transformer", "--layers", "1", "--hidden", "64", "--batch", "4", "--seq", "8"]


@pytest.fixture
def stdout(monkeypatch) -> io.StringIO:
    """What the CLI prints to its console, wide and without colour."""
    buffer = io.StringIO()
    monkeypatch.setattr(cli, "Console", lambda: Console(file=buffer, width=250, color_system=None))
    return buffer


def test_show_prints_every_parameter_memory_and_communication(stdout):
    assert cli.main(["plan", "show", *SMALL, "--mesh", "dp=2,tp=2"]) == 0
    text = stdout.getvalue()
    fc1 = next(line for line in text.splitlines() if "layernorm_mlp.fc1_weight" in line)
    # [256, 64] column-parallel: FSDP2's strided shard over dp on top of TP; JAX splits the kernel's out dim.
    for cell in ("256x64", "Replicate(), _StridedShard(0, sf=2), Shard(0)", "P(None, ('tp', 'dp_shard'))", "yes"):
        assert cell in fc1
    assert "16.00 KiB" in fc1  # 256 * 64 * 4 bytes / 4 ranks
    assert text.count("49.19 KiB") == 8  # 50368 bytes: parameters and gradients of each of the 4 ranks
    assert "verdict torch and JAX keep every parameter's elements on the same devices" in text


def test_json_totals(stdout):
    assert cli.main(["plan", "show", *SMALL, "--mesh", "dp=2,tp=2", "--json"]) == 0
    result = json.loads(stdout.getvalue())
    assert result["memory"]["parameters"] == [50368] * 4
    assert result["memory"]["gradients"] == [50368] * 4
    # Adam: two fp32 moments per element, a float32 step count per parameter (12), no master for fp32.
    assert result["memory"]["optimizer"] == [2 * 50368 + 12 * 4] * 4
    per_axis = result["communication"]["per_axis"]
    # No sequence parallelism: per GEMM one all-reduce of [tokens, features] over tp: the qkv and fc1
    # inputs' gradients (64 features) and the proj and fc2 outputs (64), 4 x 8 / 2 = 16 tokens per rank.
    assert per_axis["tp"] == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 4 * 16 * 64 * 4}
    # FSDP: the block's TP shard gathered in forward and again in backward, its gradient reduce-scattered.
    block_tp_shard = (49600 // 2 + 384) * 4
    assert per_axis["dp_shard"] == {"all_gather": 2 * block_tp_shard, "reduce_scatter": block_tp_shard, "all_reduce": 0}
    assert all(p["same_layout"] for p in result["parameters"])


def test_compare_two_meshes_shows_where_they_differ(stdout):
    assert cli.main(["plan", "compare", *SMALL, "--mesh", "dp=4", "--mesh", "dp=2,tp=2", "--json"]) == 0
    fsdp, fsdp_tp = json.loads(stdout.getvalue())
    assert fsdp["memory"]["parameters"] == [49984] * 4
    assert fsdp_tp["memory"]["parameters"] == [50368] * 4
    assert "tp" not in fsdp["communication"]["per_axis"]
    assert fsdp_tp["communication"]["per_axis"]["tp"]["all_reduce"] > 0


def test_compare_table_lists_the_parameters_placed_differently(stdout):
    assert cli.main(["plan", "compare", *SMALL, "--mesh", "dp=4", "--mesh", "dp=2,tp=2"]) == 0
    differing = stdout.getvalue().split("parameters placed differently")[1]
    assert "layers.0.layernorm_mlp.fc2_weight" in differing  # row-parallel under TP: Shard(1) over tp
    assert "Replicate(), Shard(0), Shard(1)" in differing
    assert "layer_norm_weight" not in differing  # Shard(0) over dp either way


def test_png(tmp_path, stdout):
    path = tmp_path / "plan.png"
    assert cli.main(["plan", "show", *SMALL, "--mesh", "dp=2,tp=2", "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mesh", "dp=two"], "mesh 'dp=two': dp = 'two' is not a size"),
        (["--model", "gpt"], "model 'gpt': use one of transformer, llama"),
        (["--mesh", "dp=3", "--batch", "4"], "--batch 4 must divide over the 3 data-parallel ranks"),
        (["--mesh", "tp=3"], "tp=3 must divide the heads and ffn"),
        (["missing.toml"], "missing.toml: no such file or directory; pass a TOML placement plan"),
    ],
)
def test_bad_input_exits_2_with_one_error_line(capsys, argv, message):
    assert cli.main(["plan", "show", *argv]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith("error:") and message in errors[0], errors


# ---- placement plans (twinspec.plan; examples/plans)

PLANS = Path(__file__).parents[2] / "examples" / "plans"


def test_show_a_plan_prices_what_it_places(stdout):
    plan = str(PLANS / "fsdp_dim1_down_proj.toml")  # [mesh] dp = 2, tp = 2
    assert cli.main(["plan", "show", plan, "--model", "llama", "--json"]) == 0
    result = json.loads(stdout.getvalue())
    assert result["mesh_axes"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 2}
    by_name = {p["name"]: p for p in result["parameters"]}
    fc2 = by_name["layers.0.layernorm_mlp.fc2_weight"]  # [D, F] row-parallel: FSDP splits its TP shard's dim 1
    assert fc2["placements"] == "Replicate(), _StridedShard(1, sf=2), Shard(1)"
    assert fc2["pspec"] == "P(('tp', 'dp_shard'), None)"  # the Flax kernel [F, D]
    assert all(p["same_layout"] for p in result["parameters"])


def test_compare_two_plans(stdout):
    plans = [str(PLANS / f"{name}.toml") for name in ("fsdp_dim1_down_proj", "attention_replicated_mlp_tp")]
    assert cli.main(["plan", "compare", *plans, "--model", "llama"]) == 0
    differing = stdout.getvalue().split("parameters placed differently")[1]
    assert "layers.0.self_attention.layernorm_qkv.weight" in differing  # replicated over tp by the second
    assert "layers.0.layernorm_mlp.fc1_weight" not in differing  # column-parallel, FSDP dim 0 in both


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda path: path.mkdir(), "is a directory; pass a TOML placement plan"),
        (lambda path: path.write_bytes(b"\x93NUMPY\x01\x00"), "not a text file (byte 0x93 at 0 is not UTF-8)"),
    ],
)
@pytest.mark.parametrize("argv", [["show"], ["compare", "--mesh", "dp=2", "--mesh", "dp=4"]])
def test_a_plan_that_is_not_a_toml_file_is_named(tmp_path, capsys, make, message, argv):
    """Issue 42: the error names the file and says a TOML placement plan is expected (was a bare codec error)."""
    plan = tmp_path / "x.npy"
    make(plan)
    assert cli.main(["plan", argv[0], str(plan), *argv[1:]]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"error: {plan}: {message}"), errors


def test_a_bad_plan_exits_2_naming_the_rule(tmp_path, capsys):
    plan = tmp_path / "bad.toml"
    plan.write_text('[[rule]]\nmatch = "layers.*.no_such_module"\nfsdp_dim = 1\n')
    assert cli.main(["plan", "show", str(plan), *SMALL]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 1 and "rule 0 (match 'layers.*.no_such_module') matches no parameter" in errors[0], errors


@pytest.mark.parametrize(
    "mesh_from",
    [
        lambda tmp_path: ["--mesh", "rep=2,dp=2"],
        lambda tmp_path: [_plan_file(tmp_path, "[mesh]\nrep = 2\ndp = 2\n")],
        lambda tmp_path: [_plan_file(tmp_path, "[mesh]\ndp_replicate = 2\ndp_shard = 2\n")],
    ],
    ids=["--mesh rep=2,dp=2", "[mesh] rep = 2, dp = 2", "[mesh] dp_replicate = 2, dp_shard = 2"],
)
def test_the_cli_and_a_plans_mesh_take_the_same_spellings(tmp_path, stdout, mesh_from):
    """Issue 43: `rep = 2` in a plan's [mesh] was refused while `--mesh rep=2,dp=2` worked."""
    assert cli.main(["plan", "show", *mesh_from(tmp_path), *SMALL, "--json"]) == 0
    result = json.loads(stdout.getvalue())
    assert result["mesh_axes"] == {"dp_replicate": 2, "dp_shard": 2, "tp": 1}  # HSDP: 2 replicas of 2 shards
    assert result["mesh"] == "dp_replicate=2,dp_shard=2"


def _plan_file(folder: Path, text: str) -> str:
    path = folder / "plan.toml"
    path.write_text(text)
    return str(path)
