"""Rotary position embeddings (RoPE), torchside.modules.rotary's twin: non-interleaved halves.

Shape legend: S sequence, B batch, N heads, H head dim, R rotated dims (R <= H, even).

`RotaryPositionEmbedding(H)(S)` gives the angles `freqs_S11R` [S, 1, 1, R], fp32: position p times
`rotary_base ** (-2i / R)` for i < R/2, the R/2 angles written twice. `apply_rotary_pos_emb` rotates
the pair of channels (i, i + R/2) of every head by its angle and leaves channels R.. H unchanged,
in fp32, rounded once to the input's dtype. No variables (torch keeps `inv_freq` as a
non-persistent buffer: nothing for the bridge to map).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx
from jax import Array

from jaxside.modules.config import check_size
from jaxside.modules.transformer_config import QKV_FORMATS, check_choice


class RotaryPositionEmbedding(nnx.Module):
    """The rotary angles of positions offset .. offset + S - 1 (see the module docstring)."""

    def __init__(self, dim: int, rotary_percent: float = 1.0, rotary_base: float = 10000.0) -> None:
        dim = check_size("RotaryPositionEmbedding", "dim", dim)
        percent = rotary_percent
        if isinstance(percent, bool) or not isinstance(percent, int | float) or not 0 < percent <= 1:
            raise ValueError(f"RotaryPositionEmbedding(rotary_percent={rotary_percent!r}): pass a float in (0, 1]")
        rotary_dim = int(dim * rotary_percent)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"RotaryPositionEmbedding(dim={dim}, rotary_percent={rotary_percent}) rotates {rotary_dim} "
                "channels; that must be an even number >= 2: change dim or rotary_percent"
            )
        if isinstance(rotary_base, bool) or not isinstance(rotary_base, int | float) or rotary_base <= 1:
            raise ValueError(f"RotaryPositionEmbedding(rotary_base={rotary_base!r}): pass a float > 1, e.g. 10000.0")
        self.rotary_dim, self.rotary_base = rotary_dim, float(rotary_base)

    def inv_freq(self) -> Array:
        """[R/2] fp32: rotary_base ** (-2i / R), torch's `inv_freq` buffer (a subclass may rescale it)."""
        exponents = jnp.arange(0, self.rotary_dim, 2, dtype=jnp.float32) / jnp.float32(self.rotary_dim)
        return jnp.float32(self.rotary_base) ** -exponents

    def __call__(self, max_seq_len: int, offset: int = 0) -> Array:
        """freqs [max_seq_len, 1, 1, R] (fp32) for positions offset, offset + 1, ..."""
        check_size("RotaryPositionEmbedding", "max_seq_len", max_seq_len)
        positions = jnp.arange(offset, offset + max_seq_len, dtype=jnp.float32)
        angles_SR2 = jnp.outer(positions, self.inv_freq())
        return jnp.concatenate([angles_SR2, angles_SR2], axis=-1)[:, None, None, :]


def apply_rotary_pos_emb(t, freqs, tensor_format: str = "sbhd") -> Array:
    """Rotate t ([S, B, N, H] for "sbhd", [B, S, N, H] for "bshd") by freqs [>= S, 1, 1, R]."""
    check_choice("apply_rotary_pos_emb", "tensor_format", tensor_format, QKV_FORMATS)
    seq = t.shape[0] if tensor_format == "sbhd" else t.shape[1]
    if freqs.ndim != 4 or freqs.shape[1:3] != (1, 1) or freqs.shape[0] < seq or freqs.shape[-1] > t.shape[-1]:
        raise ValueError(
            f"freqs must be [S >= {seq}, 1, 1, R <= {t.shape[-1]}] (RotaryPositionEmbedding's output) for t "
            f"{list(t.shape)} in {tensor_format!r}, got {list(freqs.shape)}"
        )
    rotary_dim = freqs.shape[-1]
    angles = freqs[:seq].astype(jnp.float32)
    if tensor_format == "bshd":
        angles = angles.transpose(1, 0, 2, 3)  # [1, S, 1, R]
    rotated, passed = t[..., :rotary_dim].astype(jnp.float32), t[..., rotary_dim:]
    first, second = jnp.split(rotated, 2, axis=-1)
    turned = jnp.concatenate([-second, first], axis=-1)  # the pair (a, b) -> (-b, a): a rotation by 90 degrees
    out = rotated * jnp.cos(angles) + turned * jnp.sin(angles)
    return jnp.concatenate([out.astype(t.dtype), passed], axis=-1)
