"""`Plan`: a placement strategy as data, read by both frameworks (framework-free: no torch, no jax).

A plan names the mesh axes' sizes and lists rules; each rule matches module or parameter names
(torch's fully qualified names, `fnmatch` patterns) and sets some of:

    tp                     a module's tensor-parallel mode: an embedding (or untied head) splits
                           its "vocab" rows (default) or its "hidden" columns; an attention block
                           or MLP is "split" (default: QKV and fc1 column-parallel, proj and fc2
                           row-parallel) or "replicate" (every TP rank computes all of it, which
                           takes the whole sequence: no sequence parallelism with it)
    sequence_parallel      split the activations between TP modules over the sequence (one value
                           for the whole model; no rule: as the model was built)
    fsdp_dim               the dim of a parameter FSDP shards over dp_shard (0, the default, or 1)
    reshard_after_forward  whether an FSDP block frees its gathered parameters after forward

A rule matches a name when its pattern matches the name or one of its parents (`layers.*` covers
every parameter of every layer); for each name and setting the first rule that matches and sets
it wins, and a name no rule sets keeps the default: `DEFAULT_PLAN` (no rules) is the built-in
behaviour. `Plan.resolve` checks a plan against a model's units and parameters before anything is
placed, and raises ValueError naming the rule (index and pattern) for an axis that does not
exist, a dim that does not divide, a mode the module does not support, a rule that matches
nothing, or two rules that contradict.

What a TP mode does to a parameter is the placement table (twinspec.placement). Mesh axes and
their spellings are twinspec.mesh's: `[mesh]` sizes read as `--mesh` text does (`dp` for dp_shard,
`rep` for dp_replicate). `choose_mesh` is the one rule for the mesh a command runs on: its `--mesh`,
else the plan's `[mesh]`, else DEFAULT_MESH.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from twinspec.mesh import DEFAULT_MESH, DP_SHARD, TP, MeshShape, mesh_from_table, parse_mesh
from twinspec.placement import DECLARED, UNIT_MODES, tp_shard_dim

RULE_FIELDS = ("match", "tp", "sequence_parallel", "fsdp_dim", "reshard_after_forward")
FSDP_DIMS = (0, 1)


@dataclass(frozen=True)
class Rule:
    """One `[[rule]]`: a pattern and the settings it gives the names it matches (None: not set)."""

    index: int
    match: str
    tp: str | None = None
    sequence_parallel: bool | None = None
    fsdp_dim: int | None = None
    reshard_after_forward: bool | None = None

    @property
    def label(self) -> str:
        return f"rule {self.index} (match {self.match!r})"

    def matches(self, name: str) -> bool:
        """The pattern matches `name` or one of its parents."""
        parts = name.split(".")
        return any(fnmatch.fnmatchcase(".".join(parts[:n]), self.match) for n in range(len(parts), 0, -1))


@dataclass(frozen=True)
class Param:
    """A parameter as a model declares it: global torch shape, role and parallel mode (TP_SHARD_DIM's keys)."""

    shape: tuple[int, ...]
    role: str
    mode: str | None


@dataclass(frozen=True)
class PlannedParam:
    """Where the plan puts a parameter: the torch dims split over tp and over dp_shard (None: neither)."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None
    fsdp_dim: int
    rule: str | None  # the label of the rule that chose fsdp_dim, None for the default


@dataclass(frozen=True)
class Resolution:
    """A plan applied to one model: each unit's TP mode, sequence parallelism, each parameter's placement."""

    tp_modes: Mapping[str, str]
    sequence_parallel: bool | None  # None: no rule sets it
    params: Mapping[str, PlannedParam]
    plan: Plan

    def reshard_after_forward(self, block: str, default: bool) -> bool:
        """The setting of FSDP block `block` (a module name)."""
        value, _ = self.plan.setting(block, "reshard_after_forward", default)
        return value


@dataclass(frozen=True)
class Plan:
    """The mesh's sizes (None: any mesh) and ordered rules (module docstring)."""

    mesh: MeshShape | None = None
    rules: tuple[Rule, ...] = field(default_factory=tuple)

    @classmethod
    def from_toml(cls, path: str | Path) -> Plan:
        """A plan file: `[mesh]` axis sizes and `[[rule]]` tables; ValueError naming the file for bad TOML."""
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path}: not valid TOML: {error}") from None
        try:
            return cls.from_dict(data)
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None

    @classmethod
    def from_dict(cls, data: Mapping) -> Plan:
        """The same as a TOML file's tables: {"mesh": {...}, "rule": [{...}, ...]}."""
        if not isinstance(data, Mapping):
            raise TypeError(f"Plan.from_dict({data!r}): pass a dict with 'mesh' and 'rule' keys")
        unknown = sorted(set(data) - {"mesh", "rule"})
        if unknown:
            raise ValueError(f"unknown plan keys {unknown}: a plan has a [mesh] table and [[rule]] tables")
        mesh = None if "mesh" not in data else mesh_from_table(data["mesh"])
        rules = data.get("rule", [])
        if not isinstance(rules, list):
            raise TypeError("'rule' must be a list of tables ([[rule]] in TOML)")
        return cls(mesh, tuple(_parse_rule(index, rule) for index, rule in enumerate(rules)))

    def __post_init__(self) -> None:
        _check_same_pattern_contradictions(self.rules)

    def setting(self, name: str, setting: str, default):
        """(value, the rule's label or None) of `setting` for `name`: the first rule matching it that sets it."""
        for rule in self.rules:
            value = getattr(rule, setting)
            if value is not None and rule.matches(name):
                return value, rule.label
        return default, None

    def check_mesh(self, mesh: MeshShape) -> None:
        """ValueError when the plan names mesh sizes that differ from the mesh a model is placed on."""
        if self.mesh is not None and self.mesh != mesh:
            raise ValueError(
                f"the plan's [mesh] is {self.mesh.axis_sizes} but the model is placed on a mesh of {mesh.axis_sizes}: "
                "use one mesh"
            )

    def resolve(
        self, units: Mapping[str, str], params: Mapping[str, Param], mesh: MeshShape | None = None
    ) -> Resolution:
        """Apply the plan to a model's units (name -> kind) and parameters on `mesh`, checking it (module docstring)."""
        if mesh is not None:
            self.check_mesh(mesh)
        tp_modes = {name: self.tp_mode(name, kind) for name, kind in units.items()}
        sequence_parallel = self._sequence_parallel(units)
        self._check_replicated_without_sequence_parallel(tp_modes, sequence_parallel)
        # Checked in name order, so that both frameworks (their own parameter orders) name the same first misfit.
        placed = {name: self._place(name, params[name], units, tp_modes, mesh) for name in sorted(params)}
        planned = {name: placed[name] for name in params}
        self._check_every_rule_matches(units, params)
        return Resolution(tp_modes, sequence_parallel, planned, self)

    def tp_mode(self, name: str, kind: str) -> str:
        """The TP mode of unit `name` of `kind` (a key of UNIT_MODES); ValueError naming a rule giving it another."""
        modes = UNIT_MODES[kind]
        mode, rule = self.setting(name, "tp", next(iter(modes)))
        if mode not in modes:
            choices = ", ".join(map(repr, modes))
            raise ValueError(
                f"{rule} gives {name} tp={mode!r}, which {kind} units do not support: use one of {choices}"
            )
        return mode

    def _sequence_parallel(self, units: Mapping[str, str]) -> bool | None:
        chosen = {}
        for name in units:
            value, rule = self.setting(name, "sequence_parallel", None)
            if value is not None:
                chosen.setdefault(value, (rule, name))
        if len(chosen) > 1:
            (on_rule, on_name), (off_rule, off_name) = chosen[True], chosen[False]
            raise ValueError(
                f"{on_rule} and {off_rule} contradict: sequence_parallel is True for {on_name} but False for "
                f"{off_name}; sequence parallelism splits the whole model's activations or none: give it one value"
            )
        return next(iter(chosen), None)

    def _check_replicated_without_sequence_parallel(self, tp_modes, sequence_parallel) -> None:
        replicated = [name for name, mode in tp_modes.items() if mode == "replicate"]
        if sequence_parallel and replicated:
            _, sp_rule = self.setting(replicated[0], "sequence_parallel", None)
            sp_rule = sp_rule or next(r.label for r in self.rules if r.sequence_parallel)
            _, tp_rule = self.setting(replicated[0], "tp", None)
            raise ValueError(
                f"{sp_rule} and {tp_rule} contradict: {replicated[0]} is replicated over tp, so it computes on the "
                "whole sequence, but sequence parallelism splits it: set sequence_parallel = false, or split it"
            )

    def _axis_size(self, axis: str, mesh: MeshShape | None = None) -> int:
        """The size of `axis`: on `mesh` when given, else on the plan's mesh, else 1."""
        return (mesh or self.mesh or MeshShape()).axis_sizes[axis]

    def _place(self, name, param: Param, units, tp_modes, mesh) -> PlannedParam:
        unit = _owning_unit(name, units)
        mode = param.mode
        if unit is not None:
            planned = UNIT_MODES[units[unit]][tp_modes[unit]]
            if planned is None and tp_shard_dim(param.role, param.mode) is not None:
                _, rule = self.setting(unit, "tp", None)
                raise ValueError(
                    f"{rule} replicates {unit}, but {name} was built {param.mode}-parallel: build the model with the "
                    "plan (torchside.models.Llama(config, plan=...), or TransformerConfig(attention_tp=..., mlp_tp=...))"
                )
            mode = mode if planned == DECLARED else planned
        tp_dim = tp_shard_dim(param.role, mode)
        fsdp_dim, rule = self.setting(name, "fsdp_dim", 0)
        shape = tuple(param.shape)
        if fsdp_dim >= len(shape):
            raise ValueError(
                f"{rule} gives {name} fsdp_dim={fsdp_dim}, but it has {len(shape)} dim(s) {list(shape)}: "
                f"match only parameters with a dim {fsdp_dim} (e.g. '*_weight')"
            )
        if rule is not None:  # the default keeps torch's uneven FSDP shards; a rule's choice must divide
            parts = self._axis_size(DP_SHARD, mesh) * (self._axis_size(TP, mesh) if tp_dim == fsdp_dim else 1)
            if shape[fsdp_dim] % parts:
                raise ValueError(
                    f"{rule} shards dim {fsdp_dim} of {name} {list(shape)} over {parts} ranks, which does not "
                    f"divide {shape[fsdp_dim]}: use fsdp_dim={1 - fsdp_dim} for it, or a mesh that divides it"
                )
        return PlannedParam(name, shape, tp_dim, fsdp_dim, rule)

    def _check_every_rule_matches(self, units: Mapping[str, str], params: Mapping[str, Param]) -> None:
        for rule in self.rules:
            targets = units if rule.tp is not None or rule.sequence_parallel is not None else {}
            names = [*targets, *(params if rule.fsdp_dim is not None else ())]
            if rule.reshard_after_forward is not None:
                names += list(params)
            if not any(rule.matches(name) for name in names):
                kinds = ", ".join(sorted(units)) or "none"
                raise ValueError(
                    f"{rule.label} matches no parameter or module it could set: check the pattern (names are "
                    f"torch's, e.g. 'layers.*.layernorm_mlp.fc2_weight'; units with a tp mode: {kinds})"
                )


