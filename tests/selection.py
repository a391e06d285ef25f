"""Which cases of a parametrized test CI runs: the others are marked `grid` and run with `pytest -m grid`."""

from __future__ import annotations

from collections.abc import Iterable

import pytest


def in_ci(values: Iterable, ci: Iterable) -> list:
    """pytest params over `values` (a list, or a dict's keys; a tuple is one case of several arguments): those in
    `ci` run in CI, the rest in the grid."""
    values, ci = list(values), set(ci)
    unknown = ci - set(values)
    assert not unknown, f"CI cases {sorted(unknown)} are not among the values"
    return [
        value if value in ci else pytest.param(*value if isinstance(value, tuple) else (value,), marks=pytest.mark.grid)
        for value in values
    ]
