"""`shardbridge verify --torch PKG.MODULE:FACTORY --jax PKG.MODULE:FACTORY`: bridge.compare from the command line.

Each factory takes no arguments and returns (model, example inputs): a torch.nn.Module with a
tensor or tuple of tensors, and a flax.nnx.Module with inputs of the same shapes (torch's values
are the ones both sides get). The module is imported from the current directory too, as
`python -m` would.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from bridge.model_compare.core import compare
from bridge.model_compare.data_parallel import load_factory
from bridge.model_compare.report import CompareReport


def _model_and_inputs(option: str, spec: str) -> tuple[Any, tuple]:
    if os.getcwd() not in sys.path:  # as `python -m` would
        sys.path.insert(0, os.getcwd())
    result = load_factory(option, spec)()
    if not (isinstance(result, tuple) and len(result) == 2):
        got = type(result).__name__
        raise TypeError(f"{option} {spec}: the factory must return (model, example_inputs), got {got}")
    model, inputs = result
    inputs = inputs if isinstance(inputs, tuple) else (inputs,)
    return model, inputs


def _shapes(inputs: tuple) -> list[tuple[int, ...]]:
    return [tuple(getattr(x, "shape", ())) for x in inputs]


def compare_factories(
    torch_spec: str, jax_spec: str, recipes: tuple[str, ...], *, steps: int = 0
) -> list[CompareReport]:
    """One compare() per recipe of the models the two factories build (fresh models for each recipe)."""
    reports = []
    for recipe in recipes:
        torch_model, torch_inputs = _model_and_inputs("--torch", torch_spec)
        jax_model, jax_inputs = _model_and_inputs("--jax", jax_spec)
        if _shapes(torch_inputs) != _shapes(jax_inputs):
            raise ValueError(
                f"the factories' example inputs differ in shape: torch {_shapes(torch_inputs)}, JAX "
                f"{_shapes(jax_inputs)}; both sides get torch's values, so make the shapes match"
            )
        if not all(isinstance(x, torch.Tensor) for x in torch_inputs):
            raise TypeError(f"--torch {torch_spec}: the example inputs must be torch tensors")
        reports.append(compare(torch_model, jax_model, torch_inputs, recipe=recipe, steps=steps))
    return reports


__all__ = ["compare_factories"]
