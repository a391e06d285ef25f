"""Float64 models of TransformerEngine's own rules, where ours follow them (numpy only: usable without torch)."""

from __future__ import annotations

import math

import numpy as np


def transformer_engine_e8m0(amax: float, fmax: float) -> int:
    """TransformerEngine's float_to_e8m0 (non-Blackwell path) of the fp32 ratio amax * fp32(1/fmax), in float64."""
    ratio = float(np.float32(amax) * np.float32(1.0 / fmax))
    if math.isnan(ratio):
        return 0xFF
    if math.isinf(ratio):
        return 0xFE
    if ratio <= 2.0**-127:  # zero, or a subnormal ratio with at most the top mantissa bit set
        return 0
    return max(1, math.ceil(math.log2(ratio)) + 127)
