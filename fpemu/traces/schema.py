"""What a trace file may hold, as data: the reader's bounds before parsing, the type and range of every field
after, and what the fields mean together.

A trace's checksum is a plain sha256 that anyone can recompute, so it proves the file is as some
writer left it, not that a writer of fpemu's made it.  :func:`bounded_json` refuses a file over
:data:`READ_LIMITS` before it is parsed (its size, its nesting, the longest run of digits in a number);
:func:`trace_problem` then checks every value against :data:`METADATA`, the step-field table
(fpemu.traces.fields.FIELDS: each field's check) and :data:`SUMMARY`, then that the step fields are one
scenario kind's and in every record, that the summary counts the steps, and that the spec's sha256 is its
text's; it names the first wrong one, e.g. ``metadata.device: expected a string, got null``.  docs/bounds.md
lists these tables.

Example:
  >>> trace_problem({"metadata": {"fpemu_version": "0.1.0", "spec": {"name": "s", "sha256": "0", "text": ""},
  ...                "implementation": "reference", "device": None}, "steps": [], "summary": {}})
  'metadata.device: expected a string, got null'
"""

from __future__ import annotations

import hashlib
import json
import re

import numpy as np

from fpemu.traces import checks
from fpemu.traces.fields import FIELDS, RECORDING_KINDS

MAX_TRACE_STEPS = 100_000  # the longest spec run (fpemu.kinds.bounds.MAX_STEPS); a report on one takes a minute

# What a reader accepts before it parses a file: fpemu's writers stay far inside every bound.
READ_LIMITS = {
    "bytes": 128 << 20,  # a 100,000-step golden is 17 MB (the scan before parsing holds ~6 bytes per byte)
    "depth": 64,  # the deepest writer (recorded grad_stats / shadow_histogram) nests 7 deep
    "number_digits": 64,  # the longest run of digits: a float's repr has at most 17, an int64 19
    "steps": MAX_TRACE_STEPS,
}


def _constant_hook(name: str):
    raise ValueError(f"the literal {name} (JSON has no NaN or inf; fpemu writes them as strings)")


def _outside_strings(data: bytes) -> np.ndarray:
    """The bytes of JSON ``data`` outside its strings (escapes dropped first, so an escaped quote ends none)."""
    if b"\\" in data:
        data = re.sub(rb"\\.", b"", data, flags=re.DOTALL)
    codes = np.frombuffer(data, dtype=np.uint8)
    quote = codes == ord('"')
    return codes[((np.cumsum(quote, dtype=np.int32) & 1) == 0) & ~quote]


def _scan(data: bytes) -> tuple:
    """(the deepest nesting of [ and {, the longest run of digits) in JSON ``data``, strings left out: found by
    vectorised scans, before (and without) parsing it."""
    codes = _outside_strings(data)
    nesting = (np.isin(codes, (ord("["), ord("{"))).astype(np.int8) - np.isin(codes, (ord("]"), ord("}"))))
    depth = int(np.cumsum(nesting, dtype=np.int32).max(initial=0))
    digit = np.concatenate(([0], ((codes >= ord("0")) & (codes <= ord("9"))).view(np.int8), [0]))
    edges = np.flatnonzero(np.diff(digit))  # where each run of digits starts and ends
    return depth, int((edges[1::2] - edges[::2]).max(initial=0))


def bounded_json(data: bytes, path: str, error: type, what: str = "a trace file"):
    """The JSON value in ``data``, or ``error`` naming ``path`` (``what`` it should be) and the bound of
    :data:`READ_LIMITS` it passes."""
    if len(data) > READ_LIMITS["bytes"]:
        raise error(f"{path}: not {what}: {len(data):,} bytes, over the reader's {READ_LIMITS['bytes']:,}")
    depth, digits = _scan(data)
    if depth > READ_LIMITS["depth"]:
        raise error(f"{path}: not {what}: JSON nested {depth:,} deep, over the reader's {READ_LIMITS['depth']}")
    if digits > READ_LIMITS["number_digits"]:
        raise error(f"{path}: not {what}: a number of {digits:,} digits, over the reader's "
                    f"{READ_LIMITS['number_digits']} (Python converts no integer past 4,300)")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_constant_hook)
    except UnicodeDecodeError as problem:
        raise error(f"{path}: not {what}: not UTF-8 ({problem.reason} at byte {problem.start})") from None
    except json.JSONDecodeError as problem:
        raise error(f"{path}: not {what}: invalid JSON ({problem.msg} at line {problem.lineno})") from None
    except ValueError as problem:
        raise error(f"{path}: not {what}: {problem}") from None


