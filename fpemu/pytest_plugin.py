"""pytest plugin (registered as the ``fpemu`` pytest11 entry point).

Fixtures:
  ``assert_trace_matches(trace, name=None, expect_divergence=None, recorded=False)``: compare a
  trace with the golden trace ``<golden dir>/<name or spec name>.json``; fails with the first
  divergence and writes what it got beside the golden as ``<name>.obtained.json`` (removed again
  once the trace matches).  Only a reference trace, or a recorded run where the test passes
  ``recorded=True``, may become a golden (traces of real implementations are otherwise only ever
  compared); a recorded golden is written without the ``host`` metadata, which would change from
  machine to machine.
  ``fpemu_golden(name)``: load a golden trace.

Modes (as pytest-regressions' ``--force-regen`` and ``--regen-all``), for the goldens a test may write:
  ``--fpemu-update-golden`` (also spelled ``--fpemu-regen-all``): write the golden and pass.
  ``--fpemu-force-regen``: compare; where the golden is missing or differs, rewrite it and fail,
  so the run shows what was regenerated and the next run checks it.

Markers: ``fpemu_NAME`` for every adapter NAME in ``fpemu.adapters.ADAPTERS`` (``fpemu_torch``,
``fpemu_flax``, ``fpemu_jax_step``, ...): the test drives that real implementation and is
skipped, with the reason, where its packages are missing.

The golden folder is the ini option ``fpemu_golden_dir`` (default ``tests/golden``),
relative to the rootdir.
"""

from __future__ import annotations

import pathlib

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("fpemu")
    group.addoption("--fpemu-update-golden", "--fpemu-regen-all", action="store_true", default=False,
                    dest="fpemu_update_golden",
                    help="rewrite golden traces with the traces the tests produce (reference traces, and recorded "
                         "runs where the test allows it), and pass")
    group.addoption("--fpemu-force-regen", action="store_true", default=False,
                    help="rewrite a golden trace that is missing or differs, and fail that test")
    parser.addini("fpemu_golden_dir", "folder of golden traces for assert_trace_matches", default="tests/golden")


def _marker_names():
    from fpemu.adapters import ADAPTERS
    return {f"fpemu_{name}": name for name in ADAPTERS}


def pytest_configure(config):
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


@pytest.fixture
def assert_trace_matches(request):
    """Compare a trace with its golden file (see the module docstring for the modes)."""
    from fpemu.compare import compare_traces
    from fpemu.kinds import explain
    from fpemu.traces.replay import replayed_file_changed
    from fpemu.traces import read_trace, trace_filename, write_golden_trace, write_trace
    folder = _golden_dir(request.config)
    update = request.config.getoption("fpemu_update_golden")
    force_regen = request.config.getoption("--fpemu-force-regen")

    def check(trace, name=None, expect_divergence=None, recorded=False):
        path = folder / trace_filename(name or trace.spec_name, "reference")
        obtained = _obtained_path(path)
        writable = trace.implementation == "reference" or recorded
        if update and writable:
            write_golden_trace(_golden_copy(trace), path)
            obtained.unlink(missing_ok=True)

        def fail(problem):
            write_trace(trace, obtained)
            if force_regen and writable:
                write_golden_trace(_golden_copy(trace), path)
                pytest.fail(f"{problem}; --fpemu-force-regen rewrote {path}", pytrace=False)
            pytest.fail(f"{problem} (what this run got: {obtained})", pytrace=False)

        if not path.exists():
            fail(f"{path}: no golden trace. Golden traces come from the reference model (`fpemu golden SPEC "
                 f"--out {folder}`, or reference_trace(scenario) passed to assert_trace_matches under "
                 "--fpemu-update-golden) or from a recorded run the test passes with recorded=True")
        golden = read_trace(path)
        if golden.metadata["spec"]["sha256"] != trace.metadata["spec"]["sha256"]:
            fail(f"{path} was made from another version of spec {golden.spec_name!r} (its sha256 differs); "
                 "rewrite it with --fpemu-update-golden")
        problem = replayed_file_changed(golden.metadata, trace.metadata, path)
        if problem:
            fail(f"{problem}; rewrite the golden with --fpemu-update-golden to accept it")
        verdict = compare_traces(golden, trace, expect_divergence, explain)
        if verdict.failed:
            fail(f"{trace.implementation} diverges from {path.name}: {verdict.divergence.describe()}")
        obtained.unlink(missing_ok=True)
        return verdict

    return check
