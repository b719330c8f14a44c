"""What differs between any two traces, and whether it matters.

:func:`fpemu.compare.compare_traces` judges an implementation against a golden trace (match,
known divergence, diverged).  :func:`trace_changes` describes the difference between *any* two
traces: a reference and a recording, or two recordings (a rerun, an upgrade, a config change).
Besides the first divergence it reports at which steps each field differs and by how much
(float32 ulps for tensor-like fields, relative size for every float field), the overflow verdicts
that flipped, the two summaries (attempts, completed and skipped updates, final scale, stop step),
and the parameters and package versions that differ.  Its verdict ranks trajectory changes (scale,
overflow and skip decisions, the scaler's counters, the summary) above numerics-only ones (loss,
weights, shares).  Every value compares bit for bit, as in :mod:`fpemu.compare.diff`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fpemu.compare.diff import Divergence, bit_equal, first_element, likely_cause, shared_fields, ulp_distance
from fpemu.compare.readings import initial_scale_cause, recorded_cause
from fpemu.errors import FpemuInputError
from fpemu.traces import Trace, decode_value
from fpemu.traces.fields import FIELDS, ULP_FIELDS
from fpemu.traces.format import encode_float
from fpemu.traces.recorded import is_recorded

# Fields whose differences leave the training trajectory (scale, skips) alone: numerics only.
NUMERIC_FIELDS = tuple(name for name, field in FIELDS.items() if not field.trajectory)
LENGTH = "steps"  # the pseudo-field of steps that only one trace has
TRAJECTORY_FIELDS = tuple(name for name in FIELDS if name not in NUMERIC_FIELDS) + (LENGTH,)
SUMMARY_KEYS = ("attempts", "completed_updates", "skipped_updates", "final_scale", "stopped_at")
STEP_LIMIT = 50  # differing steps listed per field (all of them are counted)
IDENTICAL, TRAJECTORY, NUMERICS = "identical", "trajectory changed", "numerics only"
_VERDICT_ITEMS = 6  # clauses in the one-line verdict; the table has the rest


@dataclasses.dataclass(frozen=True)
class FieldDiff:
    """How one step field differs between two traces.

    Attributes:
      field: the field (or ``steps``: the steps that only one trace has).
      count: how many steps it differs at.
      steps: the first :data:`STEP_LIMIT` of those steps.
      max_ulp: the largest float32 ulp distance (tensor-like fields only, else None).
      max_rel: the largest ``|after - before| / |before|`` (float fields only, else None; inf
        where one is 0, inf or NaN and the other is not; 0 for -0 vs +0).
    """

    field: str
    count: int
    steps: tuple
    max_ulp: Optional[int] = None
    max_rel: Optional[float] = None

    @property
    def numeric(self) -> bool:
        """Whether it changes numerics only (loss, weights, shares), not the trajectory."""
        return self.field in NUMERIC_FIELDS

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["steps"] = list(self.steps)
        if self.max_rel is not None:
            out["max_rel"] = encode_float(self.max_rel)
        return out


@dataclasses.dataclass(frozen=True)
class ValueChange:
    """One named value before and after: a summary entry, a parameter or a package version
    (None, shown ``none``: the trace does not record it, or for ``stopped_at`` the run did not stop)."""

    name: str
    before: object
    after: object

    @property
    def changed(self) -> bool:
        return not bit_equal(*map(_as_float_if_mixed, (self.before, self.after), (self.after, self.before)))

    def describe(self) -> str:
        """``growth_interval 2000 -> 40``"""
        return f"{self.name} {_plain(self.before)} -> {_plain(self.after)}"

    def as_dict(self) -> dict:
        out = {"name": self.name, "before": _json(self.before), "after": _json(self.after), "changed": self.changed}
        for side in ("before", "after"):
            if isinstance(getattr(self, side), float):
                out[f"{side}_hex"] = getattr(self, side).hex()
        return out


def _as_float_if_mixed(value, other):
    """An int as a float where the other side is a float: a spec's ``init_scale = 16`` (TOML int) is the
    16.0 a scaler reads back, not a change."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return float(value) if is_int and isinstance(other, float) else value


