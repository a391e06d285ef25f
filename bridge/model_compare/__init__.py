"""`bridge.compare`: check your own torch model against your own Flax NNX twin, submodule by submodule.

    report = bridge.compare(torch_model, jax_model, inputs, recipe="current")
    print(report.table())
    assert report.passed, report.first_divergence

See bridge/model_compare/core.py for the steps and docs/verification.md for the bounds.
"""

from bridge.model_compare.core import compare
from bridge.model_compare.report import CompareReport

__all__ = ["CompareReport", "compare"]
