"""`shardbridge verify`: the same model in torch and JAX on the same devices, compared step by step.

Builds the torchside model and its jaxside twin with the same weights, runs forward, backward and
Adam for --steps steps under each recipe and compares them. Without tp or --plan (--mesh dp=1, dp=2,
rep=2,dp=2) that is bridge.compare, here or in one co-located process per device (bridge.runtime):
every block and submodule teacher-forced against its derived bound, end to end, then parameters and
Adam moments. On a TP mesh or under a plan each process holds its shards and every block's output,
the input gradient, every weight gradient, parameter and Adam moment are compared shard by shard
(tolerances: bridge.numerics). With --model llama --hf HF_DIR both instead load a Hugging Face Llama
checkpoint (FP8 off by default); with --model llama --plan PLAN the seeded tiny Llama under the plan
is compared with its JAX twin and with the unsharded model. Exit codes: 0 all within tolerance, 1 a
divergence (the first one is named), 2 bad input.

--plan PLAN places both twins by a placement plan (a TOML file, twinspec.plan): its [mesh] is the
default --mesh, and the plan is checked against the model before any process starts. Without --model,
the model is the first of mlp, transformer and llama whose parameter names the plan's rules all match
(one line says which; an explicit --model the plan does not match is an error naming the rule). With --model
llama (no --hf) the model is the seeded tiny Llama, embedding and head included: its logits in torch
under the plan, in the JAX twin and in the unsharded model are compared (bridge/plan_check.py).

--model llama --hf HF_DIR: torchside's and jaxside's load_hf in each process (fp32), one forward of
--batch-size x --seq-len random tokens under --recipe (default off) (bridge/hf_check.py, docs/hf.md).
Without tp (one process, e.g. --mesh dp=1, or data-parallel ones, e.g. --mesh dp=2) the two loaded
models go through bridge.compare, each process on its rows of the tokens: every block teacher-forced
against its derived bound, then the logits, noise-aware under FP8. On a TP mesh each process loads
its own shards and the logits are compared against bridge.numerics' forward tolerance.

--torch PKG.MODULE:FACTORY --jax PKG.MODULE:FACTORY: your own pair of models, each factory returning
(model, example inputs), compared by bridge.compare on this process, every common submodule
teacher-forced (docs/verification.md); --recipe as above (default off), --steps (default 0: Adam steps,
parameters and moments compared after each), --json, --report.
"""

from __future__ import annotations

import argparse
import json

from rich.console import Console
from rich.markup import escape

from bridge.errors import CheckFailed
from bridge.numerics import RECIPES
from bridge.report_table import render

RECIPE_CHOICES = f"{', '.join(RECIPES)} (comma-separated) or all"
STACK_DEFAULTS = {"layers": 2, "hidden": 256, "steps": 5}  # the built-in stacks' options (bridge/twins.py)
HF_DEFAULTS = {"batch_size": 8, "seq_len": 32}  # --model llama --hf's options
# Without --model, --plan PLAN picks the first of these whose parameter names every rule of the plan matches.
PLAN_MODELS = ("mlp", "transformer", "llama")


