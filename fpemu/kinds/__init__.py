"""Scenario kinds: each one package implementing :class:`~fpemu.kinds.protocol.ScenarioKind`, listed once in
:data:`KINDS`.

The spec loader (fpemu.specs) parses a spec with the kind its tables name, the harness runs a scenario's
reference model and real implementations through its kind, and the comparison asks the kinds why two
traces differ (:func:`explain`).  Adding a kind is its package and one line here (docs/kinds.md).
"""

from __future__ import annotations

from typing import Optional

from fpemu.kinds import blocks, fp8_training, ranks, recipe, scaler, step
from fpemu.kinds.protocol import ScenarioKind
from fpemu.kinds.scenario import ExpectedDivergence, Implementation, ScenarioBase
from fpemu.kinds.schema import SpecError, parse_toml
from fpemu.traces import Trace, read_trace
from fpemu.traces.format import TraceError
from fpemu.traces.fields import FIELDS, fields_recorded_by

# In the order a spec's tables are read: the first kind whose table a spec has is its kind; a spec
# with none of them is a scaler spec (the kind without a table, last).
KINDS = (ranks.KIND, recipe.KIND, fp8_training.KIND, blocks.KIND, step.KIND, scaler.KIND)


def kind_of(scenario: ScenarioBase) -> ScenarioKind:
    """The kind whose parser built ``scenario``."""
    for kind in KINDS:
        if isinstance(scenario, kind.scenario):
            return kind
    raise TypeError(f"{type(scenario).__name__} is not the scenario of a kind in fpemu.kinds.KINDS")


def kind_of_spec(raw: dict) -> ScenarioKind:
    """The kind of a spec's TOML table ``raw``: the first whose table it has, else the kind without one."""
    return next(kind for kind in KINDS if kind.table is None or kind.table in raw)


def kind_of_trace(trace: Trace) -> Optional[ScenarioKind]:
    """The kind of the spec ``trace`` was made from (the spec text its metadata holds); None for a trace made
    from no spec (a recorded or an emulated run keeps a description or its model file as its text)."""
    spec = trace.metadata.get("spec") or {}
    try:
        return kind_of_spec(parse_toml(spec.get("text", ""), spec.get("path") or "the trace's spec"))
    except SpecError:
        return None


def trace_kind_problem(trace: Trace) -> Optional[str]:
    """Where a trace's profile is none its spec's kind writes (any kind's, for a trace made from no spec) or its
    steps hold a field the kind never records (metadata and steps of two traces, sealed again): what is
    wrong, naming the field; None where they agree.

    Example:
      >>> from fpemu.traces.layout import trace_metadata
      >>> import types
      >>> spec = types.SimpleNamespace(name="s", path="", sha256="0", text="[recipe]")
      >>> meta = trace_metadata(spec, "reference", "te_delayed", {}, {}, "cpu")
      >>> trace_kind_problem(Trace(meta, ({"loss": 1.0},), {}))
      'steps[0].loss: a recipe spec never records it (metadata.spec.text is a recipe spec)'
      >>> trace_kind_problem(Trace(trace_metadata(spec, "reference", "torch", {}, {}, "cpu"), (), {}))[:60]
      "metadata.profile: expected a recipe trace's profile (te_curr"
    """
    kind = kind_of_trace(trace)
    profile = trace.metadata.get("profile")
    known = kind.profiles if kind else frozenset().union(*(k.profiles for k in KINDS))
    if profile is not None and profile not in known:
        whose = f"a {kind.name} trace's" if kind else "an fpemu"
        return f"metadata.profile: expected {whose} profile ({', '.join(sorted(known))}), got {profile!r}"
    if kind is None or not trace.steps:
        return None
    records = set(kind.recorded_fields)
    stray = next((key for key in trace.steps[0] if key in FIELDS and not records & set(FIELDS[key].recorded_by)), None)
    return (None if stray is None else
            f"steps[0].{stray}: a {kind.name} spec never records it (metadata.spec.text is a {kind.name} spec)")


def read_trace_checked(path) -> Trace:
    """:func:`fpemu.traces.read_trace`, then :func:`trace_kind_problem`: a trace whose steps are not of its spec's
    kind is refused (TraceError naming the file and the field), as the reader refuses any other wrong trace."""
    trace = read_trace(path)
    problem = trace_kind_problem(trace)
    if problem:
        raise TraceError(f"{path}: not a valid trace: {problem}")
    return trace


def spec_tables() -> set:
    """Every top-level table some kind's specs may have."""
    return {table for kind in KINDS for table in (kind.table, *kind.other_tables) if table}


def reference_trace(scenario: ScenarioBase) -> Trace:
    """The golden trace: the scenario run on fpemu's reference model."""
    kind = kind_of(scenario)
    if kind.reference is None:
        raise TypeError(f"a {kind.name} scenario's traces are made by fpemu.harness.ranks (its cases run on "
                        "several processes)")
    return kind.reference(scenario)


def record_trace(scenario: ScenarioBase, impl: Implementation) -> Trace:
    """Drive the real implementation ``impl`` through the scenario."""
    kind = kind_of(scenario)
    if kind.record is None:
        raise TypeError(f"a {kind.name} scenario's traces are made by fpemu.harness.ranks (its cases run on "
                        "several processes)")
    return kind.record(scenario, impl)


def explain(field: str, step: int, golden: Trace, observed: Trace):
    """The reading of the kind that records ``field`` of why ``observed`` first differs from ``golden`` there,
    or None where no kind has its own (the comparison's generic reading then applies)."""
    for kind in KINDS:
        if kind.explain is not None and field in fields_recorded_by(kind.name):
            return kind.explain(field, step, golden, observed)
    return None


__all__ = ["KINDS", "ScenarioKind", "ExpectedDivergence", "Implementation", "ScenarioBase", "kind_of",
           "kind_of_spec", "kind_of_trace", "trace_kind_problem", "read_trace_checked", "spec_tables",
           "reference_trace", "record_trace", "explain"]
