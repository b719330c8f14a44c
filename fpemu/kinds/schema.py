"""What every spec kind validates with: a checker that names the file and the key, the
[implementations] tables, the [record] fields and the scenario's common fields.

A scenario kind's parser (fpemu.kinds) takes a :class:`Checker` and builds its scenario with
:func:`build_scenario`; every failure names the file and the key.
"""

from __future__ import annotations

import hashlib
import math
import pathlib
import re
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from fpemu.adapters import resolve
from fpemu.kinds.bounds import MAX_SPEC_BYTES, bound_for
from fpemu.errors import FpemuInputError
from fpemu.kinds.scenario import ExpectedDivergence
from fpemu.traces.fields import EXACT_FIELDS, ULP_FIELDS, fields_recorded_by


class SpecError(FpemuInputError):
    """A spec file that cannot be used; the message names the file and the key."""


def parse_toml(text: str, path: str) -> dict:
    """The TOML table of a spec's ``text``; a SpecError names ``path`` when it is not valid TOML."""
    if len(text) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: {len(text):,} characters, over the {MAX_SPEC_BYTES:,} a spec may hold "
                        "(fpemu.kinds.bounds)")
    try:
        return tomllib.loads(text)
    except ValueError as error:  # TOMLDecodeError, and an integer literal past Python's 4,300 digits
        raise SpecError(f"{path}: not valid TOML: {error}") from None
    except RecursionError:
        raise SpecError(f"{path}: not valid TOML: arrays or tables nested too deep to read") from None


def _short(value) -> str:
    """``repr(value)``, cut to a readable length (a huge literal is named, not printed)."""
    big = isinstance(value, int) and value.bit_length() > 100
    text = f"an integer of {value.bit_length()} bits" if big else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Checker:
    """Validation helpers that name the file and the key.  ``fail`` stops a check; ``attempt``
    runs one independent part of the spec and records its failure, so a spec's independent
    mistakes are all reported at once by ``raise_errors``."""

    def __init__(self, path: str):
        self.path = path
        self.errors = []
        self.kind = ""  # the scenario kind, once known: some bounds differ by kind (fpemu.kinds.bounds)

    def fail(self, key: str, message: str):
        raise SpecError(f"{self.path}: {key}: {message}")

    def attempt(self, check, *args):
        """``check(*args)``, or None when it fails (the failure is kept for ``raise_errors``)."""
        try:
            return check(*args)
        except SpecError as error:
            self.errors.append(str(error))
            return None

    def raise_errors(self) -> None:
        if self.errors:
            raise SpecError("\n".join(self.errors))

    def table(self, value, key: str, allowed) -> dict:
        if not isinstance(value, dict):
            self.fail(key, f"expected a table, got {type(value).__name__}")
        unknown = sorted(set(value) - set(allowed))
        if unknown:
            self.fail(f"{key}.{unknown[0]}" if key else unknown[0],
                      f"unknown key; allowed keys: {', '.join(sorted(allowed))}")
        return value

    def integer(self, value, key: str, minimum: int) -> int:
        """An integer >= ``minimum`` and within the bound of ``key`` in fpemu.kinds.bounds (before anything
        allocates or loops over it)."""
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, f"expected an integer, got {_short(value)}")
        if value < minimum:
            self.fail(key, f"expected an integer >= {minimum}, got {_short(value)}")
        return self.bounded(value, key)

    def parameter(self, value, key: str):
        """A scaler's or recipe's parameter: a number, true/false or a string (the model checks which), an
        integer within its row of fpemu.kinds.bounds.BOUNDS."""
        if not isinstance(value, (int, float, str)):
            self.fail(key, f"expected a number, true/false or a string, got {_short(value)}")
        return self.bounded(value, key)

    def bounded(self, value, key: str):
        """``value``, or a failure naming ``key`` when it is an integer outside its row of
        fpemu.kinds.bounds.BOUNDS (other values are left to the check that knows their kind)."""
        if isinstance(value, bool) or not isinstance(value, int):
            return value
        bound = bound_for(key)
        if not bound.minimum <= value <= bound.limit(self.kind):
            kind = f" for a {self.kind} spec" if isinstance(bound.maximum, dict) and self.kind else ""
            self.fail(key, f"expected an integer in {bound.minimum:,}..{bound.limit(self.kind):,}{kind} "
                           f"({bound.why}), got {_short(value)}")
        return value

    def number(self, value, key: str, low: float, high: float) -> float:
        """A finite number in [low, high], as a float (-0.0 read as 0.0: a bound's sign is its value's, and
        numpy's uniform(-0.0, 0.0) refuses its own interval)."""
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value):
            self.fail(key, f"expected a finite number, got {_short(value)}")
        if not low <= value <= high:
            self.fail(key, f"expected a number in [{low}, {high}], got {_short(value)}")
        return float(value) + 0.0

    def choice(self, value, key: str, options) -> str:
        if value not in options:
            self.fail(key, f"expected one of {', '.join(options)}, got {value!r}")
        return value

    def string(self, value, key: str) -> str:
        if not isinstance(value, str):
            self.fail(key, f"expected a string, got {value!r}")
        return value

    def source(self, raw, table: str, options, keys_by_kind: dict) -> str:
        """The ``source`` of a [table] whose values come from one of ``options``; the table may
        hold that source's keys (``keys_by_kind[source]``) only."""
        if not isinstance(raw, dict) or "source" not in raw:
            self.fail(f"{table}.source", f"expected one of {', '.join(options)}")
        kind = self.choice(raw["source"], f"{table}.source", options)
        self.table(raw, table, keys_by_kind[kind] | {"source"})
        return kind