def register(verbs) -> None:
    parser = verbs.add_parser(
        "verify",
        help="run a model in torch and JAX on the same devices and name the first tensor that diverges",
        description=__doc__.split("\n\n")[1],
    )
    parser.add_argument(
        "--model",
        help="linear, mlp or transformer (bridge/twins.py), or llama with --hf or --plan; default: mlp, or with "
        f"--plan the first of {', '.join(PLAN_MODELS)} whose parameter names the plan's rules all match",
    )  # fmt: skip
    parser.add_argument(
        "--hf",
        metavar="HF_DIR",
        help="a Hugging Face Llama directory (with --model llama): without tp, every block and the logits of the two "
        "load_hf's by bridge.compare; on a TP mesh their logits",
    )
    parser.add_argument("--layers", type=int, help=f"blocks in the stack (default {STACK_DEFAULTS['layers']})")
    parser.add_argument(
        "--hidden", type=int,
        help=f"hidden size (default {STACK_DEFAULTS['hidden']}; ffn = 4x; TP must divide the ffn and heads)",
    )  # fmt: skip
    parser.add_argument("--recipe", help=f"{RECIPE_CHOICES}; default current, off with --hf")
    parser.add_argument(
        "--mesh", action="append", help="mesh axes, e.g. dp=2,tp=2 (FSDP x TP) or rep=2,dp=2 (HSDP); repeatable"
    )
    parser.add_argument(
        "--plan", metavar="PLAN",
        help="a placement plan TOML file (examples/plans/); its [mesh] is the default --mesh; with --model llama: "
        "the tiny Llama under it",
    )  # fmt: skip
    parser.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps compared (default {STACK_DEFAULTS['steps']}, with --torch/--jax 0; not with --model "
        "llama)",
    )
    parser.add_argument(
        "--batch-size", type=int,
        help=f"--model llama: sequences of random tokens (default {HF_DEFAULTS['batch_size']})",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, help=f"--model llama: tokens per sequence (default {HF_DEFAULTS['seq_len']})"
    )
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="default: cuda where torch sees a GPU per process, else the CPU"
    )
    parser.add_argument("--torch", metavar="PKG.MODULE:FACTORY", help="your torch model: a factory of (model, inputs)")
    parser.add_argument("--jax", metavar="PKG.MODULE:FACTORY", help="its NNX twin, compared by bridge.compare")
    parser.add_argument("--json", action="store_true", help="print every check as JSON")
    parser.add_argument("--report", metavar="FILE", help="also write the JSON report here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace, console: Console) -> int:
    from bridge import crosscheck, hf_check, plan_check
    from bridge.model_compare import stacks
    from bridge.plan.build import read_plan

    if args.torch or args.jax:
        return _run_factories(args, console)
    plan = None if args.plan is None or args.hf is not None else read_plan(args.plan)  # --hf refuses --plan
    args.model, chosen = _model(args, plan)
    if args.model == "llama" and args.hf is None and plan is not None:
        case = _plan_case(args, plan)
        work, processes, worker = case, case.mesh.world_size, plan_check.verify_plan
    elif args.model == "llama" or args.hf is not None:
        case = _hf_case(args)
        worker = hf_check.verify_hf if case.mesh.tp > 1 else hf_check.compare_hf_ranks
        work, processes = case, case.mesh.world_size
    else:
        cases = _cases(args, plan)
        # A plan is a placement: only the sharded check tests it (docs/verification.md).
        sharded = plan is not None or cases[0].mesh.tp > 1
        worker = crosscheck.verify if sharded else stacks.compare_stacks_ranks
        work, processes = cases, cases[0].mesh.world_size
    if args.report:
        from bridge.cli import check_output_path

        check_output_path("--report", args.report)  # before the run, whose results would be lost
    import torch

    from bridge import runtime

    errors = Console(stderr=True, soft_wrap=True)
    if chosen:
        errors.print(escape(chosen))
    device, fallback = runtime.choose_device_type(args.device, processes, torch.cuda.device_count())
    if fallback:
        errors.print(escape(fallback))
    if worker is stacks.compare_stacks_ranks:
        for line in _step_zero_only(cases):
            errors.print(escape(line))
    in_process = {hf_check.compare_hf_ranks: hf_check.compare_hf, stacks.compare_stacks_ranks: stacks.compare_stacks}
    if worker in in_process and processes == 1:  # bridge.compare on one process: none to start
        with errors.status("verifying in this process (bridge.compare)"):
            reports = in_process[worker](work, device)
        return _finish(args, console, reports)
    with errors.status(f"verifying in {processes} co-located torch+JAX processes"):
        reports = runtime.launch(worker, processes, work, device_type=device)[0]
    return _finish(args, console, reports)


def _finish(args: argparse.Namespace, console: Console, reports: list[dict]) -> int:
    """Write --report, print the tables or --json, and raise CheckFailed naming the first divergence."""
    if args.report:
        with open(args.report, "w") as file:
            json.dump(reports, file, indent=1)
    if args.json:
        console.out(json.dumps(reports), highlight=False)
    else:
        for report in reports:
            render(console, report)
    failed = [report for report in reports if not report["passed"]]
    if failed:
        report, first = failed[0], failed[0]["first_divergence"]
        limit = first["tolerance"]
        raise CheckFailed(
            f"torch and JAX diverge ({report['model']} on {report['mesh']}, recipe {report['recipe']}): "
            f"{first['name']} ({first['stage']}, step {first['step']}) relative {first['relative']:.3e} "
            f"(limit {limit['relative']}), max-abs {first['max_abs']:.3e} (limit {limit['max_abs']})"
        )
    return 0


def _run_factories(args: argparse.Namespace, console: Console) -> int:
    """--torch and --jax: bridge.compare of the factories' models on this process, one report per recipe."""
    from bridge.model_compare.factories import compare_factories

    if not (args.torch and args.jax):
        raise ValueError("--torch and --jax go together: pass both factories (PKG.MODULE:FACTORY)")
    stack_options = ("model", "hf", "plan", "mesh", "layers", "hidden", "batch_size", "seq_len", "device")
    given = [f"--{name.replace('_', '-')}" for name in stack_options if getattr(args, name) not in (None, "mlp")]
    if given:
        raise ValueError(f"{', '.join(given)}: options of the built-in models, not of --torch/--jax")
    if args.report:
        from bridge.cli import check_output_path

        check_output_path("--report", args.report)
    recipes, steps = _recipes(args.recipe or "off"), args.steps or 0
    reports = [r.to_json() for r in compare_factories(args.torch, args.jax, recipes, steps=steps)]
    return _finish(args, console, reports)


def _step_zero_only(cases) -> list[str]:
    """A line per recipe that bridge.compare checks at step 0 only (bridge.model_compare.stacks)."""
    from bridge.model_compare.stacks import steps_of

    recipes = dict.fromkeys(r for case in cases for r in case.recipes if steps_of(case, r) < case.steps)
    return [
        f"recipe {recipe}: compared at step 0 only (bridge.compare does not carry its scaling state to the next step)"
        for recipe in recipes
    ]


def _recipes(text: str) -> tuple[str, ...]:
    return RECIPES if text == "all" else tuple(r.strip() for r in text.split(",") if r.strip())


def _model(args: argparse.Namespace, plan) -> tuple[str, str | None]:
    """--model, or the one chosen without it (its help says how), and a line saying which when a plan chose it."""
    if args.model is not None:
        return args.model, None
    if plan is None or not plan.rules or args.hf is not None:
        return PLAN_MODELS[0], None
    for model in PLAN_MODELS:
        names = _parameter_names(model, args)
        if all(any(rule.matches(name) for name in names) for rule in plan.rules):
            candidates = ", ".join(PLAN_MODELS)
            return model, f"--plan {args.plan}: --model {model}, the first of {candidates} whose names its rules match"
    return PLAN_MODELS[0], None  # none matches: the default model's check names the rule


def _parameter_names(model: str, args: argparse.Namespace) -> set[str]:
    """The torch names a plan's rules match in `model` (its units and parameters), built on meta."""
    from bridge.twins import TwinSpec, build_torch
    from torchside.models.llama import LLAMA_CONFIGS, Llama
    from torchside.parallel.plan import model_params, model_units

    if model == "llama":
        torch_model = Llama(LLAMA_CONFIGS["tiny"], device="meta")
    else:
        sizes = [STACK_DEFAULTS[n] if getattr(args, n) is None else getattr(args, n) for n in ("layers", "hidden")]
        torch_model = build_torch(TwinSpec(model, *sizes, tp_size=1, amax_history_len=1))
    return {*model_units(torch_model), *model_params(torch_model)}


def _hf_case(args: argparse.Namespace):
    """--model llama --hf DIR's case, its checkpoint and mesh checked (bridge.hf_check.check_input)."""
    from bridge.hf_check import HFCase, check_input

    if args.model != "llama":
        raise ValueError(f"--hf with --model {args.model}: an HF checkpoint is a Llama; pass --model llama")
    if args.hf is None:
        raise ValueError(
            "--model llama needs --hf HF_DIR (a Hugging Face Llama directory) or --plan PLAN (the seeded tiny Llama)"
        )
    if args.plan is not None:
        raise ValueError(
            "--plan with --hf: a checkpoint loads by the built-in placement; verify a plan on the seeded tiny Llama "
            "(--model llama --plan PLAN, without --hf)"
        )
    mesh = _llama_mesh(args, "--hf")
    case = HFCase(args.hf, mesh, _recipes(args.recipe or "off"), **_llama_options(args, "--hf"))
    check_input(case)
    return case


def _plan_case(args: argparse.Namespace, plan):
    """--model llama --plan PLAN's case, the plan checked against the tiny Llama (bridge.plan_check.check_input)."""
    from pathlib import Path

    from bridge.plan_check import PlanCase, check_input

    mesh = _llama_mesh(args, "--model llama --plan", plan)
    options = _llama_options(args, "--model llama --plan")
    case = PlanCase(plan, mesh, _recipes(args.recipe or "current"), name=Path(args.plan).stem, **options)
    check_input(case)
    return case


def _llama_options(args: argparse.Namespace, what: str) -> dict:
    """--batch-size and --seq-len with their defaults; ValueError for the stacks' own options."""
    stack_only = [f"--{name}" for name in STACK_DEFAULTS if getattr(args, name) is not None]
    if stack_only:
        raise ValueError(f"{', '.join(stack_only)}: options of the built-in stacks, not of {what} (a Llama)")
    return {
        name: default if getattr(args, name) is None else getattr(args, name) for name, default in HF_DEFAULTS.items()
    }


def _llama_mesh(args: argparse.Namespace, what: str, plan=None):
    """The one --mesh of a Llama check; without one, the plan's [mesh] or dp=2,tp=2."""
    from twinspec.plan import choose_mesh

    if args.mesh and len(args.mesh) > 1:
        raise ValueError(f"{what} takes one --mesh, got {len(args.mesh)}: verify the meshes one by one")
    return choose_mesh(args.mesh[0] if args.mesh else None, plan)


def _cases(args: argparse.Namespace, plan) -> list:
    from bridge.crosscheck import VerifyCase
    from twinspec.plan import DEFAULT_PLAN, choose_mesh

    hf_only = [f"--{name.replace('_', '-')}" for name in HF_DEFAULTS if getattr(args, name) is not None]
    if hf_only:
        raise ValueError(f"{', '.join(hf_only)}: options of --model llama --hf or --plan, not of the built-in stacks")
    recipes = _recipes(args.recipe or "current")
    layers, hidden, steps = (
        STACK_DEFAULTS[n] if getattr(args, n) is None else getattr(args, n) for n in STACK_DEFAULTS
    )
    placement = DEFAULT_PLAN if plan is None else plan
    meshes = [choose_mesh(text, placement) for text in args.mesh or [None]]
    if len({mesh.world_size for mesh in meshes}) > 1:
        raise ValueError(f"meshes {[str(m) for m in meshes]} need different process counts; verify them one by one")
    if plan is None and len({mesh.tp > 1 for mesh in meshes}) > 1:
        raise ValueError(
            f"meshes {[str(m) for m in meshes]}: some have tp, some not (a TP mesh runs the sharded check, the others "
            "bridge.compare); verify them one by one"
        )
    cases = [VerifyCase(args.model, layers, hidden, mesh, recipes, steps, placement) for mesh in meshes]
    for case in cases:
        _check_tp_divides(case)
        _check_plan(case)
    return cases


def _check_plan(case) -> None:
    """The plan against the torch twin (on meta) and the mesh: ValueError naming the rule, before processes start."""
    from bridge.twins import build_torch
    from torchside.parallel.plan import resolve

    resolve(build_torch(case.spec), case.plan, case.mesh)


def _check_tp_divides(case) -> None:
    """TP splits the ffn (column fc1, row fc2) and a transformer's heads: check here, before processes start."""
    from bridge.twins import HEAD_DIM

    tp = case.mesh.tp
    split = {f"the ffn size 4 x --hidden = {case.spec.ffn}": case.spec.ffn}
    if case.model == "transformer":
        split[f"the {case.hidden // HEAD_DIM} heads (--hidden / {HEAD_DIM})"] = case.hidden // HEAD_DIM
    for what, size in split.items():
        if size % tp:
            raise ValueError(
                f"--mesh {case.mesh}: tp={tp} does not divide {what}; pick a tp that divides it or another --hidden"
            )
