"""Where a kernel runs: Triton on CUDA, the Triton interpreter, or the torch reference.

The only place that looks at the device or at TRITON_INTERPRET, and only when called.
"""

from __future__ import annotations

import enum
import functools
import importlib.util
import os

import torch


class Backend(enum.Enum):
    TRITON = "triton"  # compiled Triton on a CUDA device
    INTERPRETER = "interpreter"  # TRITON_INTERPRET=1 on CPU tensors (tests)
    REFERENCE = "reference"  # the pure-torch spec in fp8kernels.reference


def interpreting() -> bool:
    """True when Triton runs its Python interpreter instead of compiling."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(device: torch.device | str) -> Backend:
    """The backend a launch on `device` uses now (TRITON_INTERPRET is read on every call: tests switch it)."""
    if not triton_available():
        return Backend.REFERENCE
    if interpreting():
        return Backend.INTERPRETER
    device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
    return Backend.TRITON if device_type == "cuda" else Backend.REFERENCE


def describe() -> str:
    """One line for `shardbridge env`: where Triton kernels run on this machine."""
    if not triton_available():
        return "reference (triton not installed)"
    if interpreting():
        return "Triton interpreter (TRITON_INTERPRET=1)"
    if torch.cuda.is_available():
        return f"Triton on {torch.cuda.get_device_name()}"
    return "reference (no CUDA device; set TRITON_INTERPRET=1 to run the kernels interpreted)"


def autotune_configs(candidates: list[dict]) -> list:
    """One triton.Config per candidate ({meta-parameter: value, "num_warps": n, optionally "num_stages": s
    and "maxnreg": r, a register cap per thread that trades a few spills for more programs per SM}).

    Under the interpreter only the first candidate: autotuning over several needs a GPU driver.
    """
    import triton

    chosen = candidates[:1] if interpreting() else candidates
    launch_options = ("num_warps", "num_stages", "maxnreg")
    return [
        triton.Config(
            {name: value for name, value in c.items() if name not in launch_options},
            **{name: c[name] for name in launch_options if name in c},
        )
        for c in chosen
    ]


def multiprocessor_count(device: torch.device | str) -> int:
    """Programs that run at once on `device`: its SM count on CUDA, 1 elsewhere (the interpreter runs them in turn)."""
    device = torch.device(device)
    if device.type == "cuda" and not interpreting():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
