"""FP8/FP4 training recipes for the JAX twin: the same frozen configs as torchside/recipe.py.

Framework-free mirror (jaxside never imports torchside): the same class names, fields, defaults,
role helpers and errors, so that a recipe means the same quantization on both sides
(tests/bridge/test_quantize_cross.py checks that the two stay alike). A recipe holds no state;
roles are "input" (activations), "weight" and "grad" (output gradients).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Union

ROLES = ("input", "weight", "grad")


class Format(enum.Enum):
    """FP8 element format of a recipe. HYBRID: E4M3 forward (inputs, weights), E5M2 grads."""

    E4M3 = "e4m3"
    E5M2 = "e5m2"
    HYBRID = "hybrid"

    def for_role(self, role: str) -> str:
        """The element format ("e4m3" or "e5m2") a tensor of `role` is cast to."""
        check_role(role)
        if self is Format.HYBRID:
            return "e5m2" if role == "grad" else "e4m3"
        return self.value


def check_role(role: str) -> None:
    """Raise ValueError unless `role` is one of ROLES."""
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not a tensor role: use one of {', '.join(map(repr, ROLES))}")


# ----------------------------------------------------------------------------- field checks


def _check_format(owner: str, value: object) -> None:
    if not isinstance(value, Format):
        raise TypeError(f"{owner}(fp8_format={value!r}): pass a Format member, e.g. fp8_format=Format.E4M3")


def _check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{owner}({name}={value!r}): use one of {', '.join(map(repr, choices))}")


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}({name}={value!r}): pass True or False")


def _check_int(owner: str, name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}({name}={value!r}): pass an integer >= {minimum}")


def _check_bools(recipe: object, names: tuple[str, ...]) -> None:
    for name in names:
        _check_bool(type(recipe).__name__, name, getattr(recipe, name))


# ----------------------------------------------------------------------------- recipes


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor FP8 with the scale taken from a history of past amaxes.

    `scale = (fmax / amax) / 2**margin`, amax = max of the last `amax_history_len` amaxes
    ("max") or the latest one ("most_recent"); with `reduce_amax` the amaxes of an
    autocast region are all-reduced (MAX) over its amax group before the update.
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_int("DelayedScaling", "margin", self.margin, 0)
        _check_int("DelayedScaling", "amax_history_len", self.amax_history_len, 1)
        _check_choice("DelayedScaling", "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        _check_bools(self, ("reduce_amax",))
        _check_format("DelayedScaling", self.fp8_format)


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor FP8 with the scale from the tensor's own amax, computed when it is cast."""

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_format("Float8CurrentScaling", self.fp8_format)
        _check_bools(self, ("power_2_scale",))
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"Float8CurrentScaling(amax_epsilon={eps!r}): pass a finite float >= 0")


# (a, b): the operands of one GEMM (forward, dgrad, wgrad); no GEMM may pair two 128x128 operands.
_BLOCK_GEMM_PAIRS = (("x", "w"), ("grad", "w"), ("grad", "x"))


@dataclass(frozen=True)
class Float8BlockScaling:
    """FP8 with one fp32 scale per block: 1x128 (block dim 1) or 128x128 (block dim 2).

    Defaults follow DeepSeek-V3 and TransformerEngine: 1x128 for inputs and grads,
    128x128 for weights, power-of-2 scales.
    """

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        _check_format("Float8BlockScaling", self.fp8_format)
        _check_bools(self, ("power_2_scale",))
        dims = self._dims()
        for name, dim in dims.items():
            if isinstance(dim, bool) or dim not in (1, 2):
                raise ValueError(f"Float8BlockScaling({name}_block_scaling_dim={dim!r}): use 1 (1x128) or 2 (128x128)")
        for a, b in _BLOCK_GEMM_PAIRS:
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(
                    f"Float8BlockScaling({a}_block_scaling_dim=2, {b}_block_scaling_dim=2): a GEMM of two "
                    f"128x128-scaled operands is not supported; set one of them to 1"
                )

    def _dims(self) -> dict[str, int]:
        return {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}

    def block_for(self, role: str) -> tuple[int, int]:
        """The (rows, cols) block of one scale for a tensor of `role`."""
        check_role(role)
        dim = self._dims()[{"input": "x", "weight": "w", "grad": "grad"}[role]]
        return (128, 128) if dim == 2 else (1, 128)


@dataclass(frozen=True)
class MXFP8BlockScaling:
    """OCP MX FP8: 32-element blocks with E8M0 (power-of-2) scales.

    scale_rounding "up" matches TransformerEngine and JAX; "floor" is the OCP MX spec's rule.
    """

    fp8_format: Format = Format.E4M3
    scale_rounding: str = "up"

    def __post_init__(self) -> None:
        _check_format("MXFP8BlockScaling", self.fp8_format)
        _check_choice("MXFP8BlockScaling", "scale_rounding", self.scale_rounding, ("up", "floor"))


@dataclass(frozen=True)
class NVFP4BlockScaling:
    """NVFP4: E2M1 values, an E4M3 scale per 16 elements and an fp32 global scale.

    Weights use 16x16 blocks (1x16 with `disable_2d_quantization`); inputs and grads 1x16.
    The wgrad operands (columnwise usage of inputs and grads) get the random Hadamard
    transform unless `disable_rht`; grads are rounded stochastically unless
    `disable_stochastic_rounding`, from random bits seeded by `stochastic_rounding_seed`.
    """

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    stochastic_rounding_seed: int = 0

    def __post_init__(self) -> None:
        _check_bools(self, ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"))
        _check_int("NVFP4BlockScaling", "stochastic_rounding_seed", self.stochastic_rounding_seed, 0)

    def block_for(self, role: str) -> tuple[int, int]:
        """The (rows, cols) block of one E4M3 scale for a tensor of `role`."""
        check_role(role)
        return (16, 16) if role == "weight" and not self.disable_2d_quantization else (1, 16)

    def hadamard_for(self, role: str) -> bool:
        """Whether the columnwise (wgrad) operand of `role` gets the random Hadamard transform."""
        check_role(role)
        return role in ("input", "grad") and not self.disable_rht

    def stochastic_for(self, role: str) -> bool:
        """Whether a tensor of `role` is rounded stochastically."""
        check_role(role)
        return role == "grad" and not self.disable_stochastic_rounding


Recipe = Union[DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling]
RECIPE_CLASSES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


# ---- the recipe names of the command lines and options (the one name -> recipe table of this framework)

FP8_OFF = "off"  # the name for no recipe: FP8 off, the GEMMs run in the parameters' dtype
_RECIPE_BY_NAME = {
    "current": Float8CurrentScaling,
    "delayed": DelayedScaling,
    "block": Float8BlockScaling,
    "mxfp8": MXFP8BlockScaling,
    "nvfp4": NVFP4BlockScaling,
}


def recipe_names(*, fp8_off: bool = True) -> tuple[str, ...]:
    """Every recipe name, "off" (FP8 off) first unless `fp8_off=False`."""
    return ((FP8_OFF,) if fp8_off else ()) + tuple(_RECIPE_BY_NAME)


def recipe_from_name(name: str, **options: object) -> Recipe | None:
    """The recipe `name` stands for, its fields from `options` (defaults otherwise); None for "off"."""
    if name == FP8_OFF:
        if options:
            raise ValueError(f"recipe 'off' (FP8 off) takes no options: drop {', '.join(sorted(options))}")
        return None
    if name not in _RECIPE_BY_NAME:
        raise ValueError(f"recipe {name!r}: use one of {', '.join(recipe_names())}")
    return _RECIPE_BY_NAME[name](**options)