# The metadata keys every writer (fpemu.traces.layout, .recorded, fpemu.emulate.trace, fpemu.harness) may
# write: key -> (required, check).
METADATA = {
    "fpemu_version": (True, checks.string), "spec": (True, checks.spec), "implementation": (True, checks.file_name),
    "profile": (False, checks.string), "params": (False, checks.params), "packages": (False, checks.strings_table),
    "device": (False, checks.string), "host": (False, checks.table), "verified": (False, checks.string),
    "replayed": (False, checks.strings_table), "tensors_from": (False, checks.string),
    "same_tensors_model": (False, checks.table), "ranks": (False, checks.table), "source": (False, checks.string),
    "framework": (False, checks.string), "recorder": (False, checks.table), "policy": (False, checks.table),
    "op_table": (False, checks.anything), "telemetry": (False, checks.table),
    "model_differences": (False, checks.table), "audit_findings": (False, checks.table),
}

# Step keys outside FIELDS: fpemu.emulate's per-module underflow (reports read them; comparisons do not).
EXTRA_STEP_VALUES = {"module_underflow": checks.table, "module_underflow_forward": checks.table}

SUMMARY = {
    "attempts": checks.count, "completed_updates": checks.count, "skipped_updates": checks.count,
    "final_scale": checks.at_least(0), "final_scale_hex": checks.float_hex, "stopped_at": checks.optional(checks.count),
    "events": checks.events, "examples": checks.optional(checks.count), "scheduler_steps": checks.count,
    "losses_hex": checks.list_of(checks.float_hex),
}
SUMMARY_ALWAYS = ("attempts", "completed_updates", "skipped_updates", "stopped_at")  # every writer's
RECORDED_SOURCE = "recorded_run"  # metadata.source of a user's own run (fpemu.traces.recorded)
# The fields every record of a recorded run holds; a loop may measure the others on some attempts only (the
# shadow pass's on sampled ones, statistics where it called grad_stats, the loss where it reported one)
RECORDED_ALWAYS = ("scale", "overflow", "applied")


# The step fields stored with a float.hex() twin
TWINNED = tuple(name for name, field in FIELDS.items() if field.value[1] is not None)


def _wrong(where: str, expected: str, value) -> str:
    return f"{where}: expected {expected}, got {checks.json_name(value)}"


def _table_problem(table, where: str, rows: dict, required=()) -> str | None:
    if not isinstance(table, dict):
        return _wrong(where, "an object", table)
    for key in required:
        if key not in table:
            return f"{where}.{key}: missing"
    for key, value in table.items():
        check = rows.get(key)
        if check is None:
            return f"{where}.{key}: unknown key; expected one of {', '.join(sorted(rows))}"
        expected = check(value)
        if expected:
            return _wrong(f"{where}.{key}", expected, value)
    return None


def step_checks() -> dict:
    """Step key -> check: each field of FIELDS, its ``_hex`` form, ``step`` and the extra keys."""
    return {"step": checks.count, **{key: check for field in FIELDS.values() for key, check in field.checks.items()},
            **EXTRA_STEP_VALUES}


def _steps_problem(steps) -> str | None:
    if not isinstance(steps, list):
        return _wrong("steps", "a list of step records", steps)
    if len(steps) > READ_LIMITS["steps"]:
        return f"steps: {len(steps):,} records, over the reader's {READ_LIMITS['steps']:,}"
    known = step_checks()
    for index, record in enumerate(steps):
        problem = _table_problem(record, f"steps[{index}]", known, ("step",))
        if problem:
            return problem
        if record["step"] != index:
            return _wrong(f"steps[{index}].step", f"{index} (records are in step order)", record["step"])
        problem = _pairs_problem(record, f"steps[{index}]", TWINNED)
        if problem:
            return problem
    return None


def _same_float(readable, exact: str) -> bool:
    value, stored = float(readable), float.fromhex(exact)
    return value == stored or (value != value and stored != stored)


def _same_floats(readable, exact) -> bool:
    """Whether a readable float (or a list of them, nested) is its ``_hex`` twin, element for element."""
    if isinstance(readable, list) or isinstance(exact, list):
        return (isinstance(readable, list) and isinstance(exact, list) and len(readable) == len(exact)
                and all(_same_floats(r, e) for r, e in zip(readable, exact)))
    return _same_float(readable, exact)


def _pairs_problem(table: dict, where: str, twinned=()) -> str | None:
    """A readable float (or list of floats) that is not its ``_hex`` twin (comparisons read the hex, reports
    the readable), or one of ``twinned`` without its twin."""
    for key in twinned:
        if (key in table) != (f"{key}_hex" in table):
            missing = f"{key}_hex" if key in table else key
            return f"{where}.{missing}: missing (every float is stored as a readable value and its float.hex() form)"
    for key, exact in table.items():
        readable = table.get(key[:-4]) if key.endswith("_hex") else None
        if readable is not None and not _same_floats(readable, exact):
            stored = exact if isinstance(exact, str) else checks.json_name(exact)
            return f"{where}.{key[:-4]}: {checks.json_name(readable)} is not {key} {stored} (the two forms of one float)"
    return None


