"""The pytest plugin's golden modes, in real inner pytest sessions (pytester) over a recorded JAX run
and a reference trace."""

import json
import os
import pathlib
import re

import pytest

from fpemu.traces import read_trace, write_trace

# Imported here, before any pytester fixture: pytester drops the modules a test imports when it
# ends, and a second import of jaxlib in one process aborts it.
jax = pytest.importorskip("jax")
jmp = pytest.importorskip("jmp")
jnp = jax.numpy

from fpemu.recorders.jax_run import record_jax  # noqa: E402

pytest_plugins = ["pytester"]

INNER_TESTS = '''
import os

from fpemu.harness import reference_trace
from fpemu.specs import load_spec
from fpemu.traces import read_trace


def test_recorded_golden(assert_trace_matches):
    assert_trace_matches(read_trace(os.environ["FPEMU_INNER_RUN"]), "tiny_jmp", recorded=True)


def test_recorded_without_permission(assert_trace_matches):
    assert_trace_matches(read_trace(os.environ["FPEMU_INNER_RUN"]), "tiny_jmp_strict")


def test_reference(assert_trace_matches):
    assert_trace_matches(reference_trace(load_spec(os.environ["FPEMU_INNER_SPEC"])))
'''


GRADS = ([1.0, 2.0], [3e4, 1.0], [1.0, 1e-9])