def spec_entries(planned: PlannedParam) -> tuple[tuple[str, ...], ...]:
    """Per torch dim, the mesh axes splitting it, most significant first (tp before dp_shard, as FSDP2 nests)."""
    return tuple(
        tuple(axis for axis, dim in ((TP, planned.tp_dim), (DP_SHARD, planned.fsdp_dim)) if dim == d)
        for d in range(len(planned.shape))
    )


def torch_name(jax_name: str, ndim: int) -> str:
    """The torch parameter name of a JAX path (dotted): bridge.params' rule backwards (a 2-D kernel is a weight)."""
    return re.sub(r"kernel(\d*)$", r"weight\1", jax_name) if ndim == 2 else jax_name


def _owning_unit(name: str, units: Mapping[str, str]) -> str | None:
    parts = name.split(".")
    for n in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in units:
            return prefix
    return None


_RULE_TYPES = {"tp": str, "sequence_parallel": bool, "reshard_after_forward": bool}


def _parse_rule(index: int, data: object) -> Rule:
    if not isinstance(data, Mapping) or not isinstance(data.get("match"), str) or not data["match"]:
        raise ValueError(f"rule {index} needs match = '<pattern>' (a module or parameter name; * matches any part)")
    label = f"rule {index} (match {data['match']!r})"
    unknown = sorted(set(data) - set(RULE_FIELDS))
    if unknown:
        raise ValueError(f"{label} has unknown keys {unknown}: a rule sets {RULE_FIELDS[1:]}")
    if len(data) == 1:
        raise ValueError(f"{label} sets nothing: give it one of {RULE_FIELDS[1:]}")
    for key, kind in _RULE_TYPES.items():
        if key in data and not isinstance(data[key], kind):
            raise ValueError(f"{label}: {key} = {data[key]!r} must be a {kind.__name__}")
    if "tp" in data and not any(data["tp"] in modes for modes in UNIT_MODES.values()):
        choices = {kind: list(modes) for kind, modes in UNIT_MODES.items()}
        raise ValueError(f"{label}: tp = {data['tp']!r} is no TP mode; by kind: {choices}")
    if "fsdp_dim" in data and (isinstance(data["fsdp_dim"], bool) or data["fsdp_dim"] not in FSDP_DIMS):
        raise ValueError(f"{label}: fsdp_dim = {data['fsdp_dim']!r} must be one of {FSDP_DIMS}")
    return Rule(index, **data)


