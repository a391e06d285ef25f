"""The tolerance table of the project, and the torch-vs-JAX check behind `shardbridge verify`.

Every comparison is of a JAX value against torch's (the reference b): relative error
`||a - b|| / ||b||` over the whole tensor, plus the largest |a - b|; a NaN on either side never
passes. Quantized bytes compare bitwise (`BITWISE`). Norms are summed shard by shard: each process
compares its own shards (JAX's resharded to torch's layout, bridge.params / bridge.transfer) and
one all-reduce per step adds them up; a shard held by r ranks counts 1/r on each.

Every step starts both sides from one state: after a step's checks the JAX twin takes torch's
parameters and Adam moments (`shardbridge verify`, bridge.crosscheck). Left to run free, the two
drift apart (Adam turns rounding noise into +-lr steps, below), and every later check would measure
that drift instead of the step: on an H200, FP8 off, the forward of step 1 differed by 2e-5 after
one free update (parameters 7.7e-5 apart), 1e-6 from the same state.

Tolerances, from the arithmetic (u: unit roundoff, 2^-24 fp32, 2^-4 E4M3, 2^-3 E5M2, 2^-2 E2M1):

- FP8 off: both sides compute in fp32 in different orders (XLA also fuses multiply-adds), a few u
  times sqrt(K) per GEMM: 1e-5 relative for activations, gradients and moments.
- Recipes whose scales both sides compute alike (1x128/128x128 blocks, MXFP8; DelayedScaling at the
  first step, with the world as amax group; on a data-parallel mesh the JAX twin casts each DP
  shard's tokens with that shard's blocks, as each torch rank does: jaxside.modules.tokens): the FP8
  operands are the same but for codes flipped by fp32-order noise just before a cast;
  test_modules_cross bounds those to 1/16 of a tensor, each moved by one code (2u), so
  2u * sqrt(1/16) = u/2: 2^-5 forward (E4M3), 2^-4 for gradients (E5M2). DelayedScaling's later
  steps take the next item's bound: its amax history holds each side's own amaxes (of tensors
  computed in different orders), so its scales differ (measured free-running, 2-layer
  TransformerLayer, FSDP x TP 2x2: up to 1.25e-1 on gradients, within 2u).
  The premise is fp32 sums. On CUDA the per-tensor and block-scaled GEMMs run on FP8 tensor cores
  (torch's cuBLASLt and Triton GEMMs; the twin's per-tensor dot_general through XLA), whose
  accumulator keeps about 14 bits: on an H200 their outputs sit 2^-13..2^-16 of sum |a b| from
  exact and flip 0.1-0.3% of the next cast's codes, against none for fp32 sums
  (benchmarks/diagnose_fp8_gemm_noise.py); through two layers and back the flips grow to current
  scaling's errors (DelayedScaling's first step: input grad 6.8e-2, weight grads 0.11; 1e-7 with
  both sides' GEMMs made exact fp32). There these recipes take the next item's bound, 2u.
  MXFP8 and NVFP4 GEMMs are emulated with bf16 dots (exact products, fp32 sums): u/2 everywhere.
- Recipes whose scales differ (Float8CurrentScaling: torch scales each DP rank's activations and
  gradients by that rank's amax; JAX does so on a data-parallel mesh, but a twin off the mesh casts
  the whole batch with one amax; NVFP4: torch's global amaxes are
  of the shard each rank holds, TP's feature split included): every element of an operand may sit
  one quantization step apart, up to 2u relative: 2^-3 forward (E4M3), 2^-2 for gradients (E5M2);
  2^-1 for NVFP4's E2M1.
- Parameters after one Adam step from the same state are at most twice one step's move apart,
  lr * max(1, (1 - beta1) / sqrt(1 - beta2)) (max-abs), with FP8 off too: Adam divides a gradient by
  its own magnitude, so a gradient that is zero up to rounding (an attention key bias: softmax
  ignores what it adds to every score) takes a full +-lr step whose sign is the rounding noise of
  each framework. A wrong mapping moves parameters by their initial values instead. Adam's exp_avg
  adds (1 - beta1) of this step's gradient to the common moment (the gradient's tolerance),
  exp_avg_sq its square ((1 + g)^2 - 1).

Bounds of `bridge.compare` (derived, not tuned; docs/verification.md has the long form):

- Teacher forcing: each common submodule's JAX twin gets torch's inputs to that submodule bit for
  bit, so nothing compounds across submodules: only the submodule's own arithmetic can differ.
  Quantizers are bit-exact (docs/quantization.md), so what is left is the order of accumulation
  and the GEMM kernels. `chain_bound` walks the submodule's reductions (GEMMs, norms, softmax: what
  torch ran inside it, bridge.model_compare.recorder) in order, adding for each:
  * 2 * lambda * sqrt(K) * rho * u_acc: each side's length-K sum is within lambda*sqrt(K)*u_acc of
    exact times sum |terms| with probability >= 1 - 2 n K exp(-lambda^2 / 2) (Higham & Mary, SIAM
    J. Sci. Comput. 41(5), 2019, Thm. 3.1; lambda from FALSE_ALARM for all n outputs), and
    sum |terms| / |sum| is rho = sqrt(K) for terms of random sign (1 for sums of positive terms:
    variances, softmax denominators). ASSUMED: structured data with more cancellation than random
    signs (an output that is ~0 by construction) is outside the bound;
  * 2 * u_out: one rounding to the output dtype can land one ulp apart (bf16: u = 2^-8);
  * ELEMENTWISE_ULPS * u_acc: the elementwise functions after the sum (exp, erf, tanh, rsqrt) of two
    math libraries, each within a few ulp. Once more (with the output's 2 u_out) for the functions
    after the last sum, or for a submodule without sums (an activation), and once more backward.
  Relative errors are carried through the rest of the submodule with gain 1 (ASSUMED: a residual
  add shrinks them, a norm keeps them, an activation's condition number is ~1 where inputs are O(1)).
  FP8 recipes add, at each GEMM whose input already differs by delta (relative), the flipped codes
  of its cast: an element within delta |x| of a rounding boundary flips, which for boundaries
  2^-(m+1) |x| apart or more (m mantissa bits: E4M3 3, E5M2 2, E2M1 1) happens with probability
  p <= delta * 2^(m+1); the number of flips among n elements is Binomial(n, p), below its
  1 - FALSE_ALARM quantile k; each flip moves an element by one code, <= 2^-m relative, so the
  operand moves by sqrt(k / n) * 2^-m. A GEMM whose inputs are exact (the submodule's own inputs,
  the weights) casts the same codes: no flips, which keeps a leaf FP8 Linear's bound at fp32 level.
  The backward chain starts where the forward ended (saved activations differ by that much) and
  walks the reductions backwards with the backward sums' lengths (dgrad: N, wgrad: M of an
  [M, K] x [K, N] GEMM) and the grad format.
  False alarms: a correct pair exceeds a bound only through a rounding tail (FALSE_ALARM each) or a
  violated ASSUMED line; depth plays no part. Misses: a difference inside one submodule of relative
  size below its bound (typically 1e-5..1e-4 with FP8 off for K <= 1024; percents under FP8 in
  small tensors, where a few flips are a large fraction) passes; anything larger is named there.
- End to end with FP8 off: the whole model's chain (the same walk over all its reductions).
- End to end under an FP8 recipe, noise-aware (bridge.model_compare.noise): both frameworks also run with
  FP8 off (the references). With per-row errors e_t = torch_fp8 - torch_ref and e_j = jax_fp8 -
  jax_ref, pass when (a) a paired t-test on ||e_t,r||^2 - ||e_j,r||^2 over the rows r accepts equal
  means (two-sided, FALSE_ALARM), i.e. both frameworks are as far from their reference, and (b) the
  cross term -2 <e_t, e_j> is not significantly positive (one-sided t-test): two faithful
  frameworks make the same or independent FP8 errors, so ||e_t - e_j||^2 <= ||e_t||^2 + ||e_j||^2
  up to the test's margin; with the references' own distance (checked by the FP8-off bound) that
  bounds the torch-vs-JAX FP8 distance. Rows are taken as independent samples: tokens of the output
  and input gradient; not a weight gradient's rows (each sums over the same tokens), which take (b)
  only. d_tj <= d_t + d_j + d_ref holds for any pair (the triangle inequality), so a rule of that
  form alone could never fail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from twinspec.recipe import recipe_names

E4M3_U, E5M2_U, E2M1_U = 2.0**-4, 2.0**-3, 2.0**-2
FP32_ORDER = 1e-5
STAGES = ("layout", "forward", "input_grad", "weight_grad", "param", "exp_avg", "exp_avg_sq")
# The recipe names verify and the demo take: twinspec's registry (cheap to import, with neither torch nor jax),
# the one both frameworks build their recipes from; TOLERANCES has a row for each.
RECIPES = recipe_names()


@dataclass(frozen=True)
class Tolerance:
    """Pass when relative <= `relative` and (if set) max_abs <= `max_abs`, with no NaN."""

    relative: float | None
    max_abs: float | None = None

    def passes(self, relative: float, max_abs: float, nan: bool) -> bool:
        if nan or not math.isfinite(relative) or not math.isfinite(max_abs):
            return False
        return (self.relative is None or relative <= self.relative) and (self.max_abs is None or max_abs <= self.max_abs)


BITWISE = Tolerance(0.0, 0.0)


def relative_error(got: Any, expected: Any) -> float:
    """`||got - expected|| / ||expected||` over the whole tensor, in float64: the relative error every tolerance
    here bounds, the one definition tests and benchmarks use. Numpy, JAX or torch arrays of any dtype and device;
    0 where both are zero, inf where only `expected` is."""
    a, b = _float64(got), _float64(expected)
    if a.shape != b.shape:
        raise ValueError(f"relative_error: got shape {a.shape}, expected {b.shape}: compare tensors of one shape")
    return _ratio(float(np.linalg.norm(a - b)), float(np.linalg.norm(b)))


def _float64(array: Any) -> np.ndarray:
    if hasattr(array, "detach"):  # torch (imported by the caller, not here): bf16 and FP8 have no numpy dtype
        array = array.detach().cpu().double().numpy()
    return np.asarray(array, dtype=np.float64)


def _ratio(difference_norm: float, reference_norm: float) -> float:
    if reference_norm > 0:
        return difference_norm / reference_norm
    return 0.0 if difference_norm == 0 else math.inf


def _fp8(u_forward: float, u_grad: float, factor: float) -> dict[str, Tolerance]:
    grad = Tolerance(factor * u_grad)
    return {"forward": Tolerance(factor * u_forward), "input_grad": grad, "weight_grad": grad}


SAME_SCALES, OWN_SCALES = 0.5, 2.0  # factors of u (module docstring)
FP8_UNITS = {"delayed": (E4M3_U, E5M2_U), "block": (E4M3_U, E5M2_U), "mxfp8": (E4M3_U, E5M2_U),
             "current": (E4M3_U, E5M2_U), "nvfp4": (E2M1_U, E2M1_U)}  # fmt: skip
SAME_SCALES_ALWAYS = ("block", "mxfp8")  # scales from the step's own values only
SAME_SCALES_AT_FIRST_STEP = ("delayed",)  # then from each side's own amax history
FP8_TENSOR_CORE_RECIPES = ("current", "delayed", "block")  # on CUDA: sums in Hopper's ~14-bit FP8 accumulator

# recipe -> stage -> tolerance where the two sides' scales may differ ("param" and the optimizer states:
# see `tolerance`).
TOLERANCES: dict[str, dict[str, Tolerance]] = {
    "off": dict.fromkeys(("forward", "input_grad", "weight_grad"), Tolerance(FP32_ORDER)),
    **{recipe: _fp8(*units, OWN_SCALES) for recipe, units in FP8_UNITS.items()},
}
# recipe -> stage -> tolerance where both sides cast the same values with the same scales (tighter).
SAME_SCALE_TOLERANCES: dict[str, dict[str, Tolerance]] = {
    recipe: _fp8(*FP8_UNITS[recipe], SAME_SCALES) for recipe in SAME_SCALES_ALWAYS + SAME_SCALES_AT_FIRST_STEP
}

ADAM_BETAS = (0.9, 0.999)


def adam_step_bound(lr: float, betas: tuple[float, float] = ADAM_BETAS) -> float:
    """The most one Adam step moves an element (bias-corrected m/sqrt(v) is at most max(1, (1-b1)/sqrt(1-b2)))."""
    beta1, beta2 = betas
    return lr * max(1.0, (1 - beta1) / math.sqrt(1 - beta2))


def tolerance(recipe: str, stage: str, *, lr: float = 0.0, steps_taken: int = 0, device_type: str = "cpu") -> Tolerance:
    """The tolerance of a check after `steps_taken` updates on `device_type` ("cpu" | "cuda"): the tables', or the
    parameter and moment bounds above."""
    if stage == "layout":
        return BITWISE
    if stage in TOLERANCES[recipe]:
        same_scales = recipe in SAME_SCALES_ALWAYS or (recipe in SAME_SCALES_AT_FIRST_STEP and steps_taken == 0)
        fp32_sums = not (device_type == "cuda" and recipe in FP8_TENSOR_CORE_RECIPES)
        return SAME_SCALE_TOLERANCES[recipe][stage] if same_scales and fp32_sums else TOLERANCES[recipe][stage]
    if stage == "param":  # every recipe, FP8 off included (module docstring: Adam turns noise into steps)
        return Tolerance(None, 2 * adam_step_bound(lr))
    if recipe == "off":
        return Tolerance(FP32_ORDER)
    # The moments after update k: the common moments of update k - 1 plus step k - 1's gradient.
    grad = tolerance(recipe, "weight_grad", steps_taken=max(steps_taken - 1, 0), device_type=device_type).relative
    return Tolerance(grad if stage == "exp_avg" else (1 + grad) ** 2 - 1)


@dataclass(frozen=True)
class TensorCheck:
    """One comparison: which tensor, when, how far apart, and the verdict."""

    step: int
    stage: str
    name: str  # torch's name ("layers.0.mlp.fc1_weight"), "layers.0" for a block output, "input" for dx
    relative: float
    max_abs: float
    nan: bool
    tolerance: Tolerance
    passed: bool

    @property
    def layer(self) -> str:
        """`layers.<i>` of the name, or the name itself."""
        parts = self.name.split(".")
        return ".".join(parts[:2]) if parts[0] == "layers" and len(parts) > 1 else self.name


@dataclass
class VerifyReport:
    """Every check of one (model, mesh, recipe) case, in the order they ran."""

    model: str
    mesh: str
    recipe: str
    steps: int
    device_type: str = "cpu"  # where both sides ran: the tolerances depend on it (`tolerance`)
    checks: list[TensorCheck] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    @property
    def first_divergence(self) -> TensorCheck | None:
        """The first failing check: earliest step, then forward before backward before the update, layers in order."""
        return next((check for check in self.checks if not check.passed), None)

    def to_json(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "model": self.model,
            "mesh": self.mesh,
            "recipe": self.recipe,
            "steps": self.steps,
            "device_type": self.device_type,
            "passed": self.passed,
            "first_divergence": None if first is None else {**asdict(first), "layer": first.layer},
            "checks": [asdict(check) for check in self.checks],
        }


def reduce_stats(local_stats, group=None) -> list[tuple[float, float, bool]]:
    """(relative, max_abs, nan) per tensor from every rank's rows [sq_diff, sq_ref, nan_count, max_abs]."""
    import torch.distributed as dist

    sums, maxima = local_stats[:, :3].contiguous(), local_stats[:, 3].contiguous()
    if dist.is_initialized():
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX, group=group)
    results = []
    for (sq_diff, sq_ref, nans), max_abs in zip(sums.tolist(), maxima.tolist()):
        relative = _ratio(math.sqrt(sq_diff), math.sqrt(sq_ref))
        results.append((relative, max_abs, nans > 0))
    return results


