"""Diagnose the CUDA TransformerLayer check: GEMM accuracy and FP8 code flips, GEMM by GEMM.

Builds the case of `test_cuda_layer_matches_float64_quantized_math` exactly as the test does
(tests/torchside/layer64.py: fp8_step), records every cast and GEMM of the step
(tests/torchside/fp8_capture.py) and prints, per recipe:

- per GEMM: submodule, role, provider (cublaslt / triton / interpreter / reference), K, the GEMM's
  error against float64 on the operands it actually read (max |out - exact| / max |exact|, and the
  largest |out - exact| / sum |a b| as a power of 2: Hopper's FP8 accumulator keeps ~14 bits), and
  the FP8 code flips of its A and B operands against the float64 model's own casts (the model of
  the end-to-end check, which casts its own values). A row that is zero in exact arithmetic (query
  position 0 under the causal mask has dq = 0) holds fp32 residue that a 1x128 scale blows up into
  codes: those flips weigh nothing (see the per-tensor errors);
- per tensor: the end-to-end error against that model (what the test used to assert) and against
  the model following the module's codes (what it asserts now).

Run:  PYTHONPATH=. python3 benchmarks/diagnose/diagnose_cuda_layer.py [--recipes current,block] [--device cuda]
Default recipes: the three that failed on the H200 and two controls. On CPU the kernels are the
pure-torch reference (TRITON_INTERPRET=0): about 2 s a recipe.
"""

from __future__ import annotations

import argparse
import math
import os

import torch

from benchmarks.harness import environment_line
from bridge.numerics import relative_error
from fp8kernels.gemm_reference import gemm_operand
from tests.torchside.fp8_capture import Gemm, on_cpu
from tests.torchside.layer64 import fp8_step, model_errors
from tests.torchside.quantized_math64 import RECIPES, QuantizedMath64

CASE = "rmsnorm-swiglu-gqa-separate-rotary-bshd"


def _flips(module_q, model_q, columnwise: bool) -> str:
    """Codes of one operand copy that differ from the model's cast, +0 and -0 counted equal: 'count/codes'."""
    name = "columnwise_data" if columnwise else "data"
    got, want = getattr(module_q, name).cpu().to(torch.int32), getattr(model_q, name).to(torch.int32)
    if module_q.fmt == "e2m1":  # two codes a byte
        got, want = torch.stack([got & 0xF, got >> 4]), torch.stack([want & 0xF, want >> 4])
    magnitude = 0x7 if module_q.fmt == "e2m1" else 0x7F
    both_zero = ((got & magnitude) == 0) & ((want & magnitude) == 0)
    return f"{int(((got != want) & ~both_zero).sum())}/{got.numel()}"


def _operand_keys(gemm: Gemm) -> tuple[tuple[str, str, int], tuple[str, str, int]]:
    """The casts of A and B (fprop: input x weight, dgrad: grad x weight, wgrad: grad x input)."""
    name, _, slot = gemm.key
    b_role = "input" if gemm.role == "wgrad" else "weight"
    return gemm.key, (name, b_role, slot)


def diagnose(recipe_name: str, device: str) -> None:
    step = fp8_step("layer", CASE, recipe_name, device=device, record=True)
    casts = step.recording.casts
    plain = model_errors("layer", step, step.maths)  # the model casting its own values
    model_casts = {(name, *slot): q for name, model in step.maths.items() for slot, q in model.casts.items()}
    follow = {name: {} for name in step.maths}
    for (name, role, gemm), cast in casts.items():
        follow[name][role, gemm] = on_cpu(cast.q)
    maths = {
        n: QuantizedMath64(step.recipe, step.module.get_submodule(n), torch.float32, follow=follow[n]) for n in follow
    }
    followed = model_errors("layer", step, maths)

    print(f"\n== {recipe_name} ({device})")
    print(f"{'GEMM':34s} {'role':5s} {'provider':11s} {'K':>4s} {'rel err':>8s} {'log2 err/sum|ab|':>16s} "
          f"{'flips A':>10s} {'flips B':>10s}")  # fmt: skip
    for gemm in step.recording.gemms:
        exact, magnitude = gemm.float64()
        error = (gemm.out.cpu().double() - exact).abs()
        relative = (error.max() / exact.abs().max()).item()
        per_sum = (error / magnitude.clamp_min(torch.finfo(torch.float64).tiny)).max().item()
        a_key, b_key = _operand_keys(gemm)
        flips = [
            _flips(casts[key].q, model_casts[key], columnwise) if key in model_casts else "?"
            for key, columnwise in ((a_key, gemm.a_columnwise), (b_key, gemm.b_columnwise))
        ]
        name = f"{gemm.key[0]}[{gemm.key[2]}]"
        log2 = f"{math.log2(per_sum):.1f}" if per_sum > 0 else "exact"
        k = gemm_operand(gemm.a, gemm.a_columnwise, "a").k
        print(f"{name:34s} {gemm.role:5s} {gemm.provider:11s} {k:>4d} "
              f"{relative:8.1e} {log2:>16s} {flips[0]:>10s} {flips[1]:>10s}")  # fmt: skip
    inputs = {
        key: relative_error(cast.x, maths[key[0]].cast_inputs[key[1:]]) for key, cast in casts.items()
    }
    worst = max(inputs, key=inputs.get)
    print(f"cast inputs vs the following model: max relative error {inputs[worst]:.1e} at {' '.join(map(str, worst))}")
    print(f"{'tensor':40s} {'vs model':>9s} {'vs following model':>19s}")
    for name in plain:
        print(f"{name:40s} {plain[name]:9.1e} {followed[name]:19.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default = "current,current-e4m3-pow2,block,delayed,mxfp8"
    parser.add_argument("--recipes", default=default, help=f"comma-separated, of {list(RECIPES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "0"  # the pure-torch reference kernels: seconds, not minutes
    print(f"# diagnose_cuda_layer, {environment_line()}\n{CASE}")
    for recipe_name in args.recipes.split(","):
        diagnose(recipe_name, args.device)


if __name__ == "__main__":
    main()
