"""What this machine offers shardbridge: framework versions, devices, where kernels run."""

from __future__ import annotations

import importlib
import importlib.metadata
from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    name: str
    value: str


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch_devices() -> str:
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} CUDA: " + ", ".join(names)
    return "cpu only"


def _jax_devices() -> str:
    import jax

    devices = jax.devices()
    return f"{len(devices)} {devices[0].platform}: " + ", ".join(str(d) for d in devices[:4]) + (
        ", ..." if len(devices) > 4 else ""
    )


def _safely(probe) -> str:
    try:
        return probe()
    except Exception as error:  # a broken install is what `env` exists to show
        return f"error: {type(error).__name__}: {error}"


def collect() -> list[Row]:
    """The rows `shardbridge env` prints."""
    from fp8kernels import _backend

    rows = [Row(name, _version(name)) for name in ("torch", "triton", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint")]
    rows.append(Row("torch devices", _safely(_torch_devices)))
    rows.append(Row("jax devices", _safely(_jax_devices)))
    rows.append(Row("triton kernels", _safely(_backend.describe)))
    return rows
