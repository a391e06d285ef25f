"""FP8/FP4 training recipes: frozen configs with the parameters TransformerEngine users know.

One definition for both frameworks: torchside (which re-exports them as `torchside.recipe`, the path
TransformerEngine users know) and jaxside take these very objects, so a recipe means the same
quantization on both sides, and a recipe name becomes a recipe object in one place, `recipe_from_name`.

A recipe says how each tensor role is quantized; it holds no state. Roles:
"input" (activations), "weight", "grad" (output gradients). The formulas live in
docs/quantization.md and fp8kernels/reference.py; this file only validates and names them.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

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


def check_amax_history_len(owner: str, value: object) -> None:
    """A DelayedScaling amax history length (of a recipe or a module config): an integer >= 1."""
    _check_int(owner, "amax_history_len", value, 1)


@dataclass(frozen=True)
class DelayedScaling:
    """Per-tensor FP8 with the scale taken from a history of past amaxes.

    `scale = (fmax / amax) / 2**margin`, amax = max of the last `amax_history_len` amaxes
    ("max") or the latest one ("most_recent"); with `reduce_amax` the amaxes of an
    autocast region are all-reduced (MAX) over its amax group before the update. A module's
    history takes `amax_history_len` rows unless its ModuleConfig sets another length.
    """

    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    reduce_amax: bool = True
    fp8_format: Format = Format.HYBRID

    def __post_init__(self) -> None:
        _check_int("DelayedScaling", "margin", self.margin, 0)
        check_amax_history_len("DelayedScaling", self.amax_history_len)
        _check_choice("DelayedScaling", "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        _check_bool("DelayedScaling", "reduce_amax", self.reduce_amax)
        _check_format("DelayedScaling", self.fp8_format)


@dataclass(frozen=True)
class Float8CurrentScaling:
    """Per-tensor FP8 with the scale from the tensor's own amax, computed when it is cast."""

    fp8_format: Format = Format.HYBRID
    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        _check_format("Float8CurrentScaling", self.fp8_format)
        _check_bool("Float8CurrentScaling", "power_2_scale", self.power_2_scale)
        eps = self.amax_epsilon
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not math.isfinite(eps) or eps < 0:
            raise ValueError(f"Float8CurrentScaling(amax_epsilon={eps!r}): pass a finite float >= 0")


@dataclass(frozen=True)
class Float8BlockScaling:
    """FP8 with one fp32 scale per block: 1x128 (block dim 1) or 128x128 (block dim 2).

    Defaults follow DeepSeek-V3 and TransformerEngine: 1x128 for inputs and grads,
    128x128 for weights, power-of-2 scales. No GEMM may multiply two 128x128 operands.
    """

    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        _check_format("Float8BlockScaling", self.fp8_format)
        _check_bool("Float8BlockScaling", "power_2_scale", self.power_2_scale)
        dims = {"x": self.x_block_scaling_dim, "w": self.w_block_scaling_dim, "grad": self.grad_block_scaling_dim}
        for name, dim in dims.items():
            if dim not in (1, 2) or isinstance(dim, bool):
                raise ValueError(f"Float8BlockScaling({name}_block_scaling_dim={dim!r}): use 1 (1x128) or 2 (128x128)")
        # The three GEMMs pair (x, w), (grad, w) and (grad, x); none may be 2-D by 2-D.
        for a, b in (("x", "w"), ("grad", "w"), ("grad", "x")):
            if dims[a] == 2 and dims[b] == 2:
                raise ValueError(
                    f"Float8BlockScaling({a}_block_scaling_dim=2, {b}_block_scaling_dim=2): a GEMM of two "
                    f"128x128-scaled operands is not supported; set one of them to 1"
                )

    def block_for(self, role: str) -> tuple[int, int]:
        """The (rows, cols) block of one scale for a tensor of `role`."""
        check_role(role)
        dim = {
            "input": self.x_block_scaling_dim,
            "weight": self.w_block_scaling_dim,
            "grad": self.grad_block_scaling_dim,
        }
        return (128, 128) if dim[role] == 2 else (1, 128)


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
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization"):
            _check_bool("NVFP4BlockScaling", name, getattr(self, name))
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


Recipe = DelayedScaling | Float8CurrentScaling | Float8BlockScaling | MXFP8BlockScaling | NVFP4BlockScaling
RECIPE_CLASSES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling, NVFP4BlockScaling)


# ---- the recipe names of the command lines and options (the one name -> recipe table of both frameworks)

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


__all__ = [
    "FP8_OFF",
    "RECIPE_CLASSES",
    "ROLES",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "Recipe",
    "check_amax_history_len",
    "check_role",
    "recipe_from_name",
    "recipe_names",
]