_SHOWN = 48  # characters of one value in a description (a spec's overflow sequence can be long)


def _plain(value) -> str:
    text = "none" if value is None else repr(value) if isinstance(value, float) else str(value)
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN - 3]}..."


def _json(value):
    return encode_float(value) if isinstance(value, float) else value


def _describe_all(changes) -> str:
    return ", ".join(change.describe() for change in changes)


@dataclasses.dataclass(frozen=True)
class TraceChanges:
    """What differs between two traces (``before`` and ``after``), and whether it matters.

    Attributes:
      before, after: the traces' labels, ``spec / implementation``.
      steps_compared: the steps both traces have.
      steps_differ: of those, the steps where any field differs.
      fields_compared: the step fields both record.
      fields: a :class:`FieldDiff` per field that differs, trajectory fields first (table order).
      summary: every summary entry (:data:`SUMMARY_KEYS`) before and after, changed or not.
      divergence: the first difference (None exactly when the traces are identical); where the
        steps agree and the summaries do not, its field is ``summary.<key>`` at the step count.
      profile: the scaler profiles, when they differ (their parameters are then not compared).
      params: the parameters that differ (same profile).
      packages: the package versions that differ (every package both record; when the
        implementations are the same, also one that only one of them records).
      settings: how the runs were recorded or replayed, where that differs: a recorded run's recorder
        settings (``shadow_every``, ``groups``, ``statistics``), the compute format of a recording or a
        replay, and the file a replay replayed (``replayed <file>``: its sha256).
    """

    before: str
    after: str
    steps_compared: int
    steps_differ: int
    fields_compared: tuple
    fields: tuple
    summary: tuple
    divergence: Optional[Divergence]
    profile: Optional[ValueChange] = None
    params: tuple = ()
    packages: tuple = ()
    settings: tuple = ()

    @property
    def identical(self) -> bool:
        return self.divergence is None

    @property
    def kind(self) -> str:
        """:data:`IDENTICAL`, :data:`TRAJECTORY` (the scale, skips or summary changed) or
        :data:`NUMERICS` (only loss, weights or shares differ)."""
        if self.identical:
            return IDENTICAL
        summary_changed = any(change.changed for change in self.summary)
        return TRAJECTORY if summary_changed or any(not f.numeric for f in self.fields) else NUMERICS

    def field(self, name: str) -> Optional[FieldDiff]:
        """The FieldDiff of ``name``, or None where it does not differ."""
        return next((f for f in self.fields if f.field == name), None)

    @property
    def overflow_flips(self) -> Optional[FieldDiff]:
        """The steps whose overflow verdict flipped (None where none did)."""
        return self.field("overflow")

    def context(self) -> str:
        """What differs besides behaviour: profile, parameters, package versions ('' if nothing)."""
        parts = [f"profiles differ: {self.profile.before} -> {self.profile.after}"] if self.profile else []
        if self.params:
            parts.append(f"parameters differ: {_describe_all(self.params)}")
        if self.settings:
            parts.append(f"recording differs: {_describe_all(self.settings)}")
        if self.packages:
            parts.append(f"packages differ: {_describe_all(self.packages)}")
        return "; ".join(parts)

    def verdict(self) -> str:
        """One line: the kind of change, its most important differences first, and the context.

        Example: ``trajectory changed: overflow flipped at 12 of 80 steps, skipped updates 29 -> 41,
        final scale 65536.0 -> 2048.0, scale at 52 of 80 steps [parameters differ: growth_interval 8 -> 2]``
        """
        if self.identical:
            line = (f"identical: {self.steps_compared} steps agree bit for bit on "
                    f"{', '.join(self.fields_compared) or 'no field'}, and so do the summaries")
        else:
            items = self._items()
            if len(items) > _VERDICT_ITEMS:
                items = items[:_VERDICT_ITEMS] + [f"{len(items) - _VERDICT_ITEMS} more (see the table)"]
            line = f"{self.kind}: {', '.join(items)}"
        context = self.context()
        return f"{line} [{context}]" if context else line

    def _items(self) -> list:
        """The verdict's clauses, ranked: flips, summary, other trajectory fields, numerics."""
        of = f" of {self.steps_compared} steps"
        items = [f"overflow flipped at {self.overflow_flips.count}{of}"] if self.overflow_flips else []
        order = ("skipped_updates", "final_scale", "completed_updates", "attempts", "stopped_at")
        by_name = {change.name: change for change in self.summary}
        items += [ValueChange(name.replace("_", " "), by_name[name].before, by_name[name].after).describe()
                  for name in order if by_name[name].changed]
        for diff in self.fields:
            if diff.field == LENGTH:
                if not by_name["attempts"].changed:
                    items.append(f"{diff.count} steps in one trace only")
            elif diff.field != "overflow":
                size = f" (max {diff.max_ulp} ulp)" if diff.max_ulp is not None else ""
                items.append(f"{diff.field} at {diff.count}{of}{size}")
        if self.kind == NUMERICS:
            items.append("scale and skips identical")
        return items

    def lines(self, before: str = "before", after: str = "after") -> list:
        """The full report: the verdict, the first divergence, the table of fields that differ and
        the summaries side by side (``before`` / ``after``: what to call the two traces)."""
        out = [self.verdict()]
        if self.divergence is not None:
            out.append(f"first divergence: {self.divergence.describe(before, after)}")
        out += [""] + self.field_lines() if self.fields else []
        return out + [""] + self.summary_lines(before, after)

    def field_lines(self) -> list:
        """A table row per field that differs: at how many steps, max ulp, max relative, which steps
        (the ``steps`` row: the steps only one trace has)."""
        rows = [f"{'field':<16} {'differs at':>12}  {'max ulp':>10}  {'max rel':>9}  steps"]
        for diff in self.fields:
            ulp = "-" if diff.max_ulp is None else str(diff.max_ulp)
            rel = "-" if diff.max_rel is None else f"{diff.max_rel:.3g}"
            count = f"{diff.count}" if diff.field == LENGTH else f"{diff.count} / {self.steps_compared}"
            rows.append(f"{diff.field:<16} {count:>12}  {ulp:>10}  {rel:>9}  "
                        f"{step_ranges(diff.steps, diff.count)}")
        return rows

    def summary_lines(self, before: str = "before", after: str = "after") -> list:
        """The summaries side by side, a ``*`` marking each entry that differs."""
        rows = [f"{'summary':<18} {before:>22} {after:>22}"]
        for change in self.summary:
            rows.append(f"{change.name:<18} {_plain(change.before):>22} {_plain(change.after):>22}"
                        + ("  *" if change.changed else ""))
        return rows

    def as_dict(self, before: str = "before", after: str = "after") -> dict:
        """JSON-safe: every attribute, plus ``kind``, ``identical`` and the ``verdict`` line."""
        return {"before": self.before, "after": self.after, "kind": self.kind, "identical": self.identical,
                "verdict": self.verdict(), "steps_compared": self.steps_compared, "steps_differ": self.steps_differ,
                "fields_compared": list(self.fields_compared), "fields": [f.as_dict() for f in self.fields],
                "overflow_flips": self.overflow_flips.count if self.overflow_flips else 0,
                "summary": [c.as_dict() for c in self.summary],
                "divergence": self.divergence.as_dict(before, after) if self.divergence else None,
                "profile": self.profile.as_dict() if self.profile else None,
                "params": [c.as_dict() for c in self.params], "packages": [c.as_dict() for c in self.packages],
                "settings": [c.as_dict() for c in self.settings]}


