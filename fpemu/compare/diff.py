"""Compare two traces field by field and name the first divergence and its likely cause.

Every field compares bit for bit: floats by their exact hex form (any NaN equals
any NaN, -0 differs from +0), lists element by element and by length.  For
tensor-like fields (loss, weights, shares) the float32 ulp distance is reported
too.  A divergence the spec declares (``expect_divergence``: its first step and
field) is reported as known, not as a failure; any other difference fails.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

from fpemu.traces import Trace, decode_value
from fpemu.traces.fields import EXACT_FIELDS, FIELDS, ULP_FIELDS


MATCH, DIVERGED, KNOWN, SKIPPED = "match", "diverged", "known divergence", "skipped"
API_CHANGED, CANNOT_RUN, INTERNAL_ERROR = "api changed", "cannot run", "internal error"

# Every status a job (one spec x one implementation, in diff, record, audit and run) ends in:
# status -> (what it means, whether it fails the run, the exit code it asks for).  A closed set:
# reports and the CLI order their lines by it.
STATUSES = {
    INTERNAL_ERROR: ("fpemu itself raised outside the adapter's run (a bug in fpemu); the other jobs still "
                     "run", True, 3),
    API_CHANGED: ("the framework refused the adapter's call: a TypeError or AttributeError raised by the "
                  "framework or by the adapter's call into it (an argument added or removed, an attribute "
                  "renamed), or another refusal the adapter recognizes as one (Keras's ValueError for a removed "
                  "argument)", True, 1),
    CANNOT_RUN: ("the framework is installed but the job could not run: it or a dependency fails to import, "
                 "or any other exception was raised while the adapter ran (a dtype the release lacks, a "
                 "value it refuses, a dead worker)", True, 1),
    DIVERGED: ("the traces differ, and not (only) where the spec declares", True, 1),
    KNOWN: ("the first divergence is the one the spec declares", False, 0),
    SKIPPED: ("not run: its framework, isolated environment or device is absent here (a run where every job "
              "is skipped, or an audit of a baseline implementation missing now, fails unless "
              "--allow-skips)", False, 0),
    MATCH: ("the traces agree bit for bit", False, 0),
}
JOB_FAILURES = (INTERNAL_ERROR, API_CHANGED, CANNOT_RUN)  # a job that produced no trace


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The first step and field where two traces differ; ``element``: in a field whose elements are
    named (fp8 casts), the first element that differs (``expected`` and ``got`` are then its values)."""
    step: int
    field: str
    expected: object
    got: object
    cause: str
    element: str = ""

    def describe(self, expected: str = "expected", got: str = "got") -> str:
        where = f"{self.field} of {self.element}" if self.element else self.field
        if isinstance(self.expected, dict) and isinstance(self.got, dict):  # a recorded run's grad_stats
            from fpemu.compare.readings import summarize_dicts
            return f"step {self.step}, {where}: {summarize_dicts(self.expected, self.got)} (likely cause: {self.cause})"
        return (f"step {self.step}, {where}: {expected} {_show(self.expected)}, {got} {_show(self.got)}"
                f" (likely cause: {self.cause})")

    def as_dict(self, expected: str = "expected", got: str = "got") -> dict:
        """JSON-safe: the values as ``repr (hex)`` and the one-line message under the given labels."""
        return {"step": self.step, "field": self.field, "element": self.element, "expected": _show(self.expected),
                "got": _show(self.got), "cause": self.cause, "message": self.describe(expected, got)}


def first_element(field: str, record: dict, expected, got) -> tuple:
    """(name, expected, got) of the first element that differs in a field whose elements are named by
    another field of the step ``record`` (``FIELDS[field].labels``); ("", expected, got) otherwise.  An
    element that is a list of values (a rowwise cast's scales) is narrowed to its first differing value,
    named ``cast[row]`` where it has more than one.  A label that is one name, not a list, names the whole
    step (a blocks step's input kind).

    Example:
      >>> casts = {"fp8_casts": ["layer0.input", "layer0.weight"]}
      >>> first_element("tensor_scale", casts, [[1.0], [2.0]], [[1.0], [4.0]])
      ('layer0.weight', 2.0, 4.0)
      >>> first_element("tensor_amax", casts, [[1.0, 3.0], [2.0]], [[1.0, 5.0], [2.0]])
      ('layer0.input[1]', 3.0, 5.0)
      >>> first_element("scale_codes", {"block_input": "edges"}, "3d23f8...", "c09d92...")
      ('edges', '3d23f8...', 'c09d92...')
    """
    source = FIELDS[field].labels if field in FIELDS else None
    names = record.get(source) if source else None
    if isinstance(names, str):  # a step named as a whole (a blocks step: its input kind)
        return names, expected, got
    if not names or not isinstance(expected, list) or not isinstance(got, list):
        return "", expected, got
    for index, (a, b) in enumerate(zip(expected, got)):
        if not bit_equal(a, b):
            name = names[index] if index < len(names) else f"[{index}]"
            if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):  # a cast's values: name the row
                inner = next(j for j, (x, y) in enumerate(zip(a, b)) if not bit_equal(x, y))
                return (name if len(a) == 1 else f"{name}[{inner}]"), a[inner], b[inner]
            return name, a, b
    return f"{len(min(expected, got, key=len))} of {len(max(expected, got, key=len))} elements", expected, got


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The outcome of comparing one implementation's trace with the golden one."""
    spec: str
    implementation: str
    status: str
    divergence: Optional[Divergence] = None
    note: str = ""
    steps_compared: int = 0
    max_ulp: dict = dataclasses.field(default_factory=dict)
    packages: dict = dataclasses.field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return STATUSES[self.status][1]

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        if self.divergence is not None:
            out["divergence"] = self.divergence.as_dict()
        return out


