"""pytest plugin (registered as the ``fpemu`` pytest11 entry point).

Fixtures:
  ``assert_trace_matches(trace, name=None, expect_divergence=None, recorded=False, level=None, ulps=None)``:
  returns compare_traces's Verdict (level bits) or trace_changes's TraceChanges (the others); compare a trace with the golden trace ``<golden dir>/<name or spec name>.json`` at a golden level
  (:data:`LEVELS`: ``bits``, the default, ``numerics`` within ``ulps``, or ``trajectory``); fails with a
  short message (the first difference, then a table of the fields that differ) and writes what it got
  beside the golden as ``<name>.obtained.json`` (removed again once the trace matches or the golden is
  regenerated: ignore ``*.obtained.json`` in git).  Only a reference trace, or a recorded run where the
  test passes ``recorded=True``, may become a golden (traces of real implementations are otherwise only
  ever compared); a recorded golden is written without the ``host`` metadata, which would change from
  machine to machine.
  ``assert_data_matches(data, name)``: the same for plain data (dicts, lists, numbers, strings, numpy
  arrays), stored losslessly in ``<name>.data.json`` and compared bit for bit (:mod:`fpemu.traces.plain`).
  ``fpemu_golden(name)``: load a golden trace.

Modes (as pytest-regressions' ``--force-regen`` and ``--regen-all``), for the goldens a test may write:
  ``--fpemu-update-golden`` (also spelled ``--fpemu-regen-all``): write the golden and pass.
  ``--fpemu-force-regen``: compare; where the golden is missing, corrupted or differs, rewrite it and
  fail, so the run shows what was regenerated and the next run checks it.
Golden files no test used (orphans, syrupy's unused snapshots) fail a run of every test, named at its end;
after a run with skipped tests they are named without failing it (a skipped test may use them), after a
run that selected tests (-k, -m, deselection, named files) nothing is said.
  ``--fpemu-warn-orphans``: name them without failing (as syrupy's ``--snapshot-warn-unused``).
  ``--fpemu-delete-orphans``: delete them (only after a run of every test, none skipped).

Ini options (relative to the rootdir): ``fpemu_golden_dir`` (default ``tests/golden``),
``fpemu_golden_level`` (default ``bits``; ``--fpemu-golden-level`` overrides it for a run),
``fpemu_golden_ulps`` (default 0: the ulps ``numerics`` allows) and ``fpemu_orphans`` (``fail``, the
default, or ``warn``).

Markers: ``fpemu_NAME`` for every adapter NAME in ``fpemu.adapters.ADAPTERS`` (``fpemu_torch``,
``fpemu_flax``, ``fpemu_jax_step``, ...): the test drives that real implementation and is
skipped, with the reason, where its packages are missing.
"""

from __future__ import annotations

import pathlib

import pytest

_SHOWN_LINES = 12  # lines of a failure's details (the obtained file has everything)
_USED = pytest.StashKey[set]()
_ORPHAN_LINE = pytest.StashKey[str]()
_SKIPPED = "tests were skipped: they may use them"


def _unhex(exact):
    return [_unhex(v) for v in exact] if isinstance(exact, list) else float.fromhex(exact)


def leaves(value, prefix: str = "") -> dict:
    """path -> leaf of a nested field value (``grad_stats``: a dict per group), keys sorted, floats read
    exactly from their ``_hex`` twins.

    Example:
      >>> leaves({"w": {"max_abs": 8.0, "max_abs_hex": "0x1.0p+3", "elements": 2}})
      {'w.elements': 2, 'w.max_abs': 8.0}
    """
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{prefix}[{i}]").items()}
    if not isinstance(value, dict):
        return {prefix: value}
    out = {}
    for key in sorted(value):
        if f"{key}_hex" in value:
            continue  # the readable twin of an exact value
        exact = key.endswith("_hex")
        name = key[:-len("_hex")] if exact else key
        out.update(leaves(_unhex(value[key]) if exact else value[key], f"{prefix}.{name}" if prefix else name))
    return out


def _nested_ulp(expected, got):
    """The largest float32 ulp distance between two nested values of one shape, None where their shape
    or a non-float leaf differs."""
    from fpemu.compare.diff import bit_equal, ulp_distance_f32
    a, b = leaves(expected), leaves(got)
    if a.keys() != b.keys():
        return None
    worst = 0
    for key, x in a.items():
        if isinstance(x, float) and isinstance(b[key], float):
            worst = max(worst, ulp_distance_f32(x, b[key]))
        elif not bit_equal(x, b[key]):
            return None
    return worst


