"""The plan of a checkpoint conversion: which source tensor becomes which target tensor, and who writes which box.

Keys are flat, dotted, and start with a section (torchside's `AppState` keys, flattened the way
DCP flattens nested dicts; an Orbax tree is the same keys nested at the dots):

    torch (DCP, safetensors)               JAX (Orbax)                        layout
    model.<fqn>                            model.<rule(fqn)>                  the parameter rule's
    model.<fqn>.<fp8 buffer>               model.<rule(fqn)>.<fp8 buffer>     same (bytes kept as saved)
    optim.<fqn>.<state>                    optim.<state>.<rule(fqn)>          the parameter's (0-d `step`: same)
    fp8_scaling.<module>.<buffer>          the same                           same
    train.<name>                           the same                           same
    rng.*                                  (not converted: per-rank torch generator states)

`rule` is an architecture's rule table (`bridge.params.RULES` for the shardbridge twins: a 2-D
`weight` [out, in] is a Flax `kernel` [in, out]). FP8 buffers (`rowwise_data`, `rowwise_scale_inv`,
...; torchside.checkpoint.quantized_params) keep torch's byte layout on both sides: transposing
block-scaled bytes would change which elements share a scale, so they are never transposed or upcast.

A box is (offsets, sizes) in a tensor's coordinates. Each target tensor is split on dim 0 into one
even block per owner (a process, or a JAX device); a tensor whose dim 0 does not split evenly is
written whole by one owner (round robin). A transposed tensor's source box is the target box reversed.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge import params

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)

SECTIONS = ("model", "optim", "fp8_scaling", "train", "rng")
SKIPPED_SECTIONS = ("rng",)
FRAMEWORKS = {"dcp": "torch", "safetensors": "torch", "orbax": "jax", "hf": "torch"}  # hf: bridge.convert.hf
MODEL_ONLY = ("hf",)  # formats that hold the model's weights only: other sections are left out
FP8_BUFFERS = (
    "rowwise_data",
    "rowwise_scale_inv",
    "columnwise_data",
    "columnwise_scale_inv",
    "tensor_amax",
    "columnwise_amax",
)  # torchside.quantization.storage.BUFFERS (tests check they agree)
OPTIMIZER_STATES = ("step", *params.OPTIMIZER_STATES)

# The inverse of params.RULES: a 2-D `kernel` goes back to `weight`. `Plan` checks that the forward
# rules send every inverted name back where it came from, so the two tables cannot drift apart.
INVERSE_RULES: tuple[params.Rule, ...] = (
    params.Rule(r"(?P<path>(?:.*\.)?[a-z0-9_]*?)kernel(?P<group>\d*)", 2, r"\g<path>weight\g<group>", params.TRANSPOSE),
    params.Rule(r".*", None, r"\g<0>", params.SAME),
)
ARCHITECTURES: dict[str, tuple[tuple[params.Rule, ...], tuple[params.Rule, ...]]] = {
    "shardbridge": (params.RULES, INVERSE_RULES),  # torchside modules and their jaxside twins
}


@dataclass(frozen=True)
class TensorInfo:
    """One stored tensor: flat key, global shape, dtype name (torch's spelling: `bfloat16`, `float8_e4m3fn`)."""

    key: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype name."""
    import torch

    return getattr(torch, dtype).itemsize


@dataclass(frozen=True)
class PlanEntry:
    """One tensor's conversion: source, target, whether dims swap, and each owner's target boxes."""

    source: TensorInfo
    target: TensorInfo
    transpose: bool
    boxes: tuple[tuple[Box, ...], ...]  # boxes[owner] (target coordinates)

    def source_box(self, box: Box) -> Box:
        """The source box holding the elements of target box `box`."""
        offsets, sizes = box
        return (offsets[::-1], sizes[::-1]) if self.transpose else box


@dataclass(frozen=True)
class Plan:
    """Every tensor's entry, in source key order, plus what is left out and why."""

    entries: tuple[PlanEntry, ...]
    owners: int
    skipped: tuple[tuple[str, str], ...]  # (source key, reason)

    def bytes_per_owner(self) -> list[int]:
        totals = [0] * self.owners
        for entry in self.entries:
            for owner, boxes in enumerate(entry.boxes):
                totals[owner] += sum(math.prod(sizes) for _, sizes in boxes) * itemsize(entry.target.dtype)
        return totals


@dataclass(frozen=True)
class WriteJob:
    """What a target writer gets (the same for every format): where, what, and how to get each box."""

    path: Path  # the staging path to fill (renamed to the target once complete and verified)
    plan: Plan
    owner: int  # this process's owner index (its rank); an Orbax target's owners are its devices
    devices: tuple | None  # the JAX devices an Orbax target is placed on (None for the other formats)
    produce: Callable[[str, Box], Any]  # (target key, box) -> the box's values (a CPU torch tensor)
    tensor_crcs: Callable[[], dict[str, int]]  # every target tensor's CRC32 once all boxes are produced (collective)
    barrier: Callable[[], None]
    options: Mapping[str, Any] = field(default_factory=dict)  # the target format's own (an HF target: config, max_shard_size)
    facts: Mapping[str, Any] = field(default_factory=dict)  # what the checkpoint says it holds (bridge.convert.facts)

    def boxes(self) -> list[tuple[TensorInfo, Box]]:
        """This process's (tensor, box) pairs, in plan order."""
        return [(e.target, box) for e in self.plan.entries for box in e.boxes[self.owner]]

    def tensors(self) -> list[TensorInfo]:
        return [e.target for e in self.plan.entries]


def split_rows(shape: tuple[int, ...], owners: int) -> list[Box] | None:
    """One even dim-0 block per owner, or None when dim 0 does not split evenly (0-d included)."""
    if not shape or shape[0] % owners or shape[0] < owners:
        return None
    rows = shape[0] // owners
    return [((i * rows, *[0] * (len(shape) - 1)), (rows, *shape[1:])) for i in range(owners)]


def _boxes(shape: tuple[int, ...], owners: int, index: int) -> tuple[tuple[Box, ...], ...]:
    blocks = split_rows(shape, owners)
    if blocks is not None:
        return tuple((block,) for block in blocks)
    whole: Box = ((0,) * len(shape), tuple(shape))
    return tuple((whole,) if owner == index % owners else () for owner in range(owners))


def _apply(rules: Iterable[params.Rule], name: str, ndim: int) -> tuple[str, params.Layout]:
    for rule in rules:
        mapped = rule.jax_name_for(name, ndim)
        if mapped is not None:
            return mapped, rule.layout
    raise ValueError(f"no rule maps {name!r} ({ndim}-D); add one to the architecture's rule table")


class _KeyMapper:
    """Maps one framework's flat keys to the other's (see the module docstring), or keeps them."""

    def __init__(self, index: Mapping[str, TensorInfo], direction: str, architecture: str) -> None:
        if architecture not in ARCHITECTURES:
            raise ValueError(f"unknown architecture {architecture!r}: use one of {', '.join(ARCHITECTURES)}")
        self.index, self.direction = index, direction
        self.forward, self.inverse = ARCHITECTURES[architecture]

    def name(self, name: str, ndim: int) -> tuple[str, params.Layout]:
        """A parameter name mapped one way, checked against the other way."""
        if self.direction == "torch->jax":
            return _apply(self.forward, name, ndim)
        torch_name, layout = _apply(self.inverse, name, ndim)
        if _apply(self.forward, torch_name, ndim)[0] != name:
            raise ValueError(f"JAX name {name!r} maps to torch {torch_name!r}, which the rules do not send back")
        return torch_name, layout

    def param_ndim(self, param: str) -> int | None:
        """The parameter's ndim as the source stores it (2 for an FP8 parameter saved as buffers)."""
        if f"model.{param}" in self.index:
            return len(self.index[f"model.{param}"].shape)
        return 2 if f"model.{param}.rowwise_data" in self.index or f"model.{param}.columnwise_data" in self.index else None

    def map(self, info: TensorInfo) -> tuple[str, bool] | None:
        """(target key, transpose) of a source tensor, or None for same-framework conversions' identity."""
        section, _, rest = info.key.partition(".")
        if self.direction == "same" or section in ("fp8_scaling", "train"):
            return info.key, False
        if section == "model":
            head, _, last = rest.rpartition(".")
            if last in FP8_BUFFERS and head:
                return f"model.{self.name(head, 2)[0]}.{last}", False
            mapped, layout = self.name(rest, len(info.shape))
            return f"model.{mapped}", layout.transposes
        return self._optimizer_key(info, rest)

    def _optimizer_key(self, info: TensorInfo, rest: str) -> tuple[str, bool]:
        if self.direction == "torch->jax":
            param, _, state = rest.rpartition(".")
        else:
            state, _, param = rest.partition(".")
        if state not in OPTIMIZER_STATES or not param:
            raise ValueError(f"{info.key}: not an optimizer state (optim.<param>.<state>, state in {OPTIMIZER_STATES})")
        ndim = self.param_ndim(param)
        if ndim is None:
            raise ValueError(f"{info.key}: optimizer state of a parameter the checkpoint lacks (model.{param})")
        param_info = self.index.get(f"model.{param}")
        if len(info.shape) == ndim and param_info is not None and info.shape != param_info.shape:
            raise ValueError(f"shape mismatch: {info.key} is {list(info.shape)}, its parameter {list(param_info.shape)}")
        mapped, layout = self.name(param, ndim)
        transpose = layout.transposes and len(info.shape) == ndim
        return (f"optim.{mapped}.{state}" if self.direction == "jax->torch" else f"optim.{state}.{mapped}"), transpose


def direction(source_format: str, target_format: str) -> str:
    for fmt in (source_format, target_format):
        if fmt not in FRAMEWORKS:
            raise ValueError(f"unknown checkpoint format {fmt!r}: use one of {', '.join(FRAMEWORKS)}")
    source, target = FRAMEWORKS[source_format], FRAMEWORKS[target_format]
    return "same" if source == target else f"{source}->{target}"


def make_plan(
    index: Mapping[str, TensorInfo],
    source_format: str,
    target_format: str,
    owners: int,
    *,
    with_optimizer: bool = False,
    architecture: str = "shardbridge",
) -> Plan:
    """The conversion plan of a source checkpoint's tensors; ValueError naming every problem found."""
    if owners < 1:
        raise ValueError(f"owners={owners}: pass the number of target processes or devices (>= 1)")
    mapper = _KeyMapper(index, direction(source_format, target_format), architecture)
    entries, skipped, problems = [], [], []
    for key in sorted(index):
        info = index[key]
        section = key.partition(".")[0]
        if section not in SECTIONS:
            problems.append(
                f"{key!r} is in no known section ({', '.join(SECTIONS)}): not a torchside AppState / jaxside tree"
            )
            continue
        if section in SKIPPED_SECTIONS:
            skipped.append((key, "per-rank torch generator state"))
            continue
        if section != "model" and target_format in MODEL_ONLY:
            skipped.append((key, f"a {target_format} checkpoint holds the model's weights only"))
            continue
        if section == "optim" and not with_optimizer:
            skipped.append((key, "optimizer state (pass --with-optimizer)"))
            continue
        try:
            target_key, transpose = mapper.map(info)
        except ValueError as error:
            problems.append(str(error))
            continue
        shape = tuple(reversed(info.shape)) if transpose else info.shape
        target = TensorInfo(target_key, shape, info.dtype)
        entries.append(PlanEntry(info, target, transpose, _boxes(shape, owners, len(entries))))
    problems += _missing_partners(index)
    problems += _duplicate_targets(entries)
    if problems:
        raise ValueError("cannot convert: " + "; ".join(problems))
    return Plan(tuple(entries), owners, tuple(skipped))


def _missing_partners(index: Mapping[str, TensorInfo]) -> list[str]:
    """FP8 data without its scale_inv, or scales without their data."""
    problems = []
    for key, info in index.items():
        match = re.fullmatch(r"(model\..+)\.(rowwise|columnwise)_(data|scale_inv)", key)
        if match:
            partner = f"{match[1]}.{match[2]}_{'scale_inv' if match[3] == 'data' else 'data'}"
            if partner not in index:
                problems.append(f"{key} has no {partner}: FP8 bytes and their scales travel together")
    return problems


def _duplicate_targets(entries: Iterable[PlanEntry]) -> list[str]:
    seen: dict[str, str] = {}
    problems = []
    for entry in entries:
        first = seen.setdefault(entry.target.key, entry.source.key)
        if first != entry.source.key:
            problems.append(f"{first} and {entry.source.key} both map to {entry.target.key}")
    return problems


def check_against(plan: Plan, expected: Mapping[str, tuple[int, ...]]) -> None:
    """ValueError if the plan's targets miss a tensor of `expected` (key -> shape) or disagree on a shape."""
    targets = {e.target.key: e.target.shape for e in plan.entries}
    missing = sorted(set(expected) - set(targets))
    wrong = [f"{k} is {list(targets[k])}, expected {list(s)}" for k, s in expected.items() if k in targets and tuple(s) != targets[k]]
    if missing or wrong:
        parts = ([f"missing tensors: {', '.join(missing)}"] if missing else []) + (
            [f"shape mismatch: {'; '.join(wrong)}"] if wrong else []
        )
        raise ValueError("the checkpoint does not fit the target model: " + "; ".join(parts))


__all__ = [
    "ARCHITECTURES",
    "FP8_BUFFERS",
    "FRAMEWORKS",
    "SECTIONS",
    "Box",
    "Plan",
    "PlanEntry",
    "TensorInfo",
    "WriteJob",
    "check_against",
    "direction",
    "itemsize",
    "make_plan",
    "split_rows",
]