def _finite(value) -> bool:
    """Whether a TOML number is a finite float (an integer past float's range is not: float() overflows)."""
    return abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value)


def implementation_tables(check: Checker, raw, kind: str):
    """Yield (key, adapter, device, body, declared divergence) for each [implementations.X] table
    naming an adapter of ``kind``."""
    if not isinstance(raw, dict):
        check.fail("implementations", "expected a table of implementation tables")
    other = {"scaler": "[step]", "step": "scaler", "recipe": "scaler and [step]",
             "blocks": "scaler, [step] and [recipe]"}[kind]
    for name, body in raw.items():
        key = f"implementations.{name}"
        try:
            adapter, device = resolve(name, kind)
        except ValueError as wrong:
            check.fail(key, f"{wrong} (add @cuda to run on the GPU; the other adapters run {other} specs)")
        check.table(body, key, {"params", "expect_divergence"})
        yield key, adapter, device, body, expected_divergence(check, body, key)


def expected_divergence(check: Checker, body: dict, key: str):
    if "expect_divergence" not in body:
        return None
    key = f"{key}.expect_divergence"
    raw = check.table(body["expect_divergence"], key, {"step", "field", "reason"})
    for required in ("step", "field", "reason"):
        if required not in raw:
            check.fail(f"{key}.{required}", "missing required key (a declared divergence names its first "
                                            "divergent step and field, and why)")
    return ExpectedDivergence(step=check.integer(raw["step"], f"{key}.step", 0),
                              field=check.choice(raw["field"], f"{key}.field", EXACT_FIELDS + ULP_FIELDS + ("steps",)),
                              reason=check.string(raw["reason"], f"{key}.reason"))


def record_fields(check: Checker, raw: dict, kind: str) -> tuple:
    available = fields_recorded_by(kind)
    record = check.table(raw.get("record", {}), "record", {"fields"})
    fields = record.get("fields", list(fields_recorded_by(kind, by_default=True)))
    if not isinstance(fields, list) or not fields:
        check.fail("record.fields", "expected a non-empty list of field names")
    for index, field in enumerate(fields):
        check.choice(field, f"record.fields[{index}]", available)
    return tuple(fields)


_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
MAX_NAME_CHARS = 128  # "<name>.<implementation>.obtained.json" stays within a file name's 255 bytes


def build_scenario(check: Checker, kind, raw: dict, text: str, path: str, **fields):
    name = check.string(raw.get("name", pathlib.Path(path).stem), "name")
    if not _NAME.fullmatch(name) or ".." in name:
        check.fail("name", f"expected letters, digits, '_', '.' and '-' (it names the trace files), got {name!r}")
    if len(name) > MAX_NAME_CHARS:
        check.fail("name", f"expected at most {MAX_NAME_CHARS} characters (it names the trace files, and a file "
                           f"name holds 255 bytes with the implementation's name beside it), got {len(name)}")
    return kind(name=name,
                    description=check.string(raw.get("description", ""), "description"),
                    path=str(path), sha256=hashlib.sha256(text.encode()).hexdigest(), text=text, **fields)