def _field_ulp(golden, trace, diff):
    """A numeric field's largest ulp distance over every step (trace_changes measures flat fields; this
    also measures nested ones), None where it is not measurable in ulps."""
    from fpemu.traces import decode_value
    if diff.max_ulp is not None or diff.field == "steps":
        return diff.max_ulp
    worst = 0
    for before, after in zip(golden.steps, trace.steps):
        distance = _nested_ulp(decode_value(before, diff.field), decode_value(after, diff.field))
        if distance is None:
            return None
        worst = max(worst, distance)
    return worst


def _numerics(golden, trace, changes, ulps: int):
    """Fails where the trajectory changed or a numeric field moved by more than ``ulps`` float32 ulps (or
    by what ulps do not measure: another shape, an integer or string that differs)."""
    from fpemu.compare.changes import TRAJECTORY
    if changes.kind == TRAJECTORY:
        return "the trajectory changed"
    over = []
    for diff in changes.fields:
        distance = _field_ulp(golden, trace, diff)
        if distance is None or distance > ulps:
            over.append(f"{diff.field} (not measurable in ulps)" if distance is None else
                        f"{diff.field} by {distance} ulp")
    return f"numerics beyond {ulps} ulp: {', '.join(over)}" if over else None


def _trajectory(golden, trace, changes, ulps: int):
    """Fails only where the trajectory changed: scales, overflow verdicts, skips, the scaler's counters,
    the summary; loss and gradient statistics may differ."""
    from fpemu.compare.changes import TRAJECTORY
    return "the trajectory changed" if changes.kind == TRAJECTORY else None


# level -> a check of trace_changes(golden, trace) (None: bits, compare_traces with known divergences)
LEVELS = {"bits": None, "numerics": _numerics, "trajectory": _trajectory}


def pytest_addoption(parser):
    group = parser.getgroup("fpemu")
    group.addoption("--fpemu-update-golden", "--fpemu-regen-all", action="store_true", default=False,
                    dest="fpemu_update_golden",
                    help="rewrite golden files with what the tests produce (reference traces, plain data, and "
                         "recorded runs where the test allows it), and pass")
    group.addoption("--fpemu-force-regen", action="store_true", default=False,
                    help="rewrite a golden file that is missing, corrupted or differs, and fail that test")
    group.addoption("--fpemu-golden-level", choices=sorted(LEVELS), default=None,
                    help="compare every golden trace at this level this run (default: the ini option "
                         "fpemu_golden_level, else bits)")
    group.addoption("--fpemu-delete-orphans", action="store_true", default=False,
                    help="delete golden files no test used (only after a run of every test, none skipped)")
    group.addoption("--fpemu-warn-orphans", action="store_true", default=False,
                    help="report golden files no test used without failing the run (ini: fpemu_orphans = warn)")
    parser.addini("fpemu_golden_dir", "folder of golden files for assert_trace_matches and assert_data_matches",
                  default="tests/golden")
    parser.addini("fpemu_golden_level", f"golden level of assert_trace_matches: {', '.join(LEVELS)}",
                  default="bits")
    parser.addini("fpemu_golden_ulps", "float32 ulps the numerics level allows", default="0")
    parser.addini("fpemu_orphans", "golden files no test used, after a run of every test: fail (the default) or warn",
                  default="fail")


def _marker_names():
    from fpemu.adapters import ADAPTERS
    return {f"fpemu_{name}": name for name in ADAPTERS}


def pytest_configure(config):
    if config.getini("fpemu_orphans") not in ("fail", "warn"):
        raise pytest.UsageError(f"ini option fpemu_orphans: expected fail or warn, got {config.getini('fpemu_orphans')!r}")
    config.stash[_USED] = set()
    for marker, name in _marker_names().items():
        config.addinivalue_line("markers", f"{marker}: drives the real {name} implementation; skipped without it")


def pytest_runtest_setup(item):
    from fpemu.adapters import unavailable_reason
    for marker, name in _marker_names().items():
        if item.get_closest_marker(marker) is not None:
            reason = unavailable_reason(name)
            if reason:
                pytest.skip(f"{name}: {reason}")


