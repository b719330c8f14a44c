"""Load TOML scenario specs; every error names the file, the key and what was expected.

A spec is one scenario per file; its top-level tables name its kind (fpemu.kinds.KINDS: ``[ranks]``,
``[recipe]``, ``[fp8_training]``, ``[blocks]``, ``[step]``, else a scaler spec with ``[scaler]`` and
``[overflow]``), and that kind's parser validates the rest (each kind's module documents its spec: e.g.
``python -m pydoc fpemu.kinds.scaler.spec``).  Every spec may have::

    name = "torch-growth-timing"          # optional, defaults to the file name
    description = "GradScaler grows on the N-th good step"
    steps = 16
    [record]
    fields = ["scale", "overflow", "applied", "growth_counter"]
    [implementations.torch]               # a real implementation to drive, with its params and
                                          # a declared divergence (expect_divergence)
"""

from __future__ import annotations

import pathlib

from fpemu.fileio import read_bounded
from fpemu.kinds.bounds import MAX_SPEC_BYTES
from fpemu.kinds import kind_of_spec, spec_tables
from fpemu.kinds.scenario import ScenarioBase
from fpemu.kinds.schema import Checker, SpecError, parse_toml

COMMON_KEYS = {"name", "description", "steps", "record", "implementations"}


def parse_spec(text: str, path: str = "<string>") -> ScenarioBase:
    """Validate TOML ``text`` and build its scenario with the parser of the kind its tables name."""
    check = Checker(path)
    raw = parse_toml(text, path)
    check.table(raw, "", COMMON_KEYS | spec_tables())
    kind = kind_of_spec(raw)
    check.kind = kind.name  # some bounds differ by kind (fpemu.kinds.bounds)
    return kind.parse(check, raw, text, path)


def load_spec(path) -> ScenarioBase:
    """Load and validate one spec file."""
    data = read_bounded(path, SpecError, MAX_SPEC_BYTES)
    try:
        return parse_spec(data.decode("utf-8"), str(path))
    except UnicodeDecodeError as problem:
        raise SpecError(f"{path}: cannot read: not UTF-8 ({problem.reason} at byte {problem.start})") from None


def find_specs(paths) -> list:
    """Spec files named by ``paths``: files as given, folders searched for ``*.toml`` (sorted)."""
    found = []
    for path in map(pathlib.Path, paths):
        if path.is_dir():
            found.extend(sorted(path.rglob("*.toml")))
        elif path.is_file():
            found.append(path)
        else:
            raise SpecError(f"{path}: no such spec file or folder")
    if not found:
        raise SpecError(f"no *.toml specs under {', '.join(map(str, paths))}")
    return found


def load_specs(paths) -> list:
    """Every spec under ``paths``; two specs with one name (their traces would collide) are an error."""
    scenarios, seen = [], {}
    for path in find_specs(paths):
        scenario = load_spec(path)
        if scenario.name in seen:
            raise SpecError(f"{path}: name {scenario.name!r} is also the name of {seen[scenario.name]}; "
                            "spec names must be unique (set `name = ...` in one of them)")
        seen[scenario.name] = path
        scenarios.append(scenario)
    return scenarios
