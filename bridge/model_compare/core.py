"""`bridge.compare(torch_model, jax_model, inputs)`: your own torch and NNX models, checked submodule by submodule.

Steps: check the arguments and pair the parameters (ValueError before any compute), copy torch's
parameter values into the JAX model, run torch once recording every submodule call
(bridge.model_compare.recorder), then call each common submodule of the JAX model on exactly the inputs
its torch twin received (teacher forcing) and, with backward=True, pull torch's output gradient of
that call back through it (jax.vjp). The model itself is the end-to-end check; under an FP8 recipe
that one is judged noise-aware (bridge.model_compare.noise) against both frameworks run with FP8 off.
Bounds: bridge.numerics.chain_bound. Order of the checks (the first failing one is
`first_divergence`): submodule outputs, input gradients, weight gradients (teacher-forced,
children before parents), then the end-to-end ones; with steps > 0, then the parameters and Adam moments
after one step on both sides from torch's state (bridge.model_compare.adam_steps), and all of it again
at the new parameters, up to `steps` steps.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import jax.numpy as jnp
import torch
from flax import nnx
from torch import nn

from bridge.model_compare import adam_steps, data_parallel, jax_calls, pairing, recipes
from bridge.model_compare.checks import distance_check
from bridge.model_compare.end_to_end import end_to_end_checks
from bridge.model_compare.recorder import Call, float_leaves, output_unit
from bridge.model_compare.report import CompareReport
from bridge.model_compare.torch_run import TorchRun, run_torch
from bridge.numerics import FP8_CORE_U, FP8_TENSOR_CORE_RECIPES, FP32_U, chain_bound
from bridge.params import ParamPair, jax_parameters, load_into_jax
from twinspec.mesh import MeshShape

# Recipes whose per-model state advances with each torch step while the JAX twin's calls start afresh.
STATEFUL_RECIPES = ("delayed", "nvfp4")


def _check_arguments(torch_model: Any, jax_model: Any, inputs: Any) -> tuple[torch.Tensor, ...]:
    if not isinstance(torch_model, nn.Module):
        raise TypeError(f"torch_model: pass a torch.nn.Module, not {type(torch_model).__name__}")
    if not isinstance(jax_model, nnx.Module) or not callable(jax_model):
        raise TypeError(f"jax_model: pass a callable flax.nnx.Module, not {type(jax_model).__name__}")
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else inputs
    if not isinstance(inputs, tuple) or not inputs or not all(isinstance(x, torch.Tensor) for x in inputs):
        raise TypeError("inputs: pass a torch.Tensor or a non-empty tuple of them (JAX gets the same values)")
    return inputs


def _copy_weights(torch_model: nn.Module, jax_model: nnx.Module, pairs: list[ParamPair]) -> None:
    """torch's parameter values into the JAX model, in its layout and dtype."""
    torch_params = dict(torch_model.named_parameters())
    current = jax_parameters(jax_model)
    values = {}
    for pair in pairs:
        value = pair.layout.to_jax(jax_calls.to_numpy(torch_params[pair.torch_name]))  # numpy: nothing to compile
        values[pair.jax_path] = jnp.asarray(value.astype(current[pair.jax_path].dtype))
    load_into_jax(jax_model, values)


def _common_names(torch_model: nn.Module, jax_model: nnx.Module) -> dict[str, nnx.Module]:
    """torch submodule name -> the NNX submodule at the same path, for those both models have."""
    found = {name: jax_calls.submodule(jax_model, name) for name, _ in torch_model.named_modules()}
    return {name: module for name, module in found.items() if module is not None}


def _label(call: Call, index: int, counts: Counter) -> str:
    return call.name if counts[call.name] == 1 else f"{call.name} (call {index + 1})"


