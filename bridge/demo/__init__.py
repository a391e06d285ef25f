"""`shardbridge demo` end to end: train under FP8 on FSDP2 x TP, checkpoint, reload elsewhere, cross into JAX.

Stages (each check is one row of the final table, bridge.demo.report):

1. dp x tp co-located torch+JAX processes (bridge.runtime.launch; one per GPU, or CPU processes):
   the tiny Llama of our TransformerLayers trains `steps` steps under the recipe with FusedAdam on the
   synthetic corpus, saves a DCP checkpoint asynchronously, and meanwhile moves its shards into the
   full JAX Llama twin on the same devices: layouts compared, and the logits of the whole model on
   one unseen batch, the twin sharded on the JAX mesh (bridge.demo.train, bridge.demo.jax_side);
2. reload_dp processes (another topology, FSDP2 only) load the checkpoint; every parameter must
   equal the trained one bit for bit (bridge.demo.checkpoint);
3. this process converts the checkpoint to Orbax (bridge.convert) and restores it with
   jaxside.checkpoint; again bit for bit.

Writes into `out`: report.json, layouts.png, loss.png, and the checkpoints dcp/ and orbax/.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bridge.demo.options import DemoOptions
from bridge.demo.report import LOSS_PLOT_NAME, Check, DemoReport, plot_losses

LOSS_DROP = 0.95  # the last step's loss must be at most this fraction of the first's: the model learns


def check_input(options: DemoOptions) -> None:
    """The tiny Llama on the training mesh, before any process starts: `verify --plan`'s check (bridge.plan_check).

    The modules refuse what TP cannot split (key/value heads, the ffn) and the twin's shardings what JAX cannot:
    ValueError naming --dp/--tp and the fix.
    """
    from bridge import plan_check
    from twinspec.mesh import MeshShape
    from twinspec.plan import DEFAULT_PLAN

    mesh = MeshShape(dp_shard=options.dp, tp=options.tp)
    case = plan_check.PlanCase(
        DEFAULT_PLAN, mesh, (options.recipe,), batch_size=options.batch_size, seq_len=options.seq_len, name="demo"
    )
    try:
        plan_check.check_input(case)
    except ValueError as error:
        raise ValueError(f"--dp {options.dp} --tp {options.tp}: {error}") from error


def run_demo(options: DemoOptions, status: Callable[[str], Any] = print) -> DemoReport:
    """All stages (module docstring); the report, also written to out/report.json. Call check_input first."""
    import torch

    from bridge import runtime
    from bridge.demo import checkpoint, jax_side, train  # these load torch: here, not on `import bridge.demo`

    processes = max(options.world_size, options.reload_dp)
    device, fallback = runtime.choose_device_type(options.device, processes, torch.cuda.device_count())
    if fallback:
        status(fallback)
    out = Path(options.out).absolute()
    for stale in (train.CHECKPOINT_DIR, "orbax"):  # the demo's own checkpoints of an earlier run
        shutil.rmtree(out / stale, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    report = DemoReport(options=dataclasses.asdict(options))

    status(f"training on {options.world_size} processes (FSDP2 dp={options.dp} x TP tp={options.tp}), then JAX")
    started = time.perf_counter()
    trained = runtime.launch(train.train_save_check, options.world_size, options, str(out), device_type=device)[0]
    report.timings["stage 1 wall (launch, train, save, JAX)"] = time.perf_counter() - started
    report.timings.update(trained["timings"])
    report.losses = trained["losses"]
    _training_checks(report, trained, options)

    status(f"reloading the checkpoint on {options.reload_dp} processes (FSDP2 dp={options.reload_dp}, no TP)")
    started = time.perf_counter()
    reloaded = runtime.launch(
        checkpoint.reload, options.reload_dp, trained["checkpoint"], options.reload_dp, options.lr,
        device_type=device,
    )[0]  # fmt: skip
    report.timings["stage 2 wall (launch, load)"] = time.perf_counter() - started
    differ = checkpoint.mismatches(trained["reference"], reloaded["parameters"])
    report.checks.append(Check(
        f"DCP reload on FSDP2 {options.reload_dp}: bitwise", len(differ), 0, "tensors differ",
        reloaded["seconds"], f"step {reloaded['step']}, {len(trained['reference'])} params + "
        f"{reloaded['optimizer_states']} optimizer states",
    ))  # fmt: skip

    status("converting the checkpoint to Orbax and restoring it in JAX")
    orbax = checkpoint.orbax_round_trip(trained["checkpoint"], out, options.steps, trained["reference"])
    report.checks.append(Check("DCP -> Orbax: CRC32 read back", orbax["checksums_differ"], 0, "tensors differ",
                               orbax["convert_seconds"], f"{orbax['tensors']} tensors"))  # fmt: skip
    report.checks.append(Check("Orbax restore in JAX: bitwise", len(orbax["differ"]), 0, "tensors differ",
                               orbax["restore_seconds"], "kernel [in, out] vs weight [out, in]"))  # fmt: skip

    report.files = {
        "layouts": str(out / jax_side.LAYOUT_PNG),
        "loss": str(plot_losses(report.losses, trained["loss_floor"], out / LOSS_PLOT_NAME, options.recipe)),
        "checkpoint": trained["checkpoint"],
        "orbax": str(out / "orbax"),
    }
    report.write(out)
    return report


def _training_checks(report: DemoReport, trained: dict, options: DemoOptions) -> None:
    losses, timings = trained["losses"], trained["timings"]
    report.checks.append(Check(
        f"training {options.recipe}, FSDP2 {options.dp} x TP {options.tp}: loss falls", losses[-1] / losses[0],
        LOSS_DROP, "last / first", timings["train"],
        f"{losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps (floor {trained['loss_floor']:.3f})",
    ))  # fmt: skip
    layouts = trained["layouts"]
    report.checks.append(Check(
        "layouts: torch DTensor = JAX NamedSharding", len(layouts["mismatched"]), 0, "params differ",
        timings["JAX layouts + forward"], f"{layouts['parameters']} params, whole model",
    ))  # fmt: skip
    transfer = trained["transfer"]
    report.checks.append(Check(
        "shards moved into JAX: bitwise", len(transfer["differ"]), 0, "params differ",
        timings["JAX layouts + forward"], "DLPack + relayout, each process's shard",
    ))  # fmt: skip
    forward = trained["forward"]
    report.checks.append(Check(
        "forward JAX vs torch: logits", forward["relative"], trained["forward_tolerance"], "rel. error",
        timings["JAX layouts + forward"], f"whole model, sharded; max abs {forward['max_abs']:.2e}",
    ))  # fmt: skip


__all__ = ["LOSS_DROP", "check_input", "run_demo"]
