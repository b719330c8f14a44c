"""The recorded-trace schema (fpemu.traces.recorded): records round-trip exactly through a trace file,
bad records are refused naming the step and key, and the format thresholds classify as a cast does."""

import math

import ml_dtypes
import numpy as np
import pytest

from fpemu.formats import get_format, quantize
from fpemu.traces import dumps, loads
from fpemu.traces.fields import FIELDS
from fpemu.traces.format import TraceError
from fpemu.traces.binades import CODES, numpy_codes
from fpemu.traces.recorded import (GroupStats, RecordedStep, RecorderSettings, ShadowHistogram, ShadowStats,
                                   format_thresholds,
                                   from_step_record, recorded_metadata, recorded_steps, recorded_trace,
                                   recorder_settings, to_step_record)

DTYPES = {"fp16": np.float16, "bf16": ml_dtypes.bfloat16, "fp8_e5m2": ml_dtypes.float8_e5m2}


def _edge_values() -> np.ndarray:
    """Gradients on and beside every format's rounding edges at many power-of-two scales (ties, powers of
    two, their float32 neighbours, float32 subnormals), and random ones from 2^-149 to 2^20."""
    edges = np.array([t / 2.0 ** s for fmt in ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp4_e2m1fn")
                      for t in format_thresholds(fmt)[:2] for s in range(-12, 40)], np.float32)
    edges = edges[edges > 0]
    rng = np.random.default_rng(0)
    spread = (rng.standard_normal(20000) * np.exp2(rng.uniform(-150, 20, 20000))).astype(np.float32)
    return np.concatenate([edges, -edges, np.nextafter(edges, np.float32(0)), np.nextafter(edges, np.float32(1)),
                           spread, np.zeros(3, np.float32), np.array([np.inf, np.nan], np.float32)])


EDGE_VALUES = _edge_values()


def _histogram(values, elements=None):
    return ShadowHistogram.from_counts(values.size if elements is None else elements,
                                       np.bincount(numpy_codes(values), minlength=CODES))


def _step(index, **changes):
    stats = {"h.0": GroupStats.from_counts(10, 3, 1, 0, 0, 65504.0, 2.0 ** -24),
             "lm_head": GroupStats.from_counts(7, 0, 0, 1, 1, math.inf, 0.1)}
    fields = dict(step=index, scale=2.0 ** 16 * 1.5, overflow=index == 1, applied=index != 1, growth_counter=index,
                  loss=1 / 3, grad_norm=math.nan if index == 1 else 0.1, lr=1e-4, grad_stats=stats,
                  shadow={"h.0": ShadowStats(0.25, 1 / 7)} if index == 0 else None,
                  shadow_histogram={"h.0": _histogram(EDGE_VALUES)} if index == 0 else None)
    return RecordedStep(**{**fields, **changes})


def _trace(steps):
    metadata = recorded_metadata(framework="torch", name="run", device="cpu", profile="torch",
                                 params={"init_scale": 65536.0}, packages={"torch": "x"},
                                 settings=RecorderSettings(groups="module", shadow_every=4))
    return recorded_trace(metadata, steps, final_scale=32768.0, examples=24, scheduler_steps=3)


def test_steps_round_trip_bit_for_bit_through_a_trace_file():
    steps = [_step(0), _step(1), _step(2, growth_counter=None, loss=None, grad_stats={})]
    trace = loads(dumps(_trace(steps)))
    back = recorded_steps(trace)
    assert [to_step_record(step) for step in back] == [to_step_record(step) for step in steps]  # hex forms
    assert back[0] == steps[0] and math.isnan(back[1].grad_norm) and back[1].grad_stats == steps[1].grad_stats
    assert trace.summary["attempts"] == 3 and trace.summary["skipped_updates"] == 1
    assert trace.summary["examples"] == 24 and trace.summary["final_scale_hex"] == (32768.0).hex()
    assert trace.metadata["source"] == "recorded_run" and trace.metadata["framework"] == "torch"
    assert recorder_settings(trace) == RecorderSettings(groups="module", shadow_every=4)
    assert "host" in trace.metadata and trace.implementation == "torch@cpu"


def test_every_recorded_field_is_in_the_fields_table():
    record = to_step_record(_step(0))
    recorded = {name for name in record if not name.endswith("_hex") and name != "step"}
    assert recorded <= {name for name, field in FIELDS.items() if "recorded" in field.recorded_by}


def test_a_malformed_record_names_the_step_and_key():
    record = to_step_record(_step(0))
    del record["grad_stats"]["h.0"]["max_abs_hex"], record["grad_stats"]["h.0"]["max_abs"]
    with pytest.raises(TraceError, match=r"steps\[0\]\.grad_stats\.h\.0: missing 'max_abs'"):
        from_step_record(record)
    with pytest.raises(TraceError, match=r"steps\[0\]\.overflow: expected bool"):
        from_step_record({**to_step_record(_step(0)), "overflow": 1})