def compare(
    torch_model: nn.Module | Any, jax_model: nnx.Module | Any, inputs: torch.Tensor | tuple[torch.Tensor, ...], *,
    recipe: Any = "off", params: Any = "auto", backward: bool = True, steps: int = 0,
    mesh: str | MeshShape | None = None, copy_params: bool = True,
) -> CompareReport:  # fmt: skip
    """Compare a torch model with its NNX twin on `inputs`, every common submodule teacher-forced (module docstring).

    recipe: "off", "current", "delayed", "block", "mxfp8", "nvfp4" or a recipe object (the same object
    under each side's own fp8_autocast). params: "auto", {torch name: NNX dotted path} or a list of
    bridge.params.Rule. steps: Adam steps after the checks (torchside FusedAdam / jaxside fused_adam, both
    from torch's state: bridge.model_compare.adam_steps), each followed by the checks again at the new
    parameters; `.step` of a check says which. torch's parameter values are copied into the JAX model; the
    torch model's are put back at the end. Both models should be fresh (DelayedScaling's histories are not
    copied) and deterministic (no dropout: put them in eval mode).
    copy_params=False: the first check runs the JAX model with its own parameter values (two models loaded
    from one file: a loader's difference is then the block it lands in); later steps start from torch's.
    mesh: e.g. "dp=2": run in that many co-located data-parallel processes (bridge.model_compare.data_parallel),
    `inputs` split along dim 0; the models are then given as factories the processes can import
    ("package.module:function" or a module-level function returning the model).
    """
    options = {"recipe": recipe, "params": params, "backward": backward, "steps": steps, "copy_params": copy_params}
    if mesh is None:
        return compare_here(torch_model, jax_model, inputs, **options)
    return _compare_on_mesh((torch_model, jax_model), inputs, mesh, **options)


def _compare_on_mesh(factories: tuple, inputs, mesh, **options) -> CompareReport:
    """Check everything in this process (the models built once, on the CPU), then run `compare_here` per rank."""
    from bridge import runtime

    processes = data_parallel.data_parallel_size(mesh)
    loaded = [data_parallel.load_model_factory(n, f) for n, f in zip(("torch_model", "jax_model"), factories)]
    torch_model, jax_model = (factory() for factory in loaded)
    inputs = _check_arguments(torch_model, jax_model, inputs)
    uneven = [list(x.shape) for x in inputs if x.ndim == 0 or x.shape[0] % processes]
    if uneven:
        raise ValueError(f"mesh {mesh!r}: inputs {uneven} do not split along dim 0 over {processes} ranks")
    name, _ = recipes.resolve(options["recipe"])
    _check_steps(options["steps"], options["backward"], name)
    pairing.pair(torch_model, jax_model, options["params"])
    device, _ = runtime.choose_device_type(None, processes, torch.cuda.device_count())
    inputs = tuple(x.detach().cpu() for x in inputs)
    return runtime.launch(data_parallel.worker, processes, factories, inputs, options, device_type=device)[0]


def compare_here(
    torch_model: nn.Module, jax_model: nnx.Module, inputs, *, recipe: Any = "off", params: Any = "auto",
    backward: bool = True, steps: int = 0, dp: data_parallel.DataParallel | None = None, copy_params: bool = True,
) -> CompareReport:  # fmt: skip
    """`compare` in this process; with `dp`, as one data-parallel rank of several (data_parallel's docstring)."""
    inputs = _check_arguments(torch_model, jax_model, inputs)
    name, recipe = recipes.resolve(recipe)
    _check_steps(steps, backward, name)
    pairs = pairing.pair(torch_model, jax_model, params)
    common = _common_names(torch_model, jax_model)
    device = next((p.device.type for p in torch_model.parameters()), "cpu")
    u_acc = FP8_CORE_U if device == "cuda" and name in FP8_TENSOR_CORE_RECIPES else FP32_U
    bits = recipes.mantissa_bits(recipe)
    report = CompareReport(
        model=f"{type(torch_model).__name__} / {type(jax_model).__name__}",
        mesh="1 process" if dp is None else f"dp={dp.size} ({dp.size} processes)", recipe=name, steps=steps,
        device_type=device,
    )  # fmt: skip
    initial = {key: value.detach().clone() for key, value in torch_model.state_dict().items()}
    optimizer = adam_steps.torch_adam(torch_model) if steps else None
    try:
        for step in range(steps + 1):
            if copy_params or step:  # each step starts both sides from torch's parameters
                _copy_weights(torch_model, jax_model, pairs)
            run = data_parallel.summed_torch_grads(run_torch(torch_model, inputs, recipe, set(common), backward), dp)
            checks, jax_root = _teacher_forced_checks(run, common, pairs, recipe, bits, u_acc, backward, dp)
            jax_root = data_parallel.summed_jax_grads(jax_root, dp)
            checks += end_to_end_checks(
                torch_model, jax_model, inputs, run, jax_root, pairs, recipe=recipe, u_acc=u_acc, backward=backward,
                dp=dp,
            )  # fmt: skip
            if step < steps:
                checks += adam_steps.adam_step(torch_model, optimizer, pairs, run.grads, jax_root[1])
            report.checks += [replace(check, step=step) for check in checks]
    finally:
        if steps:  # the optimizer moved torch's parameters: put them back, and JAX's with them
            torch_model.load_state_dict(initial)
            _copy_weights(torch_model, jax_model, pairs)
    return report