def _kinds_problem(steps, recorded: bool) -> str | None:
    """A field no scenario kind records beside the trace's others (a trace is one kind's), or a record that
    lacks a field another holds (each record of a trace holds the same fields; a recorded run's, only those of
    :data:`RECORDED_ALWAYS`)."""
    kinds = ("recorded",) if recorded else tuple(kind for kind in RECORDING_KINDS if kind != "recorded")
    seen = []
    for index, record in enumerate(steps):
        for key in (key for key in record if key in FIELDS and key not in seen):
            fitting = tuple(kind for kind in kinds if kind in FIELDS[key].recorded_by)
            if not fitting:
                beside = f" beside {', '.join(seen)}" if seen else ""
                held = "a recorded run" if recorded else "a trace of any kind but a recorded run's"
                return (f"steps[{index}].{key}: no scenario kind records it{beside} (it is recorded by "
                        f"{', '.join(FIELDS[key].recorded_by)}; this is {held})")
            kinds, seen = fitting, seen + [key]
    always = [key for key in seen if not recorded or key in RECORDED_ALWAYS]
    for index, record in enumerate(steps):
        missing = next((key for key in always if key not in record), None)
        if missing:
            return f"steps[{index}].{missing}: missing (every record of the trace holds it but this one)"
    return None


def _summary_problem(summary: dict, steps: list) -> str | None:
    """Counts in the summary that are not the steps': one attempt per step record, each applied or skipped
    (a record without ``applied``, of a kind that never skips, is applied)."""
    if "attempts" in summary and summary["attempts"] != len(steps):
        return _wrong("summary.attempts", f"{len(steps)} (the number of step records)", summary["attempts"])
    applied = sum(record.get("applied", True) for record in steps)  # a kind without skips applies every step
    for key, expected in (("completed_updates", applied), ("skipped_updates", len(steps) - applied)):
        if key in summary and summary[key] != expected:
            which = "true (or absent)" if key == "completed_updates" else "false"
            return _wrong(f"summary.{key}", f"{expected} (the steps whose applied is {which})", summary[key])
    return None


def _spec_problem(spec: dict) -> str | None:
    digest = hashlib.sha256(spec["text"].encode("utf-8", "surrogatepass")).hexdigest()
    return None if spec["sha256"] == digest else _wrong("metadata.spec.sha256", f"{digest} (the sha256 of "
                                                                                       "metadata.spec.text)",
                                                            spec["sha256"])


TOP_LEVEL = ("format", "version", "metadata", "steps", "summary")


def trace_problem(body: dict) -> str | None:
    """The first field of ``body`` (a parsed trace, its checksum already checked) that does not fit the
    schema, and what it should be; None where all fit.  Types and ranges first, then what they mean
    together: the fields of one scenario kind, the summary's counts, the spec's sha256."""
    unknown = sorted(set(body) - set(TOP_LEVEL), key=str)
    if unknown:
        return f"{unknown[0]}: unknown key; a trace holds {', '.join(TOP_LEVEL)} (and its checksum)"
    return (_table_problem(body.get("metadata"), "metadata", {k: c for k, (_, c) in METADATA.items()},
                           [k for k, (required, _) in METADATA.items() if required])
            or _steps_problem(body.get("steps"))
            or _table_problem(body.get("summary"), "summary", SUMMARY, SUMMARY_ALWAYS)
            or _pairs_problem(body["summary"], "summary", ("final_scale",))
            or _kinds_problem(body["steps"], body["metadata"].get("source") == RECORDED_SOURCE)
            or _summary_problem(body["summary"], body["steps"])
            or _spec_problem(body["metadata"]["spec"]))


def read_limits_table() -> str:
    """:data:`READ_LIMITS` as the Markdown table docs/bounds.md shows."""
    return "\n".join(["| bound | value |", "|---|---|"] + [f"| {k} | {v:,} |" for k, v in READ_LIMITS.items()])


def schema_table() -> str:
    """:func:`schema_rows` as the Markdown table docs/bounds.md shows."""
    rows = ["| section | key | expected |", "|---|---|---|"]
    return "\n".join(rows + [f"| {section} | `{key}` | {expected} |" for section, key, expected in schema_rows()])


def schema_rows() -> list:
    """(section, key, what it must be): every row of the tables above."""
    def described(check):
        expected = check(object())  # every check names what it expects of a value it refuses
        return expected or "any JSON value"
    rows = [("metadata", key, ("required: " if required else "") + described(check))
            for key, (required, check) in METADATA.items()]
    rows += [("steps[i]", "step", "the record's index")]
    rows += [("steps[i]", key, described(check)) for key, check in step_checks().items() if key != "step"]
    rows += [("summary", key, described(check)) for key, check in SUMMARY.items()]
    return rows