def step_ranges(steps, count: int, limit: int = 12) -> str:
    """Steps as runs, ``3, 7-9, 20``; past ``limit`` runs (or the listed steps), how many more.

    Args:
      steps: increasing step indices (the listed ones).
      count: how many steps differ in all (at least ``len(steps)``).
      limit: the most runs to print.

    Returns:
      The text, e.g. ``step_ranges((3, 7, 8, 9, 20), 5) == '3, 7-9, 20'`` and
      ``step_ranges((0, 1), 90) == '0-1, ... (88 more)'``.
    """
    runs = []
    for step in steps:
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    shown = runs[:limit]
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    left = count - sum(b - a + 1 for a, b in shown)
    return f"{text}, ... ({left} more)" if left else text


def relative_difference(before, after) -> float:
    """``|after - before| / |before|`` of two floats, or the largest over two lists.

    Args:
      before, after: two floats, or two lists of floats (a field's values at one step).

    Returns:
      0 for bit-equal values (NaN and NaN included) and for -0 vs +0; inf where either is NaN or
      inf, or ``before`` is 0, and the other differs, and for lists of different lengths.

    Example: ``relative_difference(16384.0, 2048.0) == 0.875``.
    """
    if isinstance(before, list) or isinstance(after, list):
        if not (isinstance(before, list) and isinstance(after, list) and len(before) == len(after)):
            return math.inf
        return max((relative_difference(a, b) for a, b in zip(before, after)), default=0.0)
    if bit_equal(before, after) or before == after:
        return 0.0
    if not (math.isfinite(before) and math.isfinite(after)) or before == 0:
        return math.inf
    return abs(after - before) / abs(before)