def local_stats(got, expected, replicas: int):
    """One row [sq_diff, sq_ref, nan_count, max_abs] of two local shards (float64), weighted 1/replicas."""
    import torch

    a, b = got.detach().to(torch.float64).reshape(-1), expected.detach().to(torch.float64).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"shards of {tuple(got.shape)} and {tuple(expected.shape)} cannot be compared")
    nans = (torch.isnan(a) | torch.isnan(b)).sum()
    diff = torch.nan_to_num(a - b, nan=0.0, posinf=math.inf, neginf=math.inf).abs()
    max_abs = diff.max() if diff.numel() else torch.zeros((), dtype=torch.float64)
    return torch.stack([diff.square().sum() / replicas, b.square().sum() / replicas, nans.to(torch.float64), max_abs])


def collect(
    report: VerifyReport,
    step: int,
    stage: str,
    entries: Sequence[tuple[str, Any, Any, int]],
    *,
    lr: float,
    steps_taken: int,
) -> None:
    """Compare (name, JAX local, torch local, replicas) entries of one stage across ranks; append their checks."""
    import torch

    if not entries:
        return
    rows = torch.stack([local_stats(got, expected, replicas) for _, got, expected, replicas in entries])
    limit = tolerance(report.recipe, stage, lr=lr, steps_taken=steps_taken, device_type=report.device_type)
    for (name, *_), (relative, max_abs, nan) in zip(entries, reduce_stats(rows)):
        report.checks.append(
            TensorCheck(step, stage, name, relative, max_abs, nan, limit, limit.passes(relative, max_abs, nan))
        )


