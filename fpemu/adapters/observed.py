"""Builds a ScalerTrace from what an adapter observed on a real implementation."""

import numpy as np

from fpemu.scalers.profiles import get_profile
from fpemu.scalers.simulate import ScalerTrace


def observed_trace(name, params, overflows, scales, applied, counters, final_scale,
                   update_ratio=None, read_back=None) -> ScalerTrace:
    """``counters`` None: the implementation does not expose its growth counter.  ``read_back``: the
    parameters as the real object holds them, which the trace keeps instead of the profile's
    defaults completed with what was passed (a release without a parameter must not claim it)."""
    kept = read_back if read_back is not None else {**get_profile(name).defaults, **params}
    return ScalerTrace(
        profile=name, params=kept, scales=[float(s) for s in scales],
        skipped=[i for i, ok in enumerate(applied) if not ok], final_scale=float(final_scale),
        overflow=np.array(overflows, dtype=bool), applied=np.array(applied, dtype=bool),
        growth_counter=None if counters is None else np.array(counters, dtype=np.int64), hysteresis=None,
        events=[], update_ratio=update_ratio)
