"""Builds a ScalerTrace from what an adapter observed on a real implementation."""

import numpy as np

from fpemu.scalers.profiles import get_profile
from fpemu.scalers.simulate import ScalerTrace


def observed_trace(name, params, overflows, scales, applied, counters, final_scale,
                   update_ratio=None) -> ScalerTrace:
    """``counters`` None: the implementation does not expose its growth counter."""
    return ScalerTrace(
        profile=name, params={**get_profile(name).defaults, **params}, scales=[float(s) for s in scales],
        skipped=[i for i, ok in enumerate(applied) if not ok], final_scale=float(final_scale),
        overflow=np.array(overflows, dtype=bool), applied=np.array(applied, dtype=bool),
        growth_counter=None if counters is None else np.array(counters, dtype=np.int64), hysteresis=None,
        events=[], update_ratio=update_ratio)