def _is_float(value) -> bool:
    return isinstance(value, float) or (isinstance(value, list) and all(isinstance(v, float) for v in value))


@dataclasses.dataclass
class _Tally:
    """A field's differences, accumulated step by step."""
    count: int = 0
    steps: list = dataclasses.field(default_factory=list)
    max_ulp: Optional[int] = None
    max_rel: Optional[float] = None

    def add(self, step: int, field: str, before, after) -> None:
        self.count += 1
        if len(self.steps) < STEP_LIMIT:
            self.steps.append(step)
        if not (_is_float(before) and _is_float(after)):
            return
        self.max_rel = max(self.max_rel or 0.0, relative_difference(before, after))
        if field in ULP_FIELDS:
            self.max_ulp = max(self.max_ulp or 0, ulp_distance(before, after))

    def result(self, field: str) -> FieldDiff:
        return FieldDiff(field, self.count, tuple(self.steps), self.max_ulp, self.max_rel)


def _field_diffs(a: Trace, b: Trace, common) -> tuple:
    """(FieldDiffs in trajectory-then-numerics order, steps where any field differs, the first
    differing (step, field, before, after) or None)."""
    tallies, differing, first = {}, set(), None
    for step in range(min(len(a.steps), len(b.steps))):
        for field in common:
            before, after = decode_value(a.steps[step], field), decode_value(b.steps[step], field)
            if not bit_equal(before, after):
                tallies.setdefault(field, _Tally()).add(step, field, before, after)
                differing.add(step)
                first = first or (step, field, before, after)
    shorter, longer = sorted((len(a.steps), len(b.steps)))
    if longer > shorter:
        tallies[LENGTH] = _Tally(longer - shorter, list(range(shorter, min(longer, shorter + STEP_LIMIT))))
        first = first or (shorter, LENGTH, len(a.steps), len(b.steps))
    order = [f for f in TRAJECTORY_FIELDS + NUMERIC_FIELDS if f in tallies]
    return tuple(tallies[f].result(f) for f in order), len(differing), first


def _summary(a: Trace, b: Trace) -> tuple:
    return tuple(ValueChange(key, decode_value(a.summary, key), decode_value(b.summary, key)) for key in SUMMARY_KEYS)


def _differing(before: dict, after: dict, keys) -> tuple:
    return tuple(change for change in (ValueChange(k, before.get(k), after.get(k)) for k in keys) if change.changed)


@dataclasses.dataclass(frozen=True)
class _MetadataChanges:
    """What differs between two traces' metadata (see the TraceChanges attributes of these names)."""
    profile: Optional[ValueChange]
    params: tuple
    packages: tuple
    settings: tuple