def test_a_reference_trace_is_not_a_recorded_run():
    trace = _trace([_step(0)])
    other = type(trace)({**trace.metadata, "source": None}, trace.steps, trace.summary)
    with pytest.raises(TraceError, match="not a recorded run"):
        recorded_steps(other)


def test_settings_refuse_bad_values():
    with pytest.raises(ValueError, match="shadow_every"):
        RecorderSettings(shadow_every=-1)
    with pytest.raises(ValueError, match="unknown format"):
        RecorderSettings(compute_format="fp13")


@pytest.mark.parametrize("fmt", sorted(DTYPES))
def test_thresholds_classify_exactly_as_the_cast_rounds(fmt):
    zero_at_most, normal_from, overflow_from = format_thresholds(fmt)
    dtype, info = DTYPES[fmt], ml_dtypes.finfo(DTYPES[fmt])
    for edge in (zero_at_most, normal_from, overflow_from):
        assert float(np.float32(edge)) == edge
    below = lambda v: float(np.nextafter(np.float32(v), np.float32(0)))  # noqa: E731
    with np.errstate(over="ignore"):
        cast = lambda v: float(np.float32(v).astype(dtype))  # noqa: E731
        assert cast(zero_at_most) == 0 and cast(np.nextafter(np.float32(zero_at_most), np.float32(1))) > 0
        assert cast(normal_from) == float(info.smallest_normal) and cast(below(normal_from)) < float(info.smallest_normal)
        assert math.isinf(cast(overflow_from)) and cast(below(overflow_from)) == float(info.max)



@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp6_e2m3fn", "fp4_e2m1fn"])
def test_overflow_edge_is_where_the_kernel_overflows(fmt):
    # fp8_e4m3fn's largest finite mantissa is even, so the tie 464 rounds down to 448: a
    # half-ulp formula put the edge at 464 and counted exactly-464 gradients as overflow.
    from fpemu.formats import get_format
    from fpemu.formats.rounding import round_to_format
    overflow_from, fmt = format_thresholds(fmt)[2], get_format(fmt)
    below = np.nextafter(np.float32(overflow_from), np.float32(0))
    assert bool(round_to_format(np.float32([overflow_from]), fmt).overflowed[0])
    assert not bool(round_to_format(np.array([below]), fmt).overflowed[0])
    if fmt == "fp8_e4m3fn":
        assert overflow_from > 464.0 and float(quantize(np.float32([464.0]), fmt)[0]) == 448.0

def test_docstring_examples():
    import doctest

    import fpemu.traces.recorded
    result = doctest.testmod(fpemu.traces.recorded, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_old_records_without_a_shadow_histogram_stay_readable():
    record = to_step_record(_step(0))
    del record["shadow_histogram"]
    step = from_step_record(record)
    assert step.shadow == _step(0).shadow and step.shadow_histogram is None


def test_a_malformed_shadow_histogram_names_the_step_group_and_binade():
    record = to_step_record(_step(0))
    record["shadow_histogram"]["h.0"]["binades"]["-20"] = [1, -2]
    with pytest.raises(TraceError, match=r"steps\[0\]\.shadow_histogram\.h\.0\.binades\.-20: expected"):
        from_step_record(record)


@pytest.mark.parametrize("fmt", ["fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp6_e3m2fn", "fp4_e2m1fn"])
def test_shadow_shares_are_exact_at_power_of_two_scales_and_bounds_elsewhere(fmt):
    """Against fpemu's kernel: every element scaled exactly (float64) and rounded once."""
    histogram = _histogram(EDGE_VALUES, EDGE_VALUES.size + 5)  # 5 elements without a gradient: zeros
    assert histogram.zero == int((EDGE_VALUES == 0).sum()) + 5 and histogram.nonfinite == 2
    finite = EDGE_VALUES[np.isfinite(EDGE_VALUES)].astype(np.float64)
    min_normal = get_format(fmt).min_normal
    for scale in [2.0 ** s for s in range(-30, 60, 7)] + [3.0, 1000.0, 65535.5, 7.7e-7]:
        rounded = np.abs(quantize(finite * scale, fmt))
        under = int(((finite != 0) & (rounded == 0)).sum()) / histogram.elements
        subnormal = int(((rounded > 0) & (rounded < min_normal)).sum()) / histogram.elements
        shares = histogram.shares(scale, fmt)
        if math.frexp(scale)[0] == 0.5:
            assert shares.underflow == (under, under) and shares.subnormal == (subnormal, subnormal), scale
        else:
            assert shares.underflow[0] <= under <= shares.underflow[1], scale
            assert shares.subnormal[0] <= subnormal <= shares.subnormal[1], scale
