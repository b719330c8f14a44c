"""One bit-for-bit comparison of a real scaler's trace with the model's, for every differential test."""

import numpy as np


def bits32(values):
    return np.asarray(values, dtype=np.float32).view(np.uint32).tolist()


def bits64(values):
    return np.array(values, dtype=np.float64).view(np.uint64).tolist()


def assert_same_trace(real, model):
    """Every field both traces hold: scales as float64 bit patterns (exact for float32 scales and for
    the Python floats of DeepSpeed and apex), skips, counters, hysteresis where the real one has it,
    where training stopped, and the final scale."""
    assert real.profile == model.profile
    assert bits64(real.scales) == bits64(model.scales), (real.scales, model.scales)
    assert real.applied.tolist() == model.applied.tolist()
    assert real.growth_counter.tolist() == model.growth_counter.tolist()
    if real.hysteresis is not None:
        assert real.hysteresis == model.hysteresis
    assert real.stopped_at == model.stopped_at, (real.events, model.events)
    assert bits64([real.final_scale]) == bits64([model.final_scale])


def same_floats(a, b) -> bool:
    """Bit for bit, any NaN equal to any NaN (NaN payloads and signs are not specified)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (a.view(np.uint64) == b.view(np.uint64))))


def fp8_code_mismatches(a, b, fmt) -> int:
    """How many fp8 codes differ, a NaN code equal to any NaN code."""
    import fpemu
    a, b = np.asarray(a, dtype=np.uint8).ravel(), np.asarray(b, dtype=np.uint8).ravel()
    nan_a, nan_b = np.isnan(fpemu.decode(a, fmt)), np.isnan(fpemu.decode(b, fmt))
    return int(np.count_nonzero(~(nan_a & nan_b) & (a != b)))
