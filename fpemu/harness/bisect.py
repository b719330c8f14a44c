"""Find the releases where a recorded behaviour changed: ``fpemu bisect``.

A behaviour may change and change back (JAX's fp16 step numerics in 0.4.13 equal those of
0.4.33 and 0.10.2, with other behaviours between), so nothing here assumes a change is
permanent.  :func:`bisect_versions` first tests every ``stride``-th released version (and the
last), then, wherever two neighbouring tested versions behave differently, tests the middle
untested version between them, until each change lies between two neighbouring releases.

Cost: about ``n / stride + changes * log2(stride)`` environments for ``n`` versions; with
``stride=1`` every version is tested (``n`` environments) and nothing is assumed.  The
assumption of ``stride > 1`` (:func:`assumption`): a gap whose two ends behave alike holds no
change, so a change that flips back within the gap is missed; inside a gap whose ends differ,
bisection follows one path, so a change and its flip back off that path are missed too.

A version that pip cannot install (no wheel for this Python, a dependency that does not
resolve) is recorded as ``cannot install`` and left out of the comparison: its neighbours are
compared instead, and a change next to it is reported with the versions between that have no
result.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import tempfile
from typing import Callable, Optional

from fpemu.errors import FpemuInputError
from fpemu.harness.matrix import (CANNOT_INSTALL, UNKNOWN, Column, MatrixPlan, cell_key, column_cell, matrix_results,
                                  package_set, planned_keys, record_column, reference_traces, row_keys)

PIP_TIMEOUT = 300.0


def _pip(*args) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                              timeout=PIP_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise FpemuInputError(f"pip {' '.join(args)} ran past {PIP_TIMEOUT:.0f} s (is the package index reachable?)") \
            from None


def _listed(text: str, marker: str) -> list:
    found = re.search(re.escape(marker) + r"\s*([^)\n]*)", text)
    return [v.strip() for v in found.group(1).split(",") if v.strip()] if found else []


def pip_versions(package: str) -> list:
    """Every version of ``package`` pip finds for this Python (``pip index versions``; where pip has no
    ``index`` command, the versions a failing ``pip download`` lists), oldest first."""
    listed = _listed(_pip("index", "versions", package).stdout, "Available versions:")
    if not listed:
        with tempfile.TemporaryDirectory() as scratch:
            probe = _pip("download", "--no-deps", "--dest", scratch, f"{package}===fpemu-list-versions")
        listed = _listed(probe.stdout + probe.stderr, "(from versions:")
    from packaging.version import InvalidVersion, Version
    valid = []
    for version in set(listed):
        try:
            valid.append((Version(version), version))
        except InvalidVersion:  # "none", or a pre-PEP 440 version pip would not pick either
            continue
    if not valid:
        raise FpemuInputError(f"{package}: pip finds no released version (is it on the index pip uses?)")
    return [version for _, version in sorted(valid)]


def versions_in_range(versions, low: Optional[str] = None, high: Optional[str] = None, pre: bool = False) -> list:
    """The versions from ``low`` to ``high`` (inclusive), oldest first; pre-releases only if ``pre``.

    Example:
      >>> versions_in_range(["0.4.30", "0.4.31", "0.5.0rc1", "0.5.0"], "0.4.31")
      ['0.4.31', '0.5.0']
    """
    from packaging.version import InvalidVersion, Version
    try:
        lo, hi = (Version(v) if v else None for v in (low, high))
    except InvalidVersion as error:
        raise FpemuInputError(f"--from/--to: {error}") from None
    chosen = [v for v in versions if (pre or not Version(v).is_prerelease) and (lo is None or Version(v) >= lo)
              and (hi is None or Version(v) <= hi)]
    if len(chosen) < 2:
        raise FpemuInputError(f"versions {low or 'first'} to {high or 'last'}: {len(chosen)} released version(s) "
                              f"in that range ({', '.join(chosen) or 'none'}); a bisection needs two")
    return sorted(chosen, key=Version)


def assumption(stride: int) -> str:
    """What a bisection with ``stride`` takes for granted, in words for the report."""
    if stride == 1:
        return ("none: every released version in the range was tested (stride 1), so every change and "
                "every flip back between neighbouring releases is found.")
    return (f"every {stride}th version was tested first, then each gap whose two ends behave differently was "
            "bisected until its change lies between neighbouring releases. A gap whose ends behave alike is "
            f"taken to hold no change, so a change that flips back within the {stride - 1} versions of such a gap "
            "is missed; inside a gap whose ends differ bisection follows one path, so a change and its flip back "
            "off that path are missed too. `--stride 1` tests every version.")


@dataclasses.dataclass(frozen=True)
class ChangePoint:
    """A row's behaviour differs between two versions that ran; ``untested`` are the versions between
    them without a result (none: they are neighbouring releases)."""

    spec: str
    implementation: str
    before: str
    after: str
    untested: tuple

    def as_dict(self) -> dict:
        return {"spec": self.spec, "implementation": self.implementation, "before": self.before,
                "after": self.after, "adjacent": not self.untested, "untested": list(self.untested)}


@dataclasses.dataclass(frozen=True)
class Bisection:
    """What :func:`bisect_versions` did: the versions considered, the Column of each version tested
    (oldest first), and the change points of every row."""

    versions: tuple
    tested: dict
    changes: tuple
    stride: int

    @property
    def cannot_install(self) -> list:
        return [v for v, column in self.tested.items() if column.problem_status == CANNOT_INSTALL]


def _ran(column: Column) -> bool:
    return column.problem_status != CANNOT_INSTALL


def _differs(a: Column, b: Column) -> bool:
    """Whether any (spec, implementation) behaves differently in the two columns (a cell that says
    nothing about the release, e.g. skipped, is no difference)."""
    for key in row_keys([a, b]):
        ca, cb = column_cell(a, key), column_cell(b, key)
        if ca.status not in UNKNOWN and cb.status not in UNKNOWN and cell_key(ca) != cell_key(cb):
            return True
    return False


def _next_probe(versions, tested) -> Optional[str]:
    """The middle untested version of the first gap between two ran versions that behave differently."""
    ran = [v for v in versions if v in tested and _ran(tested[v])]
    for a, b in zip(ran, ran[1:]):
        if _differs(tested[a], tested[b]):
            between = [v for v in versions[versions.index(a) + 1:versions.index(b)] if v not in tested]
            if between:
                return between[len(between) // 2]
    return None


def _change_points(versions, tested) -> tuple:
    ran = [v for v in versions if v in tested and _ran(tested[v])]
    columns = [tested[v] for v in ran]
    points = []
    for key in row_keys(columns):
        last = None
        for version in ran:
            cell = column_cell(tested[version], key)
            if cell.status in UNKNOWN:
                continue
            if last is not None and cell_key(last[1]) != cell_key(cell):
                between = versions[versions.index(last[0]) + 1:versions.index(version)]
                points.append(ChangePoint(key[0], key[1], last[0], version, tuple(between)))
            last = (version, cell)
    return tuple(points)


def bisect_versions(versions, probe: Callable[[str], Column], stride: int = 4,
                    progress=lambda done, label: None) -> Bisection:
    """Find every change point of the probed behaviour over ``versions`` (oldest first).

    Args:
      versions: the released versions to search, oldest first.
      probe: version -> the Column recorded in an environment of that version (a column whose
        ``problem_status`` is ``cannot install`` has no result).
      stride: test every ``stride``-th version first (1: every version; see :func:`assumption`).
      progress: called with (versions tested so far, the version being tested).

    Returns:
      A :class:`Bisection`.

    Example::

        found = bisect_versions(["0.4.31", "0.4.33", "0.4.34", "0.4.35"], probe, stride=3)
        # tests 0.4.31 and 0.4.35 first; they differ, so 0.4.33 or 0.4.34 next, ...
    """
    versions = list(versions)
    if stride < 1:
        raise FpemuInputError(f"--stride {stride}: expected 1 or more")
    tested = {}

    def test(version):
        progress(len(tested), version)
        tested[version] = probe(version)

    for version in dict.fromkeys(versions[::stride] + versions[-1:]):
        test(version)
    while (version := _next_probe(versions, tested)) is not None:
        test(version)
    ordered = {v: tested[v] for v in versions if v in tested}
    return Bisection(tuple(versions), ordered, _change_points(versions, ordered), stride)


def bisection_results(name: str, package: str, plan: MatrixPlan, found: Bisection) -> dict:
    """The results file of a bisection: the tested versions as matrix columns, and what it did."""
    columns = list(found.tested.values())
    results = matrix_results(name, columns, reference_traces(plan.specs), plan.description, planned_keys(plan))
    results["bisect"] = {"package": package, "versions": list(found.versions), "tested": list(found.tested),
                         "cannot_install": found.cannot_install, "stride": found.stride,
                         "python": results["python"], "assumption": assumption(found.stride),
                         "changes": [c.as_dict() for c in found.changes]}
    return results


def bisect_package(plan: MatrixPlan, package: str, versions, stride: int, traces_root, fixed=(),
                   progress=lambda done, label: None) -> Bisection:
    """:func:`bisect_versions` with each version recorded in an environment of ``package==version``
    (with its companions and ``fixed``) by :func:`fpemu.harness.matrix.record_column`."""
    return bisect_versions(versions, lambda v: record_column(plan, package_set(package, v, fixed), traces_root),
                           stride, progress)