# ----------------------------------------------------------------------------- bridge.compare's bounds (docstring)

FALSE_ALARM = 1e-6  # probability that one rounding tail, flip count or noise test of a correct pair exceeds its bound
ELEMENTWISE_ULPS = 4  # two math libraries' exp, erf, tanh, rsqrt: each within a few ulp of exact
FP32_U, BF16_U, FP16_U = 2.0**-24, 2.0**-8, 2.0**-11
FP8_CORE_U = 2.0**-14  # Hopper's FP8 tensor-core accumulator keeps about 14 bits (module docstring)
MANTISSA_BITS = {"e4m3": 3, "e5m2": 2, "e2m1": 1}


@dataclass(frozen=True)
class Reduction:
    """One sum inside a submodule, as torch ran it: a GEMM [M, K] x [K, N], or a norm's or softmax's sum of K."""

    kind: str  # "gemm" | "sum"
    length: int  # K
    backward_lengths: tuple[int, ...]  # the backward's sums: (N, M) for a GEMM (dgrad, wgrad), (K,) for a sum
    outputs: int  # elements it writes
    operand: int  # elements of the activation operand a GEMM casts under FP8
    unit: float  # unit roundoff of its output dtype


def rounding_error(length: int, outputs: int, unit: float, *, positive: bool, u_acc: float = FP32_U) -> float:
    """Relative distance of two length-K sums in different orders, plus the output's ulp and libm's (docstring)."""
    lam = math.sqrt(2 * math.log(2 * max(outputs, 1) * max(length, 1) / FALSE_ALARM))
    rho = 1.0 if positive else math.sqrt(length)
    return 2 * lam * math.sqrt(length) * rho * u_acc + 2 * unit + ELEMENTWISE_ULPS * u_acc


