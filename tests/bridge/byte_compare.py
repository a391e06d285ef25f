"""torch-vs-JAX byte comparison of quantized buffers (fp8kernels.reference against jaxside.quantize), with
messages that name the first differing entries, their inputs and both sides' bytes."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch

import jaxside.quantize as JQ
from fp8kernels import reference as R


def as_jax(x: torch.Tensor) -> jnp.ndarray:
    """The same bit patterns as a jnp array (bf16 travels as uint16)."""
    if x.dtype == torch.bfloat16:
        return jnp.asarray(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return jnp.asarray(x.numpy())


def byte_view(array) -> np.ndarray:
    """uint8 [..., itemsize]: each element's bytes along a new last axis."""
    array = array.contiguous().numpy() if isinstance(array, torch.Tensor) else np.asarray(array)
    return array[..., None].view(np.uint8)


def _element_bytes(array, index) -> str:
    value = np.asarray(array.numpy() if isinstance(array, torch.Tensor) else array)[index]
    return f"{value.tobytes().hex()} ({value})"


def _input_window(x2d: np.ndarray, name: str, index: tuple, q: R.Quantized) -> str:
    """The input elements behind one entry of a buffer (the block behind a scale: its amax)."""
    columnwise = name.startswith("columnwise")
    operand = x2d.T if columnwise else x2d
    if name.endswith("amax"):
        return f"operand amax {np.nanmax(np.abs(operand)) if operand.size else 0.0}"
    i, j = index if len(index) == 2 else (0, 0)
    if name.endswith("scale_inv"):
        block = R.SCHEME_BLOCKS[q.scheme] or operand.shape
        window = operand[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
        return f"block amax {np.abs(window).max()} (NaN: {np.isnan(window).any()})"
    if q.fmt == "e2m1":
        return f"inputs {operand[i, 2 * j : 2 * j + 2]}" + (
            " (before the Hadamard transform)" if columnwise and q.hadamard else ""
        )
    return f"input {operand[i, j]!r}"


def assert_same_bytes(expected: R.Quantized, got: JQ.Quantized, x: torch.Tensor, label: str) -> None:
    """Every buffer identical; otherwise name the first differing entries with inputs and both bytes."""
    x2d = x.float().reshape(-1, x.shape[-1]).numpy()
    problems = []
    for name in JQ.BUFFERS:
        want, have = getattr(expected, name), getattr(got, name)
        if want is None or have is None:
            if (want is None) != (have is None):
                problems.append(
                    f"{name}: torch {'None' if want is None else 'set'}, jax {'None' if have is None else 'set'}"
                )
            continue
        want_bytes, have_bytes = byte_view(want), byte_view(have)
        if want_bytes.shape != have_bytes.shape:
            problems.append(f"{name}: shape {tuple(want.shape)} vs {tuple(np.shape(have))}")
            continue
        differ = (want_bytes != have_bytes).any(axis=-1)
        if differ.any():
            first = [tuple(int(i) for i in index) for index in np.argwhere(differ)[:3]]
            lines = [
                f"  {index}: torch {_element_bytes(want, index)} jax {_element_bytes(have, index)}; "
                f"{_input_window(x2d, name, index, expected)}"
                for index in first
            ]
            problems.append(f"{name}: {int(differ.sum())} of {differ.size} differ, first:\n" + "\n".join(lines))
    assert not problems, f"{label}:\n" + "\n".join(problems)