def _golden_dir(config) -> pathlib.Path:
    return pathlib.Path(config.rootpath) / config.getini("fpemu_golden_dir")


@pytest.fixture
def fpemu_golden(request):
    """Load a golden trace by name."""
    from fpemu.traces import read_trace, trace_filename
    folder = _golden_dir(request.config)
    return lambda name: read_trace(folder / trace_filename(name, "reference"))


def _golden_copy(trace):
    """The trace as a golden file holds it: without the host it ran on."""
    from fpemu.traces import Trace
    return Trace({k: v for k, v in trace.metadata.items() if k != "host"}, trace.steps, trace.summary)


def _obtained_path(golden: pathlib.Path) -> pathlib.Path:
    return golden.with_name(golden.name[:-len(".json")] + ".obtained.json")


def _shown(lines) -> str:
    lines = list(lines)
    if len(lines) > _SHOWN_LINES:
        lines = lines[:_SHOWN_LINES] + [f"... {len(lines) - _SHOWN_LINES} more lines (see the obtained file)"]
    return "".join(f"\n  {line}" for line in lines)


class _Golden:
    """One golden file under the run's mode: what a failure writes, and when the golden is rewritten."""

    def __init__(self, config, path: pathlib.Path, writable: bool, write_golden, write_obtained):
        self.path, self.writable = path, writable
        self.write_golden, self.write_obtained = write_golden, write_obtained
        self.obtained = _obtained_path(path)
        self.update = config.getoption("fpemu_update_golden")
        self.force_regen = config.getoption("--fpemu-force-regen")
        config.stash[_USED].add(path.resolve())

    def updated(self) -> bool:
        """Under --fpemu-update-golden, write the golden (when the test may) and say so."""
        if self.update and self.writable:
            self.write_golden(self.path)
            self.obtained.unlink(missing_ok=True)
            return True
        return False

    def fail(self, problem: str, details=()):
        if self.force_regen and self.writable:
            self.write_golden(self.path)
            self.obtained.unlink(missing_ok=True)
            pytest.fail(f"{problem}; --fpemu-force-regen rewrote {self.path}{_shown(details)}", pytrace=False)
        self.write_obtained(self.obtained)
        pytest.fail(f"{problem}{_shown(details)}\n  (what this run got: {self.obtained})", pytrace=False)

    def read(self, reader):
        """The golden, read by ``reader``; a missing or unreadable one fails in one line naming the flag."""
        from fpemu.errors import FpemuInputError
        if not self.path.exists():
            self.fail(f"{self.path}: no golden file yet; run pytest with --fpemu-update-golden to write it")
        try:
            return reader(self.path)
        except FpemuInputError as error:
            unreadable = str(error).splitlines()[0]
        self.fail(f"{unreadable}; rerun with --fpemu-force-regen to rewrite the golden")  # no chained traceback

    def passed(self) -> None:
        self.obtained.unlink(missing_ok=True)


def _level(config, level, ulps):
    level = level or config.getoption("--fpemu-golden-level") or config.getini("fpemu_golden_level")
    if level not in LEVELS:
        raise pytest.UsageError(f"golden level {level!r}: expected one of {', '.join(LEVELS)}")
    if ulps is None:
        text = config.getini("fpemu_golden_ulps")
        if not str(text).isdigit():
            raise pytest.UsageError(f"ini option fpemu_golden_ulps: expected a whole number of ulps, got {text!r}")
        ulps = int(text)
    return level, ulps


def _changes_lines(changes) -> list:
    """The fields that differ, one row each (trajectory fields first), and the summary entries that do."""
    rows = changes.field_lines() if changes.fields else []
    rows += [f"summary {c.describe()}" for c in changes.summary if c.changed]
    return rows


def _divergence_lines(divergence):
    """(the first divergence in one line, a line per leaf that differs): a nested value (``grad_stats``)
    is never printed whole, but entry by entry, keys sorted."""
    from fpemu.compare.diff import bit_equal
    if not isinstance(divergence.expected, (dict, list)) or not isinstance(divergence.got, (dict, list)):
        return divergence.describe(), []
    a, b = leaves(divergence.expected), leaves(divergence.got)
    lines = [f"{key}: expected {a[key]!r}, got {b[key]!r}" if key in a and key in b else
             f"{key}: {'only in the golden' if key in a else 'not in the golden'}"
             for key in sorted(set(a) | set(b)) if not (key in a and key in b and bit_equal(a[key], b[key]))]
    where = f"{divergence.field} of {divergence.element}" if divergence.element else divergence.field
    return (f"step {divergence.step}, {where}: {len(lines)} of {len(set(a) | set(b))} entries differ (likely cause: {divergence.cause})",
            [f"{where}.{line}" for line in lines])


