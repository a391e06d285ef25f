"""`verify --model linear|mlp|transformer` without tensor parallelism: the built-in stacks through bridge.compare.

Each case's torchside stack and its jaxside twin (bridge.twins, TP size 1) hold the seeded values of
verify's stacks (bridge.crosscheck.seeded_values, copied into JAX by compare) and run on the seeded
[S, B, H] batch of step 0. On one process the stacks compare here; on a data-parallel mesh each of
its processes builds both whole and compares its columns of the batch (dim 1,
bridge.model_compare.data_parallel). Every block and submodule is teacher-forced against its derived
bound, end to end under FP8 noise-aware, and `steps` Adam steps follow (bridge.model_compare.core).

DelayedScaling and NVFP4 compare at step 0 only: their scaling state advances in torch's step but
bridge.compare does not carry it into the twin (core.STATEFUL_RECIPES); their reports say steps 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bridge import crosscheck, twins
from bridge.model_compare.core import STATEFUL_RECIPES, compare_here
from bridge.model_compare.data_parallel import DataParallel, rank_of

BATCH_DIM = 1  # the stacks' activations are [S, B, H]


def stack_pair(case: crosscheck.VerifyCase, device: torch.device | str) -> tuple[torch.nn.Module, object]:
    """The case's torch stack on `device` with the seeded values, and its JAX twin (compare copies them in)."""
    from torchside.parallel import materialize

    spec = case.spec
    torch_model = twins.build_torch(spec)
    materialize(torch_model, device)  # FP8 state included (DelayedScaling's history and scales)
    with torch.no_grad():
        for name, values in crosscheck.seeded_values(torch_model).items():
            torch_model.get_parameter(name).copy_(values)
    return torch_model, twins.build_jax(spec)


def steps_of(case: crosscheck.VerifyCase, recipe: str) -> int:
    """The Adam steps compared under `recipe` (module docstring)."""
    return 0 if recipe in STATEFUL_RECIPES else case.steps


def compare_stacks(
    cases: Sequence[crosscheck.VerifyCase], device: torch.device | str, dp: DataParallel | None = None
) -> list[dict]:
    """Every case and recipe through bridge.compare (module docstring); the JSON reports, the same on every rank.

    dp: this process's rank of a data-parallel mesh (its columns of the batch); None: one process.
    """
    reports = []
    for case in cases:
        x, _ = crosscheck.seeded_batch(0, case.hidden)
        x = (x if dp is None else dp.rows(x)).to(device)
        for recipe in case.recipes:  # fresh models for each: fresh FP8 scaling state
            torch_model, jax_model = stack_pair(case, device)
            fp8_recipe = crosscheck.case_recipe(recipe) or "off"  # delayed: verify's history length
            report = compare_here(torch_model, jax_model, x, recipe=fp8_recipe, steps=steps_of(case, recipe), dp=dp)
            report.model, report.mesh = case.model, str(case.mesh)
            reports.append(report.to_json())
    return reports


def compare_stacks_ranks(runtime, cases: Sequence[crosscheck.VerifyCase]) -> list[dict]:
    """`compare_stacks` as one rank of the co-located data-parallel processes (bridge.runtime.launch's worker)."""
    return compare_stacks(cases, runtime.torch_device, rank_of(runtime, BATCH_DIM))


__all__ = ["compare_stacks", "compare_stacks_ranks", "stack_pair", "steps_of"]