def _show(value) -> str:
    if isinstance(value, float):
        return f"{value!r} ({value.hex()})"
    return repr(value)


def ulp_distance_f32(a: float, b: float) -> int:
    """Distance in float32 ulps (NaN vs NaN is 0; NaN vs a number is the int32 maximum)."""
    if math.isnan(a) and math.isnan(b):
        return 0
    if math.isnan(a) or math.isnan(b):
        return 2**31 - 1

    def ordered(x):
        bits = int(np.array(x, np.float32).view(np.int32))
        return bits if bits >= 0 else -(bits & 0x7FFFFFFF)

    return abs(ordered(a) - ordered(b))


def likely_cause(field: str, step: int, golden: Trace, observed: Trace, explain=None) -> str:
    """A heuristic reading of the first divergence; ``explain`` (the scenario kinds' own reading,
    :func:`fpemu.kinds.explain`) is asked first."""
    explained = explain(field, step, golden, observed) if explain is not None else None
    if explained:
        return explained
    expected, got = decode_value(golden.steps[step], field), decode_value(observed.steps[step], field)
    before = step - 1
    if field == "overflow":
        return "the overflow flags differ: the implementation checks for inf/NaN elsewhere (scaled vs unscaled)"
    if field == "applied":
        return "skip policy: the implementation runs (or skips) the optimizer step on this outcome"
    if field in ("growth_counter", "hysteresis"):
        later = next((i for i in range(step, min(len(golden.steps), len(observed.steps)))
                      if decode_value(golden.steps[i], "scale") != decode_value(observed.steps[i], "scale")), None)
        if field == "growth_counter" and later is not None:
            return (f"growth timing: the growth counter resets on a different step, and the scale "
                    f"follows at step {later}")
        return f"{field} bookkeeping differs (reset rule)"
    if field in FIELDS and FIELDS[field].labels == "fp8_casts":
        return fp8_cast_cause(observed)
    if field in ("amax", "amax_used", "scale_inv") or (field == "scale" and "amax" in golden.steps[step]):
        return ("fp8 recipe: the amax history, its NaN handling or the scale's float32 arithmetic differ "
                "(see docs/fp8_recipes.md)")
    if field == "update_ratio":
        return ("update size: the optimizer applied another update than the step's scale implies (its "
                "gradients were unscaled with another scale than the loss was scaled with, or clipped)")
    if field in ULP_FIELDS:
        return ("tensor arithmetic: the implementation rounds, orders or fuses the step's operations "
                "differently (see docs/steps.md)")
    if field != "scale" or before < 0:
        return "different arithmetic"
    previous_overflow = bool(golden.steps[before].get("overflow"))
    if math.isinf(got) and not math.isinf(expected):
        return "growth past float32 max: the implementation lets the scale become inf"
    if math.isfinite(got) and math.isinf(expected):
        return "growth past float32 max: the implementation keeps or clamps the scale"
    if expected == 0 or got == 0:
        return "floor: one scale reached 0 (no floor) where the other stopped"
    ratio = got / expected
    if abs(ratio - 1) <= 1e-6:
        return "scale arithmetic: last-bit rounding (float32 multiply vs float64 rounded once)"
    if previous_overflow:
        return "backoff or floor: the scale shrinks differently after an overflow"
    return "growth timing: the scale grows on a different good step (N vs N+1)"


def fp8_cast_cause(observed: Trace) -> str:
    """Why an fp8 cast's amax, scale or codes differ from the golden's: a real fp8 training run records
    whether the real casts equal fpemu's model on the run's own tensors (``same_tensors_model``)."""
    same = observed.metadata.get("same_tensors_model")
    if same is None:
        return ("fp8 scaling: the cast's amax history, scale arithmetic or the tensor it cast differ "
                "(see docs/fp8_recipes.md)")
    if same["status"] == MATCH:
        return ("the cast's input tensor changed, not the real scaling: the real casts equal fpemu's model on "
                "this run's own tensors, so this run's float32 arithmetic (matmuls, init, optimizer) differs from "
                "the golden run's, or fpemu's model changed since the golden was made (a golden holds for the "
                "packages in its metadata; docs/fp8_recipes.md)")
    return f"the real scaling departs from fpemu's model on the run's own tensors: {same['divergence']}"


def bit_equal(expected, got) -> bool:
    """Bit-exact equality of two field values (floats by hex, NaN equal to NaN; lists elementwise)."""
    if isinstance(expected, list) or isinstance(got, list):
        return (isinstance(expected, list) and isinstance(got, list) and len(expected) == len(got)
                and all(bit_equal(a, b) for a, b in zip(expected, got)))
    if isinstance(expected, float) and isinstance(got, float):
        return expected.hex() == got.hex() or (math.isnan(expected) and math.isnan(got))
    return expected == got and type(expected) is type(got)


def ulp_distance(expected, got) -> int:
    """ulp_distance_f32 of two values, or the largest over two lists of values."""
    if isinstance(expected, list):
        return max((ulp_distance_f32(a, b) for a, b in zip(expected, got)), default=0)
    return ulp_distance_f32(expected, got)


def shared_fields(a: Trace, b: Trace) -> list:
    """The step fields both traces record (at some step), in the trace format's table order.

    Args:
      a, b: the two traces.

    Returns:
      The field names, e.g. ``['scale', 'overflow', 'applied', 'growth_counter']`` for two scaler
      traces; empty when they share none.

    Example::

        common = shared_fields(read_trace("golden/timing_torch.json"), observed)
    """
    def recorded(trace):
        return set().union(*(record.keys() for record in trace.steps)) if trace.steps else set()
    in_a, in_b = recorded(a), recorded(b)
    return [f for f in EXACT_FIELDS + ULP_FIELDS if f in in_a and f in in_b]
