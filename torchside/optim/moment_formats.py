"""How FusedAdam keeps Adam moments between steps: fp32, bf16, or scaled fp16 / FP8 E4M3.

fp32 and bf16 moments are read and written by the kernel directly. The scaled formats carry one
fp32 `scale_inv` per tensor (per local shard of a DTensor): `value = stored * scale_inv`.

`scale_inv` is the smallest power of two, at least 2**-126, with `amax / scale_inv <= max` of the
format (65504 for fp16, 448 for E4M3); 1 when the tensor is all zeros or holds inf/NaN. A power of
two makes the scaling exact, so only the cast rounds (to nearest even; E4M3 clamps to +-448 first,
so a moment never overflows into NaN). A scaled moment needs the amax of its new values, known only
after the update, so the optimizer decodes it to fp32 for the kernel and encodes it again after.

exp_avg_sq (= EMA of g^2) spans twice the binades of g, more than E4M3's ~2^17 range above its
smallest subnormal: small entries flushed to 0 would turn into updates of size m / eps. So scaled
formats store its square root (`root=True`), whose range is that of g.

Measured error (tests/torchside/test_fused_adam.py asserts about twice these): parameters after 50
AdamW steps (lr 1e-3) with both moments in the format, distance to the fp32-moment run relative
to the fp32 run's total update: bf16 3e-3, fp16 5e-4, E4M3 1e-1 (E4M3 exp_avg alone 4e-2; E4M3
exp_avg_sq stored without the root: 2.1, i.e. useless).
"""

from __future__ import annotations

import torch

MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_SCALED_MAX = {torch.float16: 65504.0, torch.float8_e4m3fn: 448.0}
_MIN_EXPONENT = -126  # scale_inv stays a normal fp32 number


def check_moment_dtype(dtype: torch.dtype, name: str) -> None:
    """Raise a TypeError naming the supported dtypes when `dtype` is not one."""
    if dtype not in MOMENT_DTYPES:
        names = ", ".join(str(d) for d in MOMENT_DTYPES)
        hint = " (FP8 E4M3 is torch.float8_e4m3fn)" if dtype == torch.uint8 else ""
        raise TypeError(f"{name}={dtype} is not supported{hint}; use one of {names}")


def is_scaled(dtype: torch.dtype) -> bool:
    """True for formats stored with a per-tensor scale (fp16, FP8 E4M3)."""
    return dtype in _SCALED_MAX


def encode(values: torch.Tensor, dtype: torch.dtype, *, root: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 values -> (stored tensor in `dtype`, scale_inv or None). fp32 values come back as they are.

    `root`: store the square root (for exp_avg_sq, which is >= 0) when the format is scaled.
    """
    if not is_scaled(dtype):
        return values.to(dtype).contiguous(), None
    values = values.sqrt() if root else values
    scale_inv = _scale_inv(values, _SCALED_MAX[dtype])
    return _cast(values, scale_inv, dtype), scale_inv


def decode(stored: torch.Tensor, scale_inv: torch.Tensor | None, *, root: bool) -> torch.Tensor:
    """Stored moment -> fp32 values (the stored tensor itself when it is already fp32)."""
    if scale_inv is None:
        return stored.float()
    values = stored.float() * scale_inv
    return values * values if root else values


def encode_into(stored: torch.Tensor, scale_inv: torch.Tensor, values: torch.Tensor, *, root: bool) -> None:
    """Re-encode fp32 `values` into an existing scaled moment and its scale_inv, in place."""
    new_stored, new_scale_inv = encode(values, stored.dtype, root=root)
    scale_inv.copy_(new_scale_inv)
    stored.copy_(new_stored)


def _scale_inv(values: torch.Tensor, fmax: float) -> torch.Tensor:
    if values.numel() == 0:
        return torch.ones((), dtype=torch.float32, device=values.device)
    amax = values.abs().amax().float()
    exponent = torch.ceil(torch.log2(amax / fmax)).clamp(min=_MIN_EXPONENT)
    usable = torch.isfinite(amax) & (amax > 0)
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(amax))


def _cast(values: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    fmax = _SCALED_MAX[dtype]
    return (values / scale_inv).clamp(-fmax, fmax).to(dtype)
