"""Comparison of traces: first divergence, likely cause, declared known divergences."""

from fpemu.compare.diff import (DIVERGED, KNOWN, MATCH, SKIPPED, Divergence, Verdict, compare_traces,
                                ulp_distance, ulp_distance_f32)

__all__ = ["DIVERGED", "KNOWN", "MATCH", "SKIPPED", "Divergence", "Verdict", "compare_traces",
           "ulp_distance", "ulp_distance_f32"]
