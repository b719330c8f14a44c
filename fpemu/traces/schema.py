"""What a trace file may hold, as data: the reader's bounds before parsing, and the type of every field after.

A trace's checksum is a plain sha256 that anyone can recompute, so it proves the file is as some
writer left it, not that a writer of fpemu's made it.  :func:`bounded_json` refuses a file over
:data:`READ_LIMITS` before it is parsed (its size, its nesting, the longest run of digits in a number);
:func:`trace_problem` then checks every value against :data:`METADATA`, :data:`STEP_VALUES` (one row per
field of fpemu.traces.format.FIELDS) and :data:`SUMMARY`, naming the first wrong one, e.g.
``metadata.device: expected a string, got null``.  docs/bounds.md lists these tables.

Example:
  >>> trace_problem({"metadata": {"fpemu_version": "0.1.0", "spec": {"name": "s", "sha256": "0", "text": ""},
  ...                "implementation": "reference", "device": None}, "steps": [], "summary": {}})
  'metadata.device: expected a string, got null'
"""

from __future__ import annotations

import json
import re

import numpy as np

MAX_TRACE_STEPS = 100_000  # the longest spec run (fpemu.kinds.bounds.MAX_STEPS); a report on one takes a minute

# What a reader accepts before it parses a file: fpemu's writers stay far inside every bound.
READ_LIMITS = {
    "bytes": 128 << 20,  # a 100,000-step golden is 17 MB (the scan before parsing holds ~6 bytes per byte)
    "depth": 64,  # the deepest writer (recorded grad_stats / shadow_histogram) nests 7 deep
    "number_digits": 64,  # the longest run of digits: a float's repr has at most 17, an int64 19
    "steps": MAX_TRACE_STEPS,
}


def _json_name(value) -> str:
    """``value`` as a JSON reader sees it (null, true, an object), cut short."""
    text = json.dumps(value) if isinstance(value, (type(None), bool)) else repr(value)
    kind = {dict: "an object", list: "a list"}.get(type(value))
    return kind or (text if len(text) <= 60 else text[:57] + "...")


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


# Value checks: each returns None when the value fits, else what was expected.
def _string(value):
    return None if isinstance(value, str) else "a string"


def _integer(value):
    return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"


def _count(value):
    return None if _integer(value) is None and 0 <= value <= 1 << 62 else "an integer >= 0"


def _flag(value):
    return None if isinstance(value, bool) else "true or false"


def _object(value):
    return None if isinstance(value, dict) else "an object"


def _optional(check):
    return lambda value: None if value is None else check(value) and f"null or {check(value)}"


def _float(value):
    """A readable float: a number, or "nan", "inf", "-inf" (JSON has none of them)."""
    fits = (isinstance(value, (int, float)) and not isinstance(value, bool)) or value in ("nan", "inf", "-inf")
    return None if fits else 'a number or "nan", "inf", "-inf"'


def _hex(value):
    """``float.hex()`` of a float, the form comparisons read."""
    if isinstance(value, str) and len(value) <= 32:
        try:
            float.fromhex(value)
            return None
        except ValueError:
            pass
    return "a float.hex() string"


def _list_of(check, depth: int = 1):
    """A list (of lists, ``depth`` deep) whose elements pass ``check``."""
    inner = check if depth == 1 else _list_of(check, depth - 1)

    def checked(value):
        if not isinstance(value, list):
            return "a list"
        wrong = next((inner(v) for v in value if inner(v)), None)
        return wrong and f"a list of {wrong}"
    return checked


def _strings_table(value):
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return "an object of strings"
    return None


def _spec(value):
    if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("name", "sha256", "text")):
        return "an object with string name, sha256 and text"
    return None if _string(value.get("path", "")) is None else "an object whose path is a string"


def _events(value):
    fits = isinstance(value, list) and all(isinstance(e, list) and len(e) == 2 and _count(e[0]) is None
                                            and isinstance(e[1], str) for e in value)
    return None if fits else "a list of [step, text] pairs"


def _any(value):
    return None


# The metadata keys every writer (fpemu.traces.layout, .recorded, fpemu.emulate.trace, fpemu.harness) may
# write: key -> (required, check).
METADATA = {
    "fpemu_version": (True, _string), "spec": (True, _spec), "implementation": (True, _string),
    "profile": (False, _string), "params": (False, _object), "packages": (False, _strings_table),
    "device": (False, _string), "host": (False, _object), "verified": (False, _string),
    "replayed": (False, _strings_table), "tensors_from": (False, _string), "same_tensors_model": (False, _object),
    "ranks": (False, _object), "source": (False, _string), "framework": (False, _string),
    "recorder": (False, _object), "policy": (False, _object), "op_table": (False, _any),
    "telemetry": (False, _object), "model_differences": (False, _object),
    "audit_findings": (False, _object),
}

