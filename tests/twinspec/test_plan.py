"""twinspec.plan: parsing, resolution and every kind of bad plan (the mesh's spellings: test_mesh.py).

The units and parameters below are a Llama block's, written out by hand: (torch name, global torch
shape, placement-table role, declared parallel mode).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from twinspec.mesh import MeshShape
from twinspec.plan import DEFAULT_PLAN, Param, Plan, choose_mesh

UNITS = {"embedding": "embedding", "layers.0.self_attention": "attention", "layers.0.layernorm_mlp": "mlp"}
PARAMS = {
    "embedding.weight": Param((256, 64), "linear_weight", "column"),
    "layers.0.self_attention.layernorm_qkv.layer_norm_weight": Param((64,), "norm", "column"),
    "layers.0.self_attention.layernorm_qkv.weight": Param((128, 64), "linear_weight", "column"),
    "layers.0.self_attention.proj.weight": Param((64, 64), "linear_weight", "row"),
    "layers.0.layernorm_mlp.layer_norm_weight": Param((64,), "norm", None),
    "layers.0.layernorm_mlp.fc1_weight": Param((256, 64), "linear_weight", "column"),
    "layers.0.layernorm_mlp.fc2_weight": Param((64, 128), "linear_weight", "row"),
    "norm.weight": Param((64,), "norm", None),
}
SIZES = MeshShape(dp_shard=2, tp=2)
EXAMPLES = Path(__file__).parents[2] / "examples" / "plans"


def plan(*rules: dict, mesh: dict | None = None) -> Plan:
    return Plan.from_dict({"rule": list(rules), **({} if mesh is None else {"mesh": mesh})})


def placements(resolved) -> dict[str, tuple]:
    return {name: (p.tp_dim, p.fsdp_dim) for name, p in resolved.params.items()}


def test_the_default_plan_is_the_placement_table_with_fsdp_on_dim_0():
    resolved = DEFAULT_PLAN.resolve(UNITS, PARAMS, SIZES)
    assert placements(resolved) == {  # docs/design.md's table: column splits dim 0, row dim 1, norms replicate
        "embedding.weight": (0, 0),
        "layers.0.self_attention.layernorm_qkv.layer_norm_weight": (None, 0),
        "layers.0.self_attention.layernorm_qkv.weight": (0, 0),
        "layers.0.self_attention.proj.weight": (1, 0),
        "layers.0.layernorm_mlp.layer_norm_weight": (None, 0),
        "layers.0.layernorm_mlp.fc1_weight": (0, 0),
        "layers.0.layernorm_mlp.fc2_weight": (1, 0),
        "norm.weight": (None, 0),
    }
    assert resolved.tp_modes == {
        "embedding": "vocab",
        "layers.0.self_attention": "split",
        "layers.0.layernorm_mlp": "split",
    }
    assert resolved.sequence_parallel is None and resolved.reshard_after_forward("layers.0", True) is True


def test_rules_match_a_name_or_its_parents_and_the_first_match_wins():
    rules = plan(
        {"match": "layers.0.layernorm_mlp.fc2_weight", "fsdp_dim": 0},
        {"match": "layers.*", "fsdp_dim": 1, "reshard_after_forward": False},
        {"match": "embedding", "tp": "hidden"},
    )
    resolved = rules.resolve(UNITS, {k: v for k, v in PARAMS.items() if "norm_weight" not in k and k != "norm.weight"})
    assert placements(resolved)["layers.0.layernorm_mlp.fc2_weight"] == (1, 0)  # the first rule
    assert placements(resolved)["layers.0.layernorm_mlp.fc1_weight"] == (0, 1)  # `layers.*` matches its parents
    assert placements(resolved)["embedding.weight"] == (1, 0)  # hidden columns over tp
    assert resolved.reshard_after_forward("layers.0", True) is False
    assert resolved.params["layers.0.layernorm_mlp.fc1_weight"].rule == "rule 1 (match 'layers.*')"


def test_a_replicated_unit_built_unsplit_keeps_everything_off_tp():
    unsplit = {k: dataclasses.replace(v, mode=None) if ".self_attention." in k else v for k, v in PARAMS.items()}
    resolved = plan({"match": "layers.*.self_attention", "tp": "replicate"}).resolve(UNITS, unsplit, SIZES)
    assert placements(resolved)["layers.0.self_attention.layernorm_qkv.weight"] == (None, 0)
    assert placements(resolved)["layers.0.self_attention.proj.weight"] == (None, 0)
    assert placements(resolved)["layers.0.layernorm_mlp.fc2_weight"] == (1, 0)


def test_a_toml_file_reads_as_its_dict_with_dp_for_dp_shard():
    from_file = Plan.from_toml(EXAMPLES / "fsdp_dim1_down_proj.toml")
    assert from_file == plan(
        {"match": "layers.*.layernorm_mlp.fc2_weight", "fsdp_dim": 1},
        {"match": "layers.*.self_attention.proj.weight", "fsdp_dim": 1},
        mesh={"dp_shard": 2, "tp": 2},
    )
    assert from_file.mesh == MeshShape(dp_shard=2, tp=2)


BAD_PLANS = {  # (plan dict, units/params changes, the message)
    "dim does not divide": (
        {"mesh": {"dp_shard": 2, "tp": 2}, "rule": [{"match": "layers.*.proj.weight", "fsdp_dim": 1}]},
        {"layers.0.self_attention.proj.weight": Param((64, 6), "linear_weight", "row")},
        (
            "rule 0 (match 'layers.*.proj.weight') shards dim 1 of layers.0.self_attention.proj.weight [64, 6] over 4 "
            "ranks, which does not divide 6"
        ),
    ),
    "fsdp dim the parameter lacks": (
        {"rule": [{"match": "layers.0.layernorm_mlp", "fsdp_dim": 1}]},
        None,
        (
            "rule 0 (match 'layers.0.layernorm_mlp') gives layers.0.layernorm_mlp.layer_norm_weight fsdp_dim=1, but it "
            "has 1 dim(s)"
        ),
    ),
    "mode the unit does not support": (
        {"rule": [{"match": "embedding", "tp": "split"}]},
        None,
        (
            "rule 0 (match 'embedding') gives embedding tp='split', which embedding units do not support: use one of "
            "'vocab', 'hidden'"
        ),
    ),
    "no such mode": ({"rule": [{"match": "layers.*", "tp": "column"}]}, None, "tp = 'column' is no TP mode"),
    "same pattern, two values": (
        {"rule": [{"match": "layers.*", "fsdp_dim": 1}, {"match": "layers.*", "fsdp_dim": 0}]},
        None,
        "rule 0 (match 'layers.*') and rule 1 (match 'layers.*') contradict: fsdp_dim = 1 and 0",
    ),
    "sequence parallel for some units only": (
        {
            "rule": [
                {"match": "embedding", "sequence_parallel": True},
                {"match": "layers.*", "sequence_parallel": False},
            ]
        },
        None,
        (
            "rule 0 (match 'embedding') and rule 1 (match 'layers.*') contradict: sequence_parallel is True for "
            "embedding but False for layers.0.self_attention"
        ),
    ),
    "replicated under sequence parallelism": (
        {"rule": [{"match": "layers.*.self_attention", "tp": "replicate"}, {"match": "*", "sequence_parallel": True}]},
        "unsplit attention",
        (
            "rule 1 (match '*') and rule 0 (match 'layers.*.self_attention') contradict: layers.0.self_attention is "
            "replicated over tp"
        ),
    ),
    "replicated but built split": (
        {"rule": [{"match": "layers.*.self_attention", "tp": "replicate"}]},
        None,
        (
            "rule 0 (match 'layers.*.self_attention') replicates layers.0.self_attention, but "
            "layers.0.self_attention.layernorm_qkv.weight was built column-parallel: build the model with the plan"
        ),
    ),
    "a rule matching nothing": (
        {"rule": [{"match": "layer.*.fc2_weight", "fsdp_dim": 1}]},
        None,
        "rule 0 (match 'layer.*.fc2_weight') matches no parameter or module it could set",
    ),
    "a tp rule on a module without a mode": (
        {"rule": [{"match": "layers.*.self_attention.proj", "tp": "replicate"}]},
        None,
        "rule 0 (match 'layers.*.self_attention.proj') matches no parameter or module it could set",
    ),
    "unknown rule key": ({"rule": [{"match": "x", "fsdp": 1}]}, None, "rule 0 (match 'x') has unknown keys ['fsdp']"),
    "a rule without a pattern": ({"rule": [{"fsdp_dim": 1}]}, None, "rule 0 needs match = '<pattern>'"),
    "the plan's mesh is not the model's": ({"mesh": {"dp_shard": 4}}, None, "the plan's [mesh] is"),
}


@pytest.mark.parametrize("case", sorted(BAD_PLANS))
def test_a_bad_plan_is_refused_naming_the_rule(case):
    data, change, message = BAD_PLANS[case]
    params = dict(PARAMS)
    if change == "unsplit attention":
        params = {k: dataclasses.replace(v, mode=None) if ".self_attention." in k else v for k, v in params.items()}
    elif change:
        params |= change
    with pytest.raises(ValueError, match=re.escape(message)):
        Plan.from_dict(data).resolve(UNITS, params, SIZES)


def test_a_bad_plan_file_names_the_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[mesh]\npp = 2\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: [mesh] names an unknown axis 'pp'")):
        Plan.from_toml(path)
    path.write_text("[mesh\n")
    with pytest.raises(ValueError, match=re.escape(f"{path}: not valid TOML")):
        Plan.from_toml(path)


@pytest.mark.parametrize(
    "mesh_text, plan_mesh, expected",
    [
        ("rep=2,dp=2", {"tp": 2}, MeshShape(dp_replicate=2, dp_shard=2)),  # --mesh wins
        (None, {"rep": 2, "tp": 2}, MeshShape(dp_replicate=2, tp=2)),  # else the plan's [mesh]
        (None, None, MeshShape(dp_shard=2, tp=2)),  # else FSDP x TP, 2 x 2
    ],
)
def test_a_command_runs_on_its_mesh_else_the_plans_else_dp2_tp2(mesh_text, plan_mesh, expected):
    assert choose_mesh(mesh_text, None if plan_mesh is None else plan(mesh=plan_mesh)) == expected


def test_an_empty_mesh_text_is_refused_not_taken_for_no_mesh():
    with pytest.raises(ValueError, match="names no axis"):
        choose_mesh("", DEFAULT_PLAN)