def _metadata_changes(a: Trace, b: Trace) -> _MetadataChanges:
    meta_a, meta_b = a.metadata, b.metadata
    profile = ValueChange("profile", meta_a.get("profile"), meta_b.get("profile"))
    params = ()
    if not profile.changed:
        pa, pb = meta_a.get("params") or {}, meta_b.get("params") or {}
        params = _differing(pa, pb, sorted(set(pa) | set(pb)))
    ka, kb = meta_a.get("packages") or {}, meta_b.get("packages") or {}
    same_impl = a.implementation == b.implementation
    packages = _differing(ka, kb, sorted(set(ka) | set(kb) if same_impl else set(ka) & set(kb)))
    return _MetadataChanges(profile if profile.changed else None, params, packages, _settings_changes(meta_a, meta_b))


def _compute_format(meta: dict):
    """The format a run computed its statistics in (a recording) or decided overflows in (a replay)."""
    return (meta.get("recorder") or {}).get("compute_format") or (meta.get("replayed") or {}).get("compute")


def _settings_changes(meta_a: dict, meta_b: dict) -> tuple:
    """How the two runs were recorded or replayed, where both say and they differ: the recorder's
    settings (``recorder shadow_every 10 -> 0``), the compute format (of a recording or a replay) and
    the file a replay replayed (its sha256)."""
    ra, rb = meta_a.get("recorder") or {}, meta_b.get("recorder") or {}
    changes = tuple(ValueChange(f"recorder {key}", ra[key], rb[key]) for key in sorted(set(ra) & set(rb))
                    if key != "compute_format")
    changes += (ValueChange("compute format", _compute_format(meta_a), _compute_format(meta_b)),)
    replayed_a, replayed_b = meta_a.get("replayed"), meta_b.get("replayed")
    if replayed_a and replayed_b:
        changes += (ValueChange(f"replayed {replayed_b['trace']} sha256", replayed_a["sha256"][:12],
                                replayed_b["sha256"][:12]),)
    return tuple(change for change in changes if change.changed and None not in (change.before, change.after))


def _spec_changes(spec_a: dict, spec_b: dict) -> tuple:
    """The keys of two TOML spec texts that differ (``steps 400 -> 300``); () where either is no TOML
    (a recorded run keeps a description as its text)."""
    try:
        flat_a, flat_b = (_flat(tomllib.loads(spec["text"])) for spec in (spec_a, spec_b))
    except (tomllib.TOMLDecodeError, TypeError):
        return ()
    return _differing(flat_a, flat_b, sorted(set(flat_a) | set(flat_b)))


def spec_changes(before: Trace, after: Trace) -> tuple:
    """The keys of the two traces' spec texts that differ, as :class:`ValueChange` (``steps 8 -> 10``); ()
    where the specs are the same or either is no TOML.

    Example: a golden made before a spec's ``scaler.growth_interval`` went from 5 to 6 gives
    ``(ValueChange('scaler.growth_interval', 5, 6),)``.
    """
    return _spec_changes(before.metadata["spec"], after.metadata["spec"])