def _spec_problem(golden, trace, path):
    """The failure of a golden made from another version of the trace's spec: the spec keys that differ and
    how the traces differ, inline; None where the spec is the same."""
    from fpemu.compare.changes import spec_changes, trace_changes
    from fpemu.kinds import explain
    if golden.metadata["spec"]["sha256"] == trace.metadata["spec"]["sha256"]:
        return None
    keys = spec_changes(golden, trace)
    changes = trace_changes(golden, trace, explain)
    what = ", ".join(k.describe() for k in keys) if keys else "its text differs (no TOML keys to compare)"
    return (f"{path} was made from another version of spec {golden.spec_name!r}: {what}; the traces: "
            f"{changes.verdict()} (accept it with --fpemu-force-regen)", _changes_lines(changes))


def _trace_problem(golden, trace, path, level, ulps, expect_divergence):
    """((problem, details) or None where it passes, the comparison: compare_traces's Verdict at level bits,
    else trace_changes's TraceChanges) of ``trace`` against ``golden`` at ``level``."""
    from fpemu.compare import compare_traces
    from fpemu.compare.changes import trace_changes
    from fpemu.kinds import explain
    from fpemu.traces.replay import replayed_file_changed
    spec = _spec_problem(golden, trace, path)
    if spec:
        return spec, None
    problem = replayed_file_changed(golden.metadata, trace.metadata, path)
    if problem:
        return (f"{problem}; rewrite the golden with --fpemu-force-regen to accept it", ()), None
    if LEVELS[level] is None:
        verdict = compare_traces(golden, trace, expect_divergence, explain)
        if not verdict.failed:
            return None, verdict
        first, differing = _divergence_lines(verdict.divergence)
        return (f"{trace.implementation} diverges from {path.name}: {first}",
                differing + _changes_lines(trace_changes(golden, trace, explain))), verdict
    if expect_divergence is not None:
        raise pytest.UsageError("expect_divergence is a known first divergence: it needs level='bits'")
    changes = trace_changes(golden, trace, explain)
    problem = LEVELS[level](golden, trace, changes, ulps)
    if problem is None:
        return None, changes
    return (f"{trace.implementation} differs from {path.name} at level {level} ({problem}): {changes.verdict()}",
            _changes_lines(changes)), changes


@pytest.fixture
def assert_trace_matches(request):
    """Compare a trace with its golden file (see the module docstring for the levels and modes)."""
    from fpemu.traces import read_trace, trace_filename, write_golden_trace, write_trace
    from fpemu.traces.layout import portable_spec_path
    config = request.config

    def check(trace, name=None, expect_divergence=None, recorded=False, level=None, ulps=None):
        level, ulps = _level(config, level, ulps)
        path = _golden_dir(config) / trace_filename(name or trace.spec_name, "reference")
        portable = portable_spec_path(_golden_copy(trace), config.rootpath)
        golden_file = _Golden(config, path, trace.implementation == "reference" or recorded,
                              lambda at: write_golden_trace(portable, at), lambda at: write_trace(trace, at))
        if golden_file.updated():
            return None
        if not path.exists() and not golden_file.writable:
            golden_file.fail(f"{path}: no golden trace. Golden traces come from the reference model (`fpemu golden "
                             f"SPEC --out {path.parent}`, or reference_trace(scenario) passed to assert_trace_matches "
                             "under --fpemu-update-golden) or from a recorded run the test passes with recorded=True")
        golden = golden_file.read(read_trace)
        found, result = _trace_problem(golden, trace, path, level, ulps, expect_divergence)
        if found:
            golden_file.fail(*found)
        golden_file.passed()
        return result

    return check


