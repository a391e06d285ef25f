"""examples/plans/*.txt are what `shardbridge plan show` prints for their plans today (regenerate.py rewrites them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PLANS = Path(__file__).resolve().parents[2] / "examples" / "plans"


def _regenerate_module():
    spec = importlib.util.spec_from_file_location("examples_plans_regenerate", PLANS / "regenerate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("plan", sorted(PLANS.glob("*.toml")), ids=lambda path: path.stem)
def test_the_committed_transcript_is_a_fresh_plan_show(plan, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    committed = plan.with_suffix(".txt")
    assert committed.exists(), f"{committed.name} is missing: run python examples/plans/regenerate.py"
    fresh = _regenerate_module().transcript(plan)
    assert committed.read_text() == fresh, f"{committed.name} is stale: run python examples/plans/regenerate.py"