def _flat(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        name = f"{prefix}{key}"
        out.update(_flat(value, f"{name}.") if isinstance(value, dict) else {name: value})
    return out


def _cause(first, a: Trace, b: Trace, meta: _MetadataChanges, explain=None) -> str:
    """The likely cause of the first difference, from what else differs: another scenario (of two
    spec-made traces), then changed parameters or recorder settings (never implementation timing), then a changed spec
    (naming its keys that differ); package upgrades are named in front of the step-level reading
    (:func:`fpemu.compare.diff.likely_cause`)."""
    step, field = first[0], first[1]
    spec_a, spec_b = a.metadata["spec"], b.metadata["spec"]
    # a recorded run is no spec's trace: its name labels the run and its "spec" text describes it, so
    # against it another profile is the change (between a spec's implementations it is their subject)
    recorded = is_recorded(a) or is_recorded(b)
    named = [f"profiles differ: {meta.profile.before} -> {meta.profile.after}"] if recorded and meta.profile else []
    if meta.params:
        named.append(f"parameters differ: {_describe_all(meta.params)}")
    if meta.settings:
        named.append(f"recording differs: {_describe_all(meta.settings)}")
    if spec_a["name"] != spec_b["name"] and not recorded:
        return "; ".join([f"different scenarios: spec {spec_a['name']} -> {spec_b['name']}", *named])
    if named:
        return "; ".join(named)
    if spec_a["sha256"] != spec_b["sha256"] and not recorded:
        keys = _spec_changes(spec_a, spec_b)
        return (f"the spec changed (sha256 {spec_a['sha256'][:12]} -> {spec_b['sha256'][:12]}): "
                + (_describe_all(keys) if keys else "other overflow inputs, steps or model"))
    if field == LENGTH:
        reading = "one run stopped early (an implementation raised, e.g. at its minimum scale)"
    elif field.startswith("summary."):
        reading = "the steps agree but the summaries do not: the state after the last step (or the count) differs"
    else:
        reading = (recorded_cause(field, step, a, b) or initial_scale_cause(field, step, a, b)
                   or likely_cause(field, step, a, b, explain))
    return f"{_describe_all(meta.packages)}: {reading}" if meta.packages else reading


def divergence_cause(before: Trace, after: Trace, step: int, field: str, explain=None) -> str:
    """The likely cause of a first divergence at ``step``, ``field`` between any two traces, read
    from both traces' metadata first (as :func:`trace_changes` reads it): a parameter, recorder
    setting, replayed file or spec key that differs is named, never blamed on implementation timing.

    Example: ``divergence_cause(golden, observed, 3, "growth_counter")`` gives
    ``'parameters differ: growth_interval 4 -> 5'`` where the real scaler holds another interval.
    """
    return _cause((step, field), before, after, _metadata_changes(before, after), explain)


def trace_changes(before: Trace, after: Trace, explain=None) -> TraceChanges:
    """Compare any two traces step by step, field by field, and their summaries and metadata.

    Args:
      before: the first trace (a golden or reference trace, a baseline, a run before a change).
      after: the second trace (a recording, the run after the change).
      explain: the scenario kinds' reading of a divergence (:func:`fpemu.kinds.explain`), asked first.

    Returns:
      A :class:`TraceChanges`: ``identical`` when every shared step field and the summaries agree
      bit for bit (parameters and packages may still differ: they are context, not behaviour).

    Raises:
      FpemuInputError: the traces have steps but share no step field, so nothing can be compared.

    Example::

        changes = trace_changes(read_trace("a.json"), read_trace("b.json"))
        print(changes.verdict())
        # trajectory changed: overflow flipped at 5 of 80 steps, skipped updates 29 -> 34, ...
    """
    common = shared_fields(before, after)
    if not common and (before.steps or after.steps):
        raise FpemuInputError(f"the traces share no step field to compare: {_label(before)} records "
                              f"{_recorded(before)}; {_label(after)} records {_recorded(after)}")
    fields, steps_differ, first = _field_diffs(before, after, common)
    summary = _summary(before, after)
    if first is None:
        changed = next((change for change in summary if change.changed), None)
        if changed is not None:
            first = (min(len(before.steps), len(after.steps)), f"summary.{changed.name}", changed.before,
                     changed.after)
    meta = _metadata_changes(before, after)
    divergence = None
    if first is not None:
        step, field, expected, got = first
        element, expected, got = (first_element(field, before.steps[step], expected, got)
                                  if step < len(before.steps) else ("", expected, got))
        divergence = Divergence(step, field, expected, got, _cause(first, before, after, meta, explain), element)
    return TraceChanges(before=_label(before), after=_label(after),
                        steps_compared=min(len(before.steps), len(after.steps)), steps_differ=steps_differ,
                        fields_compared=tuple(common), fields=fields, summary=summary, divergence=divergence,
                        profile=meta.profile, params=meta.params, packages=meta.packages, settings=meta.settings)


def _label(trace: Trace) -> str:
    return f"{trace.spec_name} / {trace.implementation}"


def _recorded(trace: Trace) -> str:
    keys = sorted({key for record in trace.steps for key in record if key in FIELDS})
    return ", ".join(keys) or "no field"
