"""pytest plugin (registered as the ``fpemu`` pytest11 entry point).

Fixtures:
  ``assert_trace_matches(trace, name=None, expect_divergence=None)``: compare a trace with
  the golden trace ``<golden dir>/<name or spec name>.json``; fails with the first divergence.
  With ``--fpemu-update-golden``, a reference trace first rewrites its golden file (traces
  of real implementations are only ever compared).
  ``fpemu_golden(name)``: load a golden trace.

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
    group.addoption("--fpemu-update-golden", action="store_true", default=False,
                    help="rewrite golden traces with the traces the tests produce")
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


@pytest.fixture
def assert_trace_matches(request):
    """Compare a trace with its golden file (or rewrite it under --fpemu-update-golden)."""
    from fpemu.compare import compare_traces
    from fpemu.traces import read_trace, trace_filename, write_trace
    folder = _golden_dir(request.config)
    update = request.config.getoption("--fpemu-update-golden")

    def check(trace, name=None, expect_divergence=None):
        path = folder / trace_filename(name or trace.spec_name, "reference")
        if update and trace.implementation == "reference":
            write_trace(trace, path)
        elif not path.exists():
            pytest.fail(f"{path}: no golden trace. Golden traces come from the reference model: write it with "
                        f"`fpemu golden SPEC --out {folder}`, or by passing reference_trace(scenario) to "
                        "assert_trace_matches under --fpemu-update-golden", pytrace=False)
        golden = read_trace(path)
        if golden.metadata["spec"]["sha256"] != trace.metadata["spec"]["sha256"]:
            pytest.fail(f"{path} was made from another version of spec {golden.spec_name!r} (its sha256 "
                        "differs); rewrite it with --fpemu-update-golden", pytrace=False)
        verdict = compare_traces(golden, trace, expect_divergence)
        if verdict.failed:
            pytest.fail(f"{trace.implementation} diverges from {path.name}: {verdict.divergence.describe()}",
                        pytrace=False)
        return verdict

    return check
