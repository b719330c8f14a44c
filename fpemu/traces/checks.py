"""Value checks for trace fields: each takes a parsed JSON value and returns None where it fits, else what was
expected (``"an integer >= 0"``), the phrase an error message ends with.

The step-field table (fpemu.traces.fields) names one check per field; fpemu.traces.schema applies them.

Example:
  >>> at_least(0)(-1.5), at_least(0)("nan"), share(0.25), list_of(float_hex)(["0x1p+0", 2])
  ('a number >= 0 or "nan", "inf"', None, None, 'a list of a float.hex() string')
"""

from __future__ import annotations

import json


def json_name(value) -> str:
    """``value`` as a JSON reader sees it (null, true, an object), cut short."""
    text = json.dumps(value) if isinstance(value, (type(None), bool)) else repr(value)
    kind = {dict: "an object", list: "a list"}.get(type(value))
    return kind or (text if len(text) <= 60 else text[:57] + "...")


def string(value):
    return None if isinstance(value, str) else "a string"


def integer(value):
    return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"


def count(value):
    return None if integer(value) is None and 0 <= value <= 1 << 62 else "an integer >= 0"


def flag(value):
    return None if isinstance(value, bool) else "true or false"


def table(value):
    return None if isinstance(value, dict) else "an object"


def optional(check):
    return lambda value: None if value is None else check(value) and f"null or {check(value)}"


def number(value):
    """A readable float: a number, or "nan", "inf", "-inf" (JSON has none of them)."""
    fits = (isinstance(value, (int, float)) and not isinstance(value, bool)) or value in ("nan", "inf", "-inf")
    return None if fits else 'a number or "nan", "inf", "-inf"'


def at_least(low: float):
    """A readable float >= ``low``, or NaN (a run that went non-finite records what it saw), or +inf."""
    def checked(value):
        fits = number(value) is None and (value == "nan" or float(value) >= low)
        return None if fits else f'a number >= {low:g} or "nan", "inf"'
    return checked


def share(value):
    """A fraction of elements: 0 <= value <= 1."""
    return None if number(value) is None and 0 <= float(value) <= 1 else "a share between 0 and 1"


def float_hex(value):
    """``float.hex()`` of a float, the form comparisons read."""
    if isinstance(value, str) and len(value) <= 32:
        try:
            float.fromhex(value)
            return None
        except (ValueError, OverflowError):  # '0x1p+99999' is past float64
            pass
    return "a float.hex() string"


def list_of(check, depth: int = 1):
    """A list (of lists, ``depth`` deep) whose elements pass ``check``."""
    inner = check if depth == 1 else list_of(check, depth - 1)

    def checked(value):
        if not isinstance(value, list):
            return "a list"
        wrong = next((inner(v) for v in value if inner(v)), None)
        return wrong and f"a list of {wrong}"
    return checked


def strings_table(value):
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return "an object of strings"
    return None


PARAM_INTEGER_LIMIT = 1 << 32  # past every integer a spec may give (a 32-bit seed; counts stop at 10^9)
PARAM_TEXT_LIMIT = 256  # a parameter's name or text value (a profile's mode, a model's one-line description)


def _param_value(value) -> bool:
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return -PARAM_INTEGER_LIMIT <= value <= PARAM_INTEGER_LIMIT
    if isinstance(value, float):
        return True  # JSON holds no NaN or inf: the reader refused them
    if isinstance(value, str):
        return len(value) <= PARAM_TEXT_LIMIT
    return isinstance(value, list) and all(isinstance(v, str) and len(v) <= PARAM_TEXT_LIMIT for v in value)


def params(value):
    """A scaler's or recipe's parameters: name -> a number (an integer within 2^32 of 0), true/false, null,
    a short string or a list of them (the traces fpemu writes hold nothing else)."""
    fits = (isinstance(value, dict) and all(len(k) <= PARAM_TEXT_LIMIT for k in value)
            and all(_param_value(v) for v in value.values()))
    return None if fits else (f"an object of numbers (integers within 2^32 of 0), true/false, null, strings of "
                              f"at most {PARAM_TEXT_LIMIT} characters or lists of them")


def file_name(value):
    """A name that becomes part of a file name (a spec's, an implementation's): no folder in it, none above."""
    fits = isinstance(value, str) and value and not value.startswith(".") and not any(c in value for c in "/\\\0")
    return None if fits else "a name without '/', '\\' or a leading '.' (it names files)"


def spec(value):
    if not isinstance(value, dict) or not all(isinstance(value.get(k), str) for k in ("name", "sha256", "text")):
        return "an object with string name, sha256 and text"
    if file_name(value["name"]):
        return f"an object whose name is {file_name(value['name'])}"
    return None if string(value.get("path", "")) is None else "an object whose path is a string"


def events(value):
    fits = isinstance(value, list) and all(isinstance(e, list) and len(e) == 2 and count(e[0]) is None
                                            and isinstance(e[1], str) for e in value)
    return None if fits else "a list of [step, text] pairs"


def anything(value):
    return None


def groups_of(fields: dict, floats: tuple = ()):
    """An object of group name -> an object holding exactly ``fields`` (key -> check) and, for each name in
    ``floats``, its ``<name>_hex`` form: a recorded step's per-group statistics."""
    keys = set(fields) | {f"{name}_hex" for name in floats}

    def checked(value):
        expected = f"an object of group -> {{{', '.join(sorted(keys))}}}"
        if not isinstance(value, dict):
            return expected
        for name, group in value.items():
            if not isinstance(group, dict) or set(group) != keys:
                return f"{expected} (group {json_name(name)}: {json_name(group)} has other keys)"
            wrong = next((f"{key}: {fields[key](group[key])}" for key in fields if fields[key](group[key])), None)
            wrong = wrong or next((f"{key}_hex: a float.hex() string" for key in floats
                                   if float_hex(group[f"{key}_hex"])), None)
            if wrong:
                return f"{expected} (group {json_name(name)}, {wrong})"
        return None
    return checked


def binade_rows(value):
    """A shadow histogram's binades: an object of binade (an integer as a string) -> a non-empty list of counts."""
    fits = isinstance(value, dict) and all(
        isinstance(key, str) and key.lstrip("-").isdigit() and isinstance(row, list) and row
        and all(count(n) is None for n in row) for key, row in value.items())
    return None if fits else "an object of binade -> a list of counts"