def recorded_run(init: float, grads=GRADS):
    """Three steps of a real jitted jmp loop, recorded."""
    recorder = record_jax("fp16", name="tiny_jmp", scaler="jmp", params={"loss_scale": init, "period": 2})
    step = jax.jit(lambda state, g: (recorder.grad_stats({"w": g}, scale=state.loss_scale),
                                     state.adjust(jmp.all_finite(state.scale(g).astype(jnp.float16)))))
    state = jmp.DynamicLossScale(jnp.float32(init), period=2)
    for step_grads in grads:
        stats, new_state = step(state, jnp.array(step_grads, jnp.float32))
        recorder.record(stats, scale_state=state, next_scale_state=new_state)
        state = new_state
    return recorder.trace()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Recorded runs at three initial scales (made before pytester starts: see the imports)."""
    folder = tmp_path_factory.mktemp("runs")
    for init in (4.0, 8.0, 16.0):
        write_trace(recorded_run(init), folder / f"run{int(init)}.json")
    # the same trajectory, one gradient 1 float16 ulp away (2.0 -> 2.001953125, the statistics' format):
    # numerics only, 8192 float32 ulps in the scaled max_abs (8.0 -> 8.0078125)
    write_trace(recorded_run(4.0, ([1.0, 2.001953125],) + GRADS[1:]), folder / "run4_ulp.json")
    return folder


@pytest.fixture
def inner(runs, pytester, monkeypatch, request):
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.setenv("FPEMU_INNER_SPEC", str(request.config.rootpath / "specs" / "seed_example_1.toml"))
    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run4.json"))
    return pytester


def outcomes(result):
    return {k: v for k, v in result.parseoutcomes().items() if k in ("passed", "failed")}


def test_golden_modes(inner, runs, monkeypatch):
    golden = inner.path / "golden"
    recorded, obtained = golden / "tiny_jmp.json", golden / "tiny_jmp.obtained.json"

    result = inner.runpytest_inprocess()  # no goldens: every test fails and shows what it got
    assert outcomes(result) == {"failed": 3}
    result.stdout.fnmatch_lines(["*golden/tiny_jmp.json: no golden file yet; run pytest with --fpemu-update-golden*",
                                 "*(what this run got: *tiny_jmp.obtained.json)*"])
    assert obtained.exists() and not recorded.exists()

    result = inner.runpytest_inprocess("--fpemu-update-golden")  # writes what the tests may write
    assert outcomes(result) == {"passed": 2, "failed": 1}
    result.stdout.fnmatch_lines(["*FAILED test_inner.py::test_recorded_without_permission*"])
    assert recorded.exists() and not (golden / "tiny_jmp_strict.json").exists() and not obtained.exists()
    body = json.loads(recorded.read_text())
    assert body["metadata"]["source"] == "recorded_run" and "host" not in body["metadata"]  # nothing of the host

    assert outcomes(inner.runpytest_inprocess("-k", "golden or reference")) == {"passed": 2}

    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run8.json"))  # the run changed
    before = recorded.read_bytes()
    result = inner.runpytest_inprocess("-k", "recorded_golden")
    assert outcomes(result) == {"failed": 1}
    result.stdout.fnmatch_lines(["*jax@cpu diverges from tiny_jmp.json: step 0, scale: expected 4.0*"
                                 "(likely cause: parameters differ: loss_scale 4.0 -> 8.0)*"])  # named, not timing
    assert recorded.read_bytes() == before and json.loads(obtained.read_text())["steps"][0]["scale"] == 8.0

    result = inner.runpytest_inprocess("-k", "recorded_golden", "--fpemu-force-regen")  # regenerate, and fail
    assert outcomes(result) == {"failed": 1}
    result.stdout.fnmatch_lines(["*diverges from tiny_jmp.json*--fpemu-force-regen rewrote *tiny_jmp.json*"])
    assert json.loads(recorded.read_text())["steps"][0]["scale"] == 8.0
    assert not obtained.exists()  # a regenerated golden leaves no obtained file behind
    assert recorded.stat().st_mode & 0o777 == 0o666 & ~_umask()  # as open() makes files, not mkstemp's 0600

    assert outcomes(inner.runpytest_inprocess("-k", "recorded_golden")) == {"passed": 1}
    assert not obtained.exists()  # a match removes the stale obtained file

    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run16.json"))
    assert outcomes(inner.runpytest_inprocess("-k", "recorded_golden", "--fpemu-regen-all")) == {"passed": 1}
    assert json.loads(recorded.read_text())["steps"][0]["scale"] == 16.0
    # force-regen never writes a golden the test may not write
    result = inner.runpytest_inprocess("-k", "without_permission", "--fpemu-force-regen")
    assert outcomes(result) == {"failed": 1} and not (golden / "tiny_jmp_strict.json").exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


LEVEL_TESTS = '''
import os

import pytest

from fpemu.traces import read_trace


@pytest.mark.parametrize("level, ulps", [("bits", None), ("numerics", 8191), ("numerics", 8192), ("trajectory", None)])
def test_level(assert_trace_matches, level, ulps):
    assert_trace_matches(read_trace(os.environ["FPEMU_INNER_RUN"]), "tiny_jmp", recorded=True, level=level, ulps=ulps)
'''


def test_golden_levels(runs, pytester, monkeypatch):
    """bits fails on a 1-ulp (float16) gradient change; numerics passes within its 8192 float32 ulps, trajectory passes; a changed
    scale fails every level, with a short message."""
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    pytester.makepyfile(test_levels=LEVEL_TESTS)
    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run4.json"))
    assert outcomes(pytester.runpytest_inprocess("--fpemu-update-golden", "-k", "bits")) == {"passed": 1}

    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run4_ulp.json"))
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines([
        "*FAILED test_levels.py::test_level?bits-None*", "*FAILED test_levels.py::test_level?numerics-8191*"])
    # the nested grad_stats dicts are shown entry by entry, never whole on one line
    result.stdout.fnmatch_lines(["*diverges from tiny_jmp.json: step 0, grad_stats: 1 of 7 entries differ (likely cause: *)",
                                 "*grad_stats.w.max_abs: expected 8.0, got 8.0078125"])
    result.stdout.fnmatch_lines(["*differs from tiny_jmp.json at level numerics (numerics beyond 8191 ulp: "
                                 "grad_stats by 8192 ulp): numerics only*"])
    assert "'elements': 2, 'zero'" not in result.stdout.str()

    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run8.json"))
    result = pytester.runpytest_inprocess("-k", "trajectory")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*differs from tiny_jmp.json at level trajectory (the trajectory changed): "
                                 "trajectory changed: *final scale*",
                                 "*field*differs at*", "*scale*3 / 3*"])

    # the ini option sets the level of every call that names none; a bad level is a usage error
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\nfpemu_golden_level = trajectory\n")
    pytester.makepyfile(test_ini='''
import os
from fpemu.traces import read_trace
def test_default(assert_trace_matches):
    assert_trace_matches(read_trace(os.environ["FPEMU_INNER_RUN"]), "tiny_jmp", recorded=True)
''')
    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run4_ulp.json"))
    assert outcomes(pytester.runpytest_inprocess("test_ini.py")) == {"passed": 1}
    assert outcomes(pytester.runpytest_inprocess("test_ini.py", "--fpemu-golden-level", "bits")) == {"failed": 1}


def test_edited_spec_shows_its_diff(pytester, monkeypatch, request):
    """A golden of an older version of the spec names the keys that changed and how the traces differ."""
    source = (request.config.rootpath / "specs" / "seed_example_1.toml").read_text()
    spec = pytester.path / "spec.toml"
    spec.write_text(source)
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    pytester.makepyfile(test_spec='''
import os
from fpemu.harness import reference_trace
from fpemu.specs import load_spec
def test_reference(assert_trace_matches):
    assert_trace_matches(reference_trace(load_spec(os.environ["FPEMU_INNER_SPEC"])))
''')
    monkeypatch.setenv("FPEMU_INNER_SPEC", str(spec))
    assert outcomes(pytester.runpytest_inprocess("--fpemu-update-golden")) == {"passed": 1}
    edited, count = re.subn(r"growth_interval = (\d+)", lambda m: f"growth_interval = {int(m[1]) + 1}", source)
    assert count == 1, "the spec sets growth_interval once"
    spec.write_text(edited)
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*spec.json was made from another version of spec 'spec': scaler.params.growth_interval 2 -> 3; "
                                 "the traces: trajectory changed*(accept it with --fpemu-force-regen)*"])


def test_corrupted_golden_and_orphans(runs, pytester, monkeypatch):
    """A corrupted golden fails in one line naming the file and the flag that rewrites it; unused goldens are
    reported after a full run and deleted only where asked, after a run of every test."""
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    pytester.makepyfile(test_one='''
import os
from fpemu.traces import read_trace
def test_recorded(assert_trace_matches):
    assert_trace_matches(read_trace(os.environ["FPEMU_INNER_RUN"]), "tiny_jmp", recorded=True)
def test_other():
    pass
''')
    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run4.json"))
    assert outcomes(pytester.runpytest_inprocess("--fpemu-update-golden")) == {"passed": 2}
    golden = pytester.path / "golden" / "tiny_jmp.json"
    golden.write_text(golden.read_text().replace('"scale": 4.0', '"scale": 5.0', 1))
    result = pytester.runpytest_inprocess("-k", "recorded")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*golden/tiny_jmp.json: checksum mismatch*; rerun with --fpemu-force-regen to "
                                 "rewrite the golden"])
    text = result.stdout.str()
    assert "Traceback" not in text and "TraceError" not in text and "During handling" not in text
    assert outcomes(pytester.runpytest_inprocess("-k", "recorded", "--fpemu-force-regen")) == {"failed": 1}
    assert outcomes(pytester.runpytest_inprocess()) == {"passed": 2}

    orphan = pytester.path / "golden" / "old_run.json"
    orphan.write_text(golden.read_text())
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.TESTS_FAILED and outcomes(result) == {"passed": 2}
    result.stdout.fnmatch_lines(["fpemu: 1 golden files no test used: golden/old_run.json: the run fails "
                                 "(--fpemu-delete-orphans deletes them; --fpemu-warn-orphans only reports them)"])
    result = pytester.runpytest_inprocess("--fpemu-warn-orphans")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["fpemu: 1 golden files no test used: golden/old_run.json (--fpemu-delete-orphans*"])
    skipping = pytester.path / "test_skipped.py"
    skipping.write_text("import pytest\n@pytest.mark.skip(reason='elsewhere')\ndef test_later():\n    pass\n")
    result = pytester.runpytest_inprocess()  # a skipped test may use the golden: named, not failed
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*golden/old_run.json (not failed: tests were skipped: they may use them)"])
    skipping.unlink()
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\nfpemu_orphans = warn\n")
    assert pytester.runpytest_inprocess().ret == pytest.ExitCode.OK
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\nfpemu_orphans = wran\n")
    result = pytester.runpytest_inprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option fpemu_orphans: expected fail or warn, got 'wran'*"])
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    result = pytester.runpytest_inprocess("-k", "recorded")
    assert result.ret == pytest.ExitCode.OK and "golden files no test used" not in result.stdout.str()  # partial
    result = pytester.runpytest_inprocess("-k", "recorded", "--fpemu-delete-orphans")
    result.stdout.fnmatch_lines(["*golden/old_run.json (not deleted: tests were selected with -k*"])
    assert orphan.exists()
    result = pytester.runpytest_inprocess("--fpemu-delete-orphans")
    result.stdout.fnmatch_lines(["fpemu: deleted 1 golden files no test used: golden/old_run.json"])
    assert not orphan.exists() and golden.exists()


@pytest.mark.stage2("test_corrupted_golden_and_orphans in one process (this runs three 2-worker sessions, 25 s)")
def test_orphans_under_xdist_are_the_goldens_no_worker_used(runs, pytester, monkeypatch):
    """With tests spread over xdist workers, a golden one worker used is no orphan because another did not
    use it: the controller names (and deletes) exactly the goldens no test of any worker used."""
    pytest.importorskip("xdist")
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    pytester.makepyfile(test_two='''
import os
import pytest
from fpemu.traces import read_trace
@pytest.mark.parametrize("name", ["run_a", "run_b", "run_c", "run_d"])
def test_recorded(assert_trace_matches, name):
    assert_trace_matches(read_trace(os.environ["FPEMU_INNER_RUN"]), name, recorded=True)
''')
    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run4.json"))
    assert outcomes(pytester.runpytest_subprocess("--fpemu-update-golden", "-n", "2")) == {"passed": 4}
    golden = pytester.path / "golden"
    assert sorted(p.name for p in golden.iterdir()) == ["run_a.json", "run_b.json", "run_c.json", "run_d.json"]
    (golden / "old_run.json").write_text((golden / "run_a.json").read_text())
    result = pytester.runpytest_subprocess("-n", "2")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["fpemu: 1 golden files no test used: golden/old_run.json: the run fails*"])
    result = pytester.runpytest_subprocess("-n", "2", "--fpemu-delete-orphans")
    result.stdout.fnmatch_lines(["fpemu: deleted 1 golden files no test used: golden/old_run.json"])
    assert sorted(p.name for p in golden.iterdir()) == ["run_a.json", "run_b.json", "run_c.json", "run_d.json"]


DATA_TESTS = '''
import os

import numpy as np


def test_data(assert_data_matches):
    w = np.array([[1.0, -0.0], [float("nan"), 3.0]], np.float32)
    w[0, 0] += float(os.environ.get("FPEMU_INNER_DELTA", "0"))
    assert_data_matches({"loss": 0.25, "w": w, "steps": [1, 2, 3], "name": "run"}, "plain")
'''


def test_plain_data_golden(pytester, monkeypatch):
    """Plain data round-trips bit for bit (NaN, -0.0 included); a change names its path and element."""
    pytester.makeini("[pytest]\nfpemu_golden_dir = golden\n")
    pytester.makepyfile(test_data=DATA_TESTS)
    assert outcomes(pytester.runpytest_inprocess()) == {"failed": 1}  # no golden yet
    assert outcomes(pytester.runpytest_inprocess("--fpemu-update-golden")) == {"passed": 1}
    golden = pytester.path / "golden" / "plain.data.json"
    before = golden.read_bytes()
    assert outcomes(pytester.runpytest_inprocess()) == {"passed": 1}
    assert outcomes(pytester.runpytest_inprocess("--fpemu-update-golden")) == {"passed": 1}
    assert golden.read_bytes() == before  # regeneration is byte-identical
    monkeypatch.setenv("FPEMU_INNER_DELTA", "1e-7")
    result = pytester.runpytest_inprocess()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*plain differs from plain.data.json at 1 place*",
                                 "*?'w'?: float32?2, 2?: 1 of 4 elements differ, first at (0, 0): expected 1.0, "
                                 "got 1.0000001 (1 ulp)*"])
    assert (pytester.path / "golden" / "plain.data.obtained.json").exists()


def test_fpemu_golden_stores_a_relative_spec_path(tmp_path, monkeypatch, request):
    """`fpemu golden /abs/path/spec.toml` keeps the host's path out of the golden, wherever it runs from: the
    path is the spec's within its project (the folder above it with .git or pyproject.toml), else its name
    (run from / it was the whole host path, 'tmp/.../specs/s.toml')."""
    from fpemu.harness import write_golden
    spec = (request.config.rootpath / "specs" / "seed_example_1.toml").resolve()
    for index, where in enumerate((request.config.rootpath, tmp_path, pathlib.Path("/"), spec.parent)):
        monkeypatch.chdir(where)
        (written,) = write_golden([str(spec)], tmp_path / f"from{index}")
        assert read_trace(written).metadata["spec"]["path"] == "specs/seed_example_1.toml", where
    team = tmp_path / "team"  # a downstream project of its own
    (team / "specs").mkdir(parents=True)
    (team / "pyproject.toml").write_text("[project]\nname = 'team'\n")
    (team / "specs" / "mine.toml").write_text(spec.read_text())
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "mine.toml").write_text(spec.read_text())
    for path, stored in ((team / "specs" / "mine.toml", "specs/mine.toml"), (alone / "mine.toml", "mine.toml")):
        monkeypatch.chdir("/")
        (written,) = write_golden([str(path)], tmp_path / "out" / path.parent.name)
        assert read_trace(written).metadata["spec"]["path"] == stored
