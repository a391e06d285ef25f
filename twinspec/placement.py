"""The placement table both frameworks place parameters by: parameter roles, parallel modes, TP units.

A parameter's row is (role, parallel mode). Its role is what it is (`PARAM_ROLES`, torch's names;
jaxside tags its variables with Flax's names, `FLAX_ROLES`), its mode is its module's parallel mode
(`PARALLEL_MODES`: None, "column" or "row"), and `TP_SHARD_DIM` says which torch dim of it the TP
group splits. torchside.parallel.placements turns that dim into a DTensor placement and
jaxside.sharding into a PartitionSpec; placement plans (twinspec.plan) choose each unit's mode.

A unit (an embedding, attention block or MLP) is a module whose TP mode a plan chooses:
`UNIT_MODES` lists each kind's modes (the first is the default) and the parallel mode each gives
its parameters (`DECLARED`: the one each was declared with).
"""

from __future__ import annotations

from collections.abc import Mapping

PARAM_ROLES = ("linear_weight", "linear_bias", "norm")
FLAX_ROLES: Mapping[str, str] = {"kernel": "linear_weight", "bias": "linear_bias", "norm": "norm"}  # jaxside's names
PARALLEL_MODES = (None, "column", "row")

# (role, parallel mode) -> the tensor dim split over the TP group, or None for replicated.
TP_SHARD_DIM: Mapping[tuple[str, str | None], int | None] = {
    ("linear_weight", "column"): 0,
    ("linear_weight", "row"): 1,
    ("linear_weight", None): None,
    ("linear_bias", "column"): 0,
    ("linear_bias", "row"): None,
    ("linear_bias", None): None,
    ("norm", "column"): None,
    ("norm", "row"): None,
    ("norm", None): None,
}

DECLARED = "declared"
UNIT_MODES: Mapping[str, Mapping[str, str | None]] = {
    "embedding": {"vocab": DECLARED, "hidden": "row"},  # weight [V, D]: declared "column" (rows split)
    "attention": {"split": DECLARED, "replicate": None},  # a replicated unit is built unsplit (mode None)
    "mlp": {"split": DECLARED, "replicate": None},
}


def tp_shard_dim(role: str, parallel_mode: str | None) -> int | None:
    """The dim the TP group splits for this (role, mode), None when the parameter is replicated."""
    key = (role, parallel_mode)
    if key not in TP_SHARD_DIM:
        raise ValueError(
            f"no placement for parameter role {role!r} in parallel mode {parallel_mode!r}: roles are {PARAM_ROLES}, "
            f"modes {PARALLEL_MODES}"
        )
    return TP_SHARD_DIM[key]


__all__ = ["DECLARED", "FLAX_ROLES", "PARALLEL_MODES", "PARAM_ROLES", "TP_SHARD_DIM", "UNIT_MODES", "tp_shard_dim"]
