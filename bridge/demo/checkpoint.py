"""The demo's checkpoint checks: the DCP checkpoint reloaded on another topology, and converted to Orbax.

Both compare bit for bit with the reference: the trained parameters as full tensors, gathered in the
training processes before the save finished.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch


def mismatches(reference: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor]) -> list[str]:
    """Names whose loaded bytes differ from the reference's (or that are missing)."""
    differ = []
    for name, expected in reference.items():
        got = loaded.get(name)
        same = (
            got is not None
            and got.shape == expected.shape
            and got.dtype == expected.dtype
            and torch.equal(got.contiguous().view(torch.uint8), expected.contiguous().view(torch.uint8))
        )
        if not same:
            differ.append(name)
    return differ


def reload(runtime, checkpoint: str, dp: int, lr: float) -> dict[str, Any]:
    """Load the checkpoint into the tiny Llama on FSDP2 over `dp` ranks (no TP), with its optimizer."""
    from bridge.demo.train import full_parameters
    from torchside import checkpoint as dcp_checkpoint
    from torchside.train import TrainOptions, build_model, build_optimizer

    started = time.perf_counter()
    # Seed 1: another initialization than training's, so the load must replace every value.
    options = TrainOptions(config="tiny", lr=lr, dp=dp, seed=1, device=runtime.device_type)
    model, _ = build_model(options)
    optimizer = build_optimizer(model, options)
    result = dcp_checkpoint.load(checkpoint, model, optimizer)
    seconds = time.perf_counter() - started
    loaded = full_parameters(model)
    states = sum(len(state) for state in optimizer.state.values())
    if runtime.rank != 0:
        return {}
    return {"step": result.step, "parameters": loaded, "optimizer_states": states, "seconds": seconds}


def orbax_round_trip(checkpoint: str, out: Path, step: int, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Convert the DCP step to Orbax (bridge.convert), restore it with jaxside.checkpoint, compare the weights."""
    import jax
    import numpy as np

    from bridge.convert import convert
    from bridge.convert.orbax import nest
    from jaxside import checkpoint as orbax_checkpoint

    started = time.perf_counter()
    target_root = out / "orbax"
    result = convert(checkpoint, "dcp", orbax_checkpoint.step_path(target_root, step), "orbax")
    convert_seconds = time.perf_counter() - started

    started = time.perf_counter()
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    flat = {e.target.key: jax.ShapeDtypeStruct(e.target.shape, np.dtype(e.target.dtype), sharding=device)
            for e in result.plan.entries}  # fmt: skip
    restored = orbax_checkpoint.restore(target_root, step, nest(flat))
    restore_seconds = time.perf_counter() - started

    loaded = {}
    for entry in result.plan.entries:
        if not entry.source.key.startswith("model."):
            continue
        value = torch.from_numpy(np.asarray(_lookup(restored, entry.target.key)).copy())
        loaded[entry.source.key.removeprefix("model.")] = value.t() if entry.transpose else value
    return {
        "checksums_differ": sum(not c.ok for c in result.checksums),
        "tensors": len(result.checksums),
        "differ": mismatches(reference, loaded),
        "convert_seconds": convert_seconds,
        "restore_seconds": restore_seconds,
    }


def _lookup(tree: dict, key: str):
    for part in key.split("."):
        tree = tree[part]
    return tree


__all__ = ["mismatches", "orbax_round_trip", "reload"]