def _check_steps(steps: Any, backward: bool, recipe: str) -> None:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps={steps!r}: pass a whole number >= 0 of optimizer steps")
    if steps and not backward:
        raise ValueError(f"steps={steps} needs the gradients: pass backward=True, or steps=0")
    if steps and recipe in STATEFUL_RECIPES:
        raise ValueError(
            f"steps={steps} with recipe {recipe!r}: its state (amax history, rounding step) advances in torch but is "
            "not carried to the JAX side between steps; compare one step (steps=0) or use off, current, block or mxfp8"
        )


def _teacher_forced_checks(run: TorchRun, common: dict, pairs: list[ParamPair], recipe, bits, u_acc, backward, dp):
    """(the submodules' checks, the JAX results of the model's own call): outputs, input grads, weight grads."""
    counts = Counter(call.name for call in run.calls)
    seen: Counter = Counter()
    forward, input_grads, weight_grads = [], [], {}
    jax_root = None
    for call in run.calls:
        index = seen[call.name]
        seen[call.name] += 1
        outputs, param_grads, arg_grads = jax_calls.run_recorded(call, common[call.name], recipe, backward)
        bound_forward, bound_backward = chain_bound(
            call.reductions, mantissa_bits=bits, u_acc=u_acc, output_unit=output_unit(call.output)
        )
        if call.name == "":
            jax_root = (outputs, param_grads, arg_grads)
            continue
        label = _label(call, index, counts)
        forward.append(distance_check("forward", label, outputs, float_leaves(call.output), bound_forward))
        for position, grad in arg_grads.items():
            if position in call.input_grads:
                suffix = f" arg {position}" if len(call.grad_positions) > 1 else ""
                expected = call.input_grads[position]
                input_grads.append(distance_check("input_grad", label + suffix, [grad], [expected], bound_backward))
        _add_own_weight_grads(weight_grads, call, param_grads, bound_backward, pairs)
    checks = forward + input_grads
    for pair in pairs:
        if pair.torch_name in weight_grads:
            got, bound = weight_grads[pair.torch_name]
            expected = run.grads.get(pair.torch_name, torch.zeros_like(got))
            if dp is not None:  # JAX's sum over the ranks (torch's is in run.grads already)
                got = torch.from_numpy(dp.jax_sum(got.numpy()))
                bound += dp.sum_error(got.numel())
            checks.append(distance_check("weight_grad", pair.torch_name, [got], [expected], bound))
    return checks, jax_root


def _owner(torch_name: str) -> str:
    return torch_name.rsplit(".", 1)[0] if "." in torch_name else ""


def _add_own_weight_grads(into: dict, call: Call, param_grads: dict, bound: float, pairs: list[ParamPair]) -> None:
    """Add this call's grads of the parameters its module holds itself (summed over the module's calls)."""
    depth = len(call.name.split("."))
    for pair in pairs:
        if _owner(pair.torch_name) != call.name:
            continue
        grad = param_grads.get(tuple(pair.jax_path[depth:]))
        if grad is None:
            continue
        value = jax_calls.to_torch(pair.layout.to_torch(grad))
        if pair.torch_name in into:
            total, previous = into[pair.torch_name]
            into[pair.torch_name] = (total + value, max(previous, bound))
        else:
            into[pair.torch_name] = (value, bound)


__all__ = ["compare", "compare_here"]
