"""Comparison of traces: a golden with an observed one (first divergence, likely cause, declared
known divergences), and any two traces (what differs, and whether it matters)."""

from fpemu.compare.changes import (IDENTICAL, NUMERICS, TRAJECTORY, FieldDiff, TraceChanges, ValueChange,
                                   trace_changes)
from fpemu.compare.verdict import compare_traces
from fpemu.compare.diff import (DIVERGED, KNOWN, MATCH, SKIPPED, Divergence, Verdict,
                                ulp_distance, ulp_distance_f32)

__all__ = ["DIVERGED", "KNOWN", "MATCH", "SKIPPED", "Divergence", "Verdict", "compare_traces",
           "ulp_distance", "ulp_distance_f32", "IDENTICAL", "NUMERICS", "TRAJECTORY", "FieldDiff",
           "TraceChanges", "ValueChange", "trace_changes"]