def flip_error(delta: float, elements: int, mantissa_bits: int) -> float:
    """Relative move of an FP8 cast of `elements` values whose inputs differ by `delta` (relative) between sides."""
    if delta <= 0 or elements <= 0:
        return 0.0
    from scipy.stats import binom

    p = min(1.0, delta * 2.0 ** (mantissa_bits + 1))
    flips = min(float(binom.isf(FALSE_ALARM, elements, p)) + 1, elements)  # P(more than this) <= FALSE_ALARM
    return math.sqrt(flips / elements) * 2.0**-mantissa_bits


def chain_bound(
    reductions: Sequence[Reduction],
    *,
    mantissa_bits: tuple[int, int] | None,
    u_acc: float = FP32_U,
    output_unit: float = FP32_U,
) -> tuple[float, float]:
    """(forward, backward) relative bounds of a teacher-forced submodule (docstring); mantissa_bits: (forward, grad)
    of the FP8 recipe, None with FP8 off; output_unit: the unit roundoff of the submodule's output dtype."""
    elementwise = 2 * output_unit + ELEMENTWISE_ULPS * u_acc  # the functions after the last sum, or without any
    delta = 0.0
    for r in reductions:
        if mantissa_bits and r.kind == "gemm":
            delta += flip_error(delta, r.operand, mantissa_bits[0])
        delta += rounding_error(r.length, r.outputs, r.unit, positive=r.kind == "sum", u_acc=u_acc)
    forward = delta + elementwise
    backward = forward + elementwise  # the derivatives of those functions
    for r in reversed(reductions):
        for length in r.backward_lengths:
            if mantissa_bits and r.kind == "gemm":
                backward += flip_error(backward, r.outputs, mantissa_bits[1])
            backward += rounding_error(length, r.outputs, r.unit, positive=r.kind == "sum", u_acc=u_acc)
    return forward, backward


__all__ = [
    "BF16_U",
    "BITWISE",
    "ELEMENTWISE_ULPS",
    "FALSE_ALARM",
    "FP16_U",
    "FP32_U",
    "FP8_CORE_U",
    "MANTISSA_BITS",
    "Reduction",
    "chain_bound",
    "flip_error",
    "rounding_error",
    "RECIPES",
    "SAME_SCALE_TOLERANCES",
    "STAGES",
    "TOLERANCES",
    "TensorCheck",
    "Tolerance",
    "VerifyReport",
    "adam_step_bound",
    "collect",
    "local_stats",
    "reduce_stats",
    "relative_error",
    "tolerance",
]
