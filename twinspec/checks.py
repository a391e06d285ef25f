"""Argument checks of the quantizers that need no framework: the same errors, with the same fixes, everywhere.

`fp8kernels._checks` (the torch reference and the Triton launchers) and `jaxside._checks` add the
checks that look at a tensor or an array.
"""

from __future__ import annotations

from twinspec.formats import FORMATS, FloatFormat


def check_roles(rowwise: bool, columnwise: bool) -> None:
    """At least one of the two copies must be asked for."""
    if not (rowwise or columnwise):
        raise ValueError("rowwise=False and columnwise=False produce nothing; ask for at least one")


def check_divisible(operand_cols: int, multiple: int, scheme: str, role: str) -> None:
    """MXFP8 and NVFP4 blocks must tile each operand row exactly (a row of x, or a column of x)."""
    if operand_cols % multiple:
        dim = "last dim (K)" if role == "rowwise" else "row count (M, the product of the leading dims)"
        other = "columnwise" if role == "rowwise" else "rowwise"
        raise ValueError(
            f"{scheme} {role} needs the {dim} to be a multiple of {multiple}, got {operand_cols}; "
            f"pad the tensor or ask for {other} only"
        )


def element_format(fmt: str, allowed: tuple[str, ...]) -> FloatFormat:
    """The format a quantizer writes, checked against those it supports."""
    if fmt not in allowed:
        raise ValueError(f"fmt={fmt!r} is not supported here; use one of {allowed}")
    return FORMATS[fmt]


def check_block(block, allowed: tuple[tuple[int, int], ...], name: str) -> tuple[int, int]:
    """A block shape argument, checked against the ones a scheme defines."""
    block = tuple(block)
    if block not in allowed:
        raise ValueError(f"{name} block={block} is not supported; use one of {allowed}")
    return block


def check_scale_or_amax_given(scale_given: bool, amax_given: bool, power_2_scale: bool, amax_epsilon: float) -> None:
    """Tensorwise: a given delayed-scaling scale, or a given amax to scale from (current scaling), or neither."""
    if scale_given and amax_given:
        raise ValueError("pass scale (delayed scaling) or amax (current scaling from a given amax), not both")
    if scale_given and (power_2_scale or amax_epsilon):
        raise ValueError("power_2_scale and amax_epsilon shape a current scale; with a given scale leave them unset")


def check_global_amax_unrotated(rotated_columnwise: bool) -> None:
    """An NVFP4 global amax given for a shard stands for x: no copy may be Hadamard-rotated."""
    if rotated_columnwise:
        raise ValueError(
            "global_amax stands for x's amax, not for that of the Hadamard-rotated columnwise copy: "
            "pass hadamard=False, or columnwise=False, or leave global_amax None"
        )


__all__ = [
    "check_block",
    "check_divisible",
    "check_global_amax_unrotated",
    "check_roles",
    "check_scale_or_amax_given",
    "element_format",
]