@pytest.fixture
def assert_data_matches(request):
    """Compare plain data with its golden file ``<golden dir>/<name>.data.json``, bit for bit."""
    from fpemu.fileio import atomic_write, read_text
    from fpemu.errors import FpemuInputError
    from fpemu.traces.plain import data_differences, dumps_data, encode_data, loads_data
    config = request.config

    def check(data, name: str):
        if not isinstance(name, str) or not name or "/" in name:
            raise pytest.UsageError(f"assert_data_matches: name must be a file name without '/', got {name!r}")
        text = dumps_data(data)  # an unstorable value fails here, naming its path
        path = _golden_dir(config) / f"{name}.data.json"

        def write(at):
            if not (at.exists() and read_text(at, FpemuInputError) == text):  # unchanged: the bytes stay
                atomic_write(at, text)

        golden_file = _Golden(config, path, True, write, write)
        if golden_file.updated():
            return None
        stored = golden_file.read(lambda at: loads_data(read_text(at, FpemuInputError), str(at)))
        differences = data_differences(stored, encode_data(data), encoded=True)
        if differences:
            golden_file.fail(f"{name} differs from {path.name} at {len(differences)} "
                             f"place{'s' if len(differences) > 1 else ''}", differences)
        golden_file.passed()
        return True

    return check


# --- orphaned goldens ------------------------------------------------------------------

def _complete_run(config, stats: dict) -> str:
    """'' where this run ran every test of its folders, else why its unused goldens may not be orphans."""
    if config.option.keyword or config.option.markexpr or stats.get("deselected"):
        return "tests were selected with -k, -m or deselected"
    if any("::" in arg or pathlib.Path(arg).is_file() for arg in config.args):
        return "the run named test files or tests"
    if stats.get("error"):
        return "tests errored"
    if stats.get("skipped"):
        return _SKIPPED
    return ""


def _orphans(config) -> list:
    folder = _golden_dir(config)
    if not folder.is_dir():
        return []
    used = config.stash.get(_USED, set())
    return sorted(p for p in folder.rglob("*.json")
                  if not p.name.endswith(".obtained.json") and p.resolve() not in used)


def pytest_sessionfinish(session):
    """An xdist worker hands the goldens its tests used to the controller, which alone names the orphans;
    there (or in a run without workers) the orphans fail a run of every test, as syrupy's unused snapshots do."""
    config = session.config
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["fpemu_used_goldens"] = sorted(str(path) for path in config.stash.get(_USED, set()))
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    line, fails = _orphan_verdict(config, getattr(reporter, "stats", {}))
    config.stash[_ORPHAN_LINE] = line
    if fails and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """(xdist, in the controller) A worker's used goldens join the run's: a golden one worker used is no
    orphan because the other workers did not."""
    used = getattr(node, "workeroutput", {}).get("fpemu_used_goldens", [])
    node.config.stash.setdefault(_USED, set()).update(pathlib.Path(path) for path in used)


def _orphan_verdict(config, stats: dict) -> tuple:
    """(the line that names the golden files no test used, or '', and whether they fail the run); the
    orphans are deleted here where --fpemu-delete-orphans asks it of a run of every test."""
    delete = config.getoption("--fpemu-delete-orphans")
    if not config.stash.get(_USED, set()) and not delete:
        return "", False  # a run that checked no golden says nothing of them
    orphans = _orphans(config)
    if not orphans:
        return "", False
    incomplete = _complete_run(config, stats)
    if incomplete and incomplete != _SKIPPED and not delete:
        return "", False  # a partial run leaves goldens unused without their being orphans
    names = ", ".join(str(p.relative_to(config.rootpath)) for p in orphans)
    if delete and not incomplete:
        for path in orphans:
            path.unlink()
        return f"fpemu: deleted {len(orphans)} golden files no test used: {names}", False
    if incomplete:  # a skipped test's goldens are unused without being orphans: named, never failed
        why = (f"not deleted: {incomplete}; --fpemu-delete-orphans deletes them after a run of every test" if delete
               else f"not failed: {incomplete}")
        return f"fpemu: {len(orphans)} golden files no test used: {names} ({why})", False
    if config.getoption("--fpemu-warn-orphans") or config.getini("fpemu_orphans") == "warn":
        return f"fpemu: {len(orphans)} golden files no test used: {names} (--fpemu-delete-orphans deletes them)", False
    return (f"fpemu: {len(orphans)} golden files no test used: {names}: the run fails "
            f"(--fpemu-delete-orphans deletes them; --fpemu-warn-orphans only reports them)"), True


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Name the golden files no test used (syrupy's unused snapshots), as the controller found them."""
    line = config.stash.get(_ORPHAN_LINE, "")
    if line:
        terminalreporter.write_line(line)