# Every field of fpemu.traces.format.FIELDS: its readable value's check, and its hex form's (None: it has none).
_FLOAT, _FLOATS, _CAST_FLOATS = (_float, _hex), (_list_of(_float), _list_of(_hex)), (_list_of(_float, 2),
                                                                                    _list_of(_hex, 2))
STEP_VALUES = {
    "scale": _FLOAT, "overflow": (_flag, None), "applied": (_flag, None), "growth_counter": (_integer, None),
    "hysteresis": (_integer, None), "update_ratio": _FLOAT, "loss": _FLOAT, "params": _FLOATS,
    "underflow_share": _FLOAT, "subnormal_share": _FLOAT, "overflow_share": _FLOAT,
    "amax": _FLOAT, "amax_used": _FLOAT, "scale_inv": _FLOAT,
    "fp8_casts": (_list_of(_string), None), "tensor_amax": _CAST_FLOATS, "tensor_scale": _CAST_FLOATS,
    "fp8_codes": (_list_of(_string), None),
    "block_input": (_string, None), "block_count": (_count, None), "element_count": (_count, None),
    "block_tensor_scale": _FLOAT, "scale_codes": (_string, None), "element_codes": (_string, None),
    "block_values": (_string, None),
    "grad_norm": _FLOAT, "lr": _FLOAT, "grad_stats": (_object, None), "shadow": (_object, None),
    "shadow_histogram": (_object, None), "microbatches": (_count, None), "compute_max": _FLOAT,
}
# Step keys outside FIELDS: fpemu.emulate's per-module underflow (reports read them; comparisons do not).
EXTRA_STEP_VALUES = {"module_underflow": _object, "module_underflow_forward": _object}

SUMMARY = {
    "attempts": _count, "completed_updates": _count, "skipped_updates": _count, "final_scale": _float,
    "final_scale_hex": _hex, "stopped_at": _optional(_count), "events": _events, "examples": _optional(_count),
    "scheduler_steps": _count, "losses_hex": _list_of(_hex),
}


def _wrong(where: str, expected: str, value) -> str:
    return f"{where}: expected {expected}, got {_json_name(value)}"


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


def _step_checks() -> dict:
    """Step key -> check: each field, its ``_hex`` form, ``step`` and the extra keys."""
    checks = {"step": _count, **EXTRA_STEP_VALUES}
    for name, (readable, exact) in STEP_VALUES.items():
        checks[name] = readable
        if exact is not None:
            checks[f"{name}_hex"] = exact
    return checks


def _steps_problem(steps) -> str | None:
    if not isinstance(steps, list):
        return _wrong("steps", "a list of step records", steps)
    if len(steps) > READ_LIMITS["steps"]:
        return f"steps: {len(steps):,} records, over the reader's {READ_LIMITS['steps']:,}"
    checks = _step_checks()
    for index, record in enumerate(steps):
        problem = _table_problem(record, f"steps[{index}]", checks, ("step",))
        if problem:
            return problem
        if record["step"] != index:
            return _wrong(f"steps[{index}].step", f"{index} (records are in step order)", record["step"])
        problem = _pairs_problem(record, f"steps[{index}]")
        if problem:
            return problem
    return None


def _same_float(readable, exact: str) -> bool:
    value, stored = float(readable), float.fromhex(exact)
    return value == stored or (value != value and stored != stored)


def _pairs_problem(table: dict, where: str) -> str | None:
    """A readable float that is not its ``_hex`` twin (comparisons read the hex, reports the readable)."""
    for key, exact in table.items():
        readable = table.get(key[:-4]) if key.endswith("_hex") else None
        if isinstance(exact, str) and readable is not None and not isinstance(readable, list) \
                and not _same_float(readable, exact):
            return f"{where}.{key[:-4]}: {_json_name(readable)} is not {key} {exact} (the two forms of one float)"
    return None


def trace_problem(body: dict) -> str | None:
    """The first field of ``body`` (a parsed trace, its checksum already checked) that does not fit the
    schema, and what it should be; None where all fit."""
    return (_table_problem(body.get("metadata"), "metadata", {k: c for k, (_, c) in METADATA.items()},
                              [k for k, (required, _) in METADATA.items() if required])
               or _steps_problem(body.get("steps"))
               or _table_problem(body.get("summary"), "summary", SUMMARY)
               or _pairs_problem(body["summary"], "summary"))


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
    rows += [("steps[i]", key, described(check)) for key, check in _step_checks().items() if key != "step"]
    rows += [("summary", key, described(check)) for key, check in SUMMARY.items()]
    return rows
