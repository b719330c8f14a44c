"""A golden trace against an observed one: the first divergence, its likely cause, and declared divergences."""

from __future__ import annotations

from fpemu.compare.changes import divergence_cause
from fpemu.compare.diff import (DIVERGED, KNOWN, MATCH, Divergence, Verdict, bit_equal, first_element, shared_fields,
                                ulp_distance)
from fpemu.errors import FpemuInputError
from fpemu.traces import Trace, decode_value
from fpemu.traces.fields import ULP_FIELDS


def compare_traces(golden: Trace, observed: Trace, expect_divergence=None, explain=None) -> Verdict:
    """Compare ``observed`` with ``golden`` on every field both record, at every step.

    The first divergence's likely cause reads both traces' metadata first
    (:func:`fpemu.compare.changes.divergence_cause`): parameters, recorder settings or a spec that
    differ are named rather than blamed on the implementation.

    Args:
      expect_divergence: an :class:`fpemu.kinds.scenario.ExpectedDivergence`; a first divergence at
        exactly its step and field is reported as known.
      explain: the scenario kinds' reading of a divergence, ``(field, step, golden, observed) -> str or
        None`` (:func:`fpemu.kinds.explain`); None: the generic reading alone.

    Raises:
      FpemuInputError: the traces share no field, so nothing could be compared.
    """
    common = shared_fields(golden, observed)
    if not common and (golden.steps or observed.steps):
        raise FpemuInputError(f"{golden.spec_name}: the golden trace and {observed.implementation}'s share no field "
                         "to compare (see the spec's [record] fields)")
    max_ulp = {f: 0 for f in common if f in ULP_FIELDS}
    divergence = None
    length = min(len(golden.steps), len(observed.steps))
    for step in range(length):
        for field in common:
            expected, got = decode_value(golden.steps[step], field), decode_value(observed.steps[step], field)
            if field in ULP_FIELDS and expected is not None and got is not None:
                max_ulp[field] = max(max_ulp[field], ulp_distance(expected, got))
            if divergence is None and not bit_equal(expected, got):
                element, expected, got = first_element(field, golden.steps[step], expected, got)
                divergence = Divergence(step, field, expected, got, divergence_cause(golden, observed, step, field, explain),
                                        element)
    if divergence is None and len(golden.steps) != len(observed.steps):
        divergence = Divergence(length, "steps", len(golden.steps), len(observed.steps),
                                divergence_cause(golden, observed, length, "steps", explain))
    status, note = MATCH, ""
    if divergence is not None:
        status = DIVERGED
        if expect_divergence is not None:
            declared = (expect_divergence.step, expect_divergence.field)
            if declared == (divergence.step, divergence.field):
                status, note = KNOWN, expect_divergence.reason
            else:
                note = (f"declared divergence at step {declared[0]}, {declared[1]} "
                        f"({expect_divergence.reason}); found this one instead")
    elif expect_divergence is not None:
        status, note = DIVERGED, (f"declared divergence at step {expect_divergence.step}, "
                                  f"{expect_divergence.field} did not happen: the traces match")
    return Verdict(spec=golden.spec_name, implementation=observed.implementation, status=status,
                   divergence=divergence, note=note, steps_compared=length, max_ulp=max_ulp,
                   packages=observed.metadata.get("packages", {}))