def _check_same_pattern_contradictions(rules: tuple[Rule, ...]) -> None:
    """Two rules with one pattern setting one thing differently: the second could never apply."""
    first: dict[tuple[str, str], Rule] = {}
    for rule in rules:
        for setting in RULE_FIELDS[1:]:
            value = getattr(rule, setting)
            if value is None:
                continue
            earlier = first.setdefault((rule.match, setting), rule)
            if earlier is not rule and getattr(earlier, setting) != value:
                raise ValueError(
                    f"{earlier.label} and {rule.label} contradict: {setting} = {getattr(earlier, setting)!r} and "
                    f"{value!r} for the same names (the first match wins, so the second never applies): keep one"
                )


DEFAULT_PLAN = Plan()


def choose_mesh(mesh_text: str | None, plan: Plan | None = None) -> MeshShape:
    """The mesh a command runs on: its --mesh text, else the plan's [mesh], else DEFAULT_MESH (FSDP x TP, 2 x 2)."""
    if mesh_text is not None:
        return parse_mesh(mesh_text)
    if plan is not None and plan.mesh is not None:
        return plan.mesh
    return DEFAULT_MESH


__all__ = [
    "DEFAULT_PLAN",
    "Param",
    "Plan",
    "PlannedParam",
    "Resolution",
    "Rule",
    "choose_mesh",
    "spec_entries",
    "torch_name",
]
