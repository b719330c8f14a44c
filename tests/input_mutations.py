"""Hostile inputs for fpemu's readers: mutated specs and mutated traces (the fuzz test's own design).

A spec mutation takes one of the committed specs, picks one key path in it (any depth, tables and list
elements included) and replaces its value with a hostile one, deletes it, or adds an unknown key beside
it; the TOML is written back by :func:`toml_text`.  A trace mutation takes a golden trace, replaces one
value (metadata, a step record's field, the summary) and recomputes the checksum (a plain sha256 that
anyone can recompute), or damages the file's bytes (truncated, deep nesting, a huge number literal).
"""

from __future__ import annotations

import datetime
import json
import math

from fpemu.traces.format import checksum

# What a hand-edited or generated file might put anywhere: the extremes of TOML's integers and floats,
# subnormals, NaN and inf, empty and nested containers, dates, unicode and paths that escape their folder.
HOSTILE_VALUES = (0, -1, 1, 2, 1 << 20, (1 << 63) - 1, -(1 << 63), 1e308, -1e308, math.nan, math.inf, -math.inf,
                  5e-324, 0.5, True, "", "x", "é../..", "../../etc/passwd", "/etc/passwd", [], [1, 2], [[]], {},
                  {"a": 1}, datetime.date(1979, 5, 27), datetime.datetime(1979, 5, 27, 7, 32))


def key_paths(value, prefix=()):
    """Every key path inside a parsed TOML (or JSON) value: tuples of keys and list indices."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield prefix + (key,)
            yield from key_paths(inner, prefix + (key,))
    elif isinstance(value, list):
        for index, inner in enumerate(value[:3]):
            yield prefix + (index,)
            yield from key_paths(inner, prefix + (index,))


def replaced(value, path, new, delete=False):
    """A deep copy of ``value`` with the item at ``path`` set to ``new`` (or removed)."""
    if not path:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    head, rest = path[0], path[1:]
    if rest:
        copy[head] = replaced(copy[head], rest, new, delete)
    elif delete:
        del copy[head]
    else:
        copy[head] = new
    return copy


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() and key.isascii() else json.dumps(key)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else "inf" if value == math.inf else "-inf" if value == -math.inf \
            else repr(value)
    if isinstance(value, (int, datetime.date)):
        return value.isoformat() if isinstance(value, datetime.date) else str(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml_value, value)) + "]"
    return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


def toml_text(raw: dict) -> str:
    """TOML for ``raw``: top-level scalars, then each table as [name] with inline values."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for key, table in raw.items():
        if isinstance(table, dict):
            lines += ["", f"[{_toml_key(key)}]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in table.items()]
    return "\n".join(lines) + "\n"


def _at(value, path):
    for key in path:
        value = value[key]
    return value


def mutated_spec(raw: dict, path: tuple, action: str, value=None) -> str:
    """The TOML of ``raw`` with ``action`` (``set`` to ``value``, ``delete``, ``add`` an unknown key beside it:
    in a list, ``set``) at ``path``."""
    if action == "delete":
        return toml_text(replaced(raw, path, None, delete=True))
    if action == "add" and isinstance(_at(raw, path[:-1]), dict):
        return toml_text(replaced(raw, path[:-1] + ("fuzz_unknown_key",), value))
    return toml_text(replaced(raw, path, value))


def resealed(body: dict) -> str:
    """The trace text of ``body`` with its checksum recomputed (what a tamperer can always do)."""
    body = {key: value for key, value in body.items() if key != "checksum"}
    return json.dumps({**body, "checksum": checksum(body)}, sort_keys=True, indent=1)


# Files no writer produces, each damaged in one way a reader must bound before parsing.
DAMAGED_TRACES = {
    "truncated": lambda text: text[: len(text) // 2],
    "garbage": lambda text: "\x00\xff garbage \u2603" * 10,
    "empty": lambda text: "",
    "deep_list": lambda text: "[" * 100_000 + "]" * 100_000,
    "deep_object": lambda text: '{"a":' * 50_000 + "1" + "}" * 50_000,
    "huge_int": lambda text: text.replace('"version": 1', '"version": 1' + "0" * 5000, 1),
    "huge_float": lambda text: text.replace('"step": 0', '"step": 0.' + "1" * 5000, 1),
    "nan_literal": lambda text: text.replace('"step": 0', '"step": NaN', 1),
    "bare_list": lambda text: "[1, 2, 3]",
    "bare_string": lambda text: '"fpemu-trace"',
}


# Mutations that leave every value well-typed and break what the values mean together (a trace of no
# kind, a record short of a field, counts that are not the steps', a spec whose digest is not its text's): a
# reader must refuse each one, naming the field.  Each takes (body, another golden's body, an index) and says
# whether it applied.
def _drop_field(body, other, index):
    steps = body["steps"]
    keys = [k for k in steps[index % len(steps)] if k != "step" and not k.endswith("_hex")]
    if len(steps) < 2 or not keys:
        return False
    key = keys[index % len(keys)]
    steps[index % len(steps)].pop(key)
    steps[index % len(steps)].pop(f"{key}_hex", None)
    return True


def _foreign_field(body, other, index):
    first = other["steps"][0] if other["steps"] else {}
    extra = [k for k in first if k not in body["steps"][0] and not k.endswith("_hex")]
    if not extra:
        return False
    key = extra[index % len(extra)]
    body["steps"][index % len(body["steps"])].update({k: first[k] for k in (key, f"{key}_hex") if k in first})
    return True


def _negative(body, other, index):
    record = body["steps"][index % len(body["steps"])]
    keys = [k for k in ("scale", "amax", "amax_used", "scale_inv", "growth_counter", "block_count", "element_count")
            if isinstance(record.get(k), (int, float)) and not isinstance(record.get(k), bool)]
    if not keys:
        return False
    key = keys[index % len(keys)]
    record[key] = -abs(record[key]) - 1
    if f"{key}_hex" in record:
        record[f"{key}_hex"] = float(record[key]).hex()
    return True


def _miscount(body, other, index):
    keys = [k for k in ("attempts", "completed_updates", "skipped_updates") if k in body["summary"]]
    if not keys:
        return False
    key = keys[index % len(keys)]
    body["summary"][key] += 1
    return True


def _edited_spec(body, other, index):
    body["metadata"]["spec"]["text"] += "\n# edited"
    return True


def _dropped_step(body, other, index):
    if len(body["steps"]) < 2:
        return False
    body["steps"].pop()
    return True


MEANINGLESS = {"drop_field": _drop_field, "foreign_field": _foreign_field, "negative": _negative,
               "miscount": _miscount, "edited_spec": _edited_spec, "dropped_step": _dropped_step}
