"""The end-to-end checks of `bridge.compare`: the model's output, input gradient and weight gradients.

With FP8 off each is a distance against the whole model's chain bound (bridge.numerics). Under an
FP8 recipe both frameworks run again with FP8 off, and each tensor gets three checks: the FP8-off
pair against its chain bound (`[FP8 off]`), the two frameworks' distances to their own reference
(`[distance to reference]`; not for weight gradients, whose rows are no independent sample) and
torch-vs-JAX under the recipe against the noise-aware bound
(bridge.model_compare.noise).
"""

from __future__ import annotations

import torch

from bridge.model_compare import jax_calls
from bridge.model_compare.checks import bounded_check, distance_check
from bridge.model_compare.data_parallel import DataParallel, summed_jax_grads, summed_torch_grads
from bridge.model_compare.noise import noise_verdict
from bridge.model_compare.recorder import float_leaves, output_unit
from bridge.model_compare.torch_run import TorchRun, run_torch
from bridge.numerics import TensorCheck, chain_bound


def _tensors(run: TorchRun, jax_result, pairs, backward: bool) -> list[tuple[str, str, torch.Tensor, torch.Tensor]]:
    """(stage, name, JAX tensor, torch tensor) of every end-to-end comparison of one run."""
    root = run.root
    outputs, param_grads, arg_grads = jax_result
    torch_outputs = float_leaves(root.output)
    if len(outputs) != len(torch_outputs):
        counts = f"{len(torch_outputs)} floating-point outputs in torch, {len(outputs)} in JAX"
        raise ValueError(f"the model returns {counts}; make them match")
    several = len(torch_outputs) > 1
    found = [
        ("end_to_end_forward", f"output {i}" if several else "output", got, expected)
        for i, (got, expected) in enumerate(zip(outputs, torch_outputs))
    ]
    if not backward:
        return found
    for position, grad in arg_grads.items():
        if position in root.input_grads:
            name = f"input {position}" if len(root.grad_positions) > 1 else "input"
            found.append(("end_to_end_input_grad", name, grad, root.input_grads[position]))
    for pair in pairs:
        if pair.jax_path in param_grads:
            got = jax_calls.to_torch(pair.layout.to_torch(param_grads[pair.jax_path]))
            expected = run.grads.get(pair.torch_name, torch.zeros_like(got))
            found.append(("end_to_end_weight_grad", pair.torch_name, got, expected))
    return found


def _bound(stage: str, bounds: tuple[float, float], elements: int, dp: DataParallel | None) -> float:
    if stage == "end_to_end_forward":
        return bounds[0]
    summed = dp is not None and stage == "end_to_end_weight_grad"  # each side's sum over the ranks too
    return bounds[1] + (dp.sum_error(elements) if summed else 0.0)


def end_to_end_checks(
    torch_model, jax_model, inputs, run: TorchRun, jax_result, pairs, *, recipe, u_acc: float, backward: bool,
    dp: DataParallel | None = None,
) -> list[TensorCheck]:  # fmt: skip
    """The end-to-end checks (module docstring); `run` and `jax_result` are the runs under `recipe`, their weight
    gradients summed over the data-parallel ranks `dp` (bridge.model_compare.data_parallel)."""
    measured = _tensors(run, jax_result, pairs, backward)
    if recipe is None:
        unit = output_unit(run.root.output)
        bounds = chain_bound(run.root.reductions, mantissa_bits=None, u_acc=u_acc, output_unit=unit)
        return [
            distance_check(stage, name, [got], [want], _bound(stage, bounds, want.numel(), dp))
            for stage, name, got, want in measured
        ]
    reference = summed_torch_grads(run_torch(torch_model, inputs, None, set(), backward), dp)
    jax_reference = summed_jax_grads(jax_calls.run_recorded(reference.root, jax_model, None, backward), dp)
    references = _tensors(reference, jax_reference, pairs, backward)
    unit = output_unit(reference.root.output)
    bounds = chain_bound(reference.root.reductions, mantissa_bits=None, u_acc=u_acc, output_unit=unit)
    checks = []
    for (stage, name, jax_fp8, torch_fp8), (_, _, jax_ref, torch_ref) in zip(measured, references):
        bound = _bound(stage, bounds, torch_ref.numel(), dp)
        checks.append(distance_check(stage, f"{name} [FP8 off]", [jax_ref], [torch_ref], bound))
        row_tensors = (torch_fp8, jax_fp8, torch_ref, jax_ref)
        if dp is not None and stage != "end_to_end_weight_grad":  # the row tests over the whole batch
            row_tensors = tuple(dp.gather_rows(x.cpu()) for x in row_tensors)
        verdict = noise_verdict(*row_tensors)
        if stage != "end_to_end_weight_grad":  # a weight gradient's rows share every token's flips: not a sample
            same = verdict.same_distance
            checks.append(bounded_check(stage, f"{name} [distance to reference]", *same, 0.0, verdict.nan))
        checks.append(bounded_check(stage, name, *verdict.apart, verdict.max_abs, verdict.nan))
    return checks


__all__ = ["end_to_end_checks"]
