"""The pytest plugin's golden modes, in real inner pytest sessions (pytester) over a recorded JAX run
and a reference trace."""

import json

import pytest

from fpemu.traces import write_trace

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


def recorded_run(init: float):
    """Three steps of a real jitted jmp loop, recorded."""
    recorder = record_jax("fp16", name="tiny_jmp", scaler="jmp", params={"loss_scale": init, "period": 2})
    step = jax.jit(lambda state, g: (recorder.grad_stats({"w": g}, scale=state.loss_scale),
                                     state.adjust(jmp.all_finite(state.scale(g).astype(jnp.float16)))))
    state = jmp.DynamicLossScale(jnp.float32(init), period=2)
    for grads in ([1.0, 2.0], [3e4, 1.0], [1.0, 1e-9]):
        stats, new_state = step(state, jnp.array(grads, jnp.float32))
        recorder.record(stats, scale_state=state, next_scale_state=new_state)
        state = new_state
    return recorder.trace()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Recorded runs at three initial scales (made before pytester starts: see the imports)."""
    folder = tmp_path_factory.mktemp("runs")
    for init in (4.0, 8.0, 16.0):
        write_trace(recorded_run(init), folder / f"run{int(init)}.json")
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
    result.stdout.fnmatch_lines(["*golden/tiny_jmp.json: no golden trace*(what this run got: *tiny_jmp.obtained.json)*"])
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

    assert outcomes(inner.runpytest_inprocess("-k", "recorded_golden")) == {"passed": 1}
    assert not obtained.exists()  # a match removes the stale obtained file

    monkeypatch.setenv("FPEMU_INNER_RUN", str(runs / "run16.json"))
    assert outcomes(inner.runpytest_inprocess("-k", "recorded_golden", "--fpemu-regen-all")) == {"passed": 1}
    assert json.loads(recorded.read_text())["steps"][0]["scale"] == 16.0
    # force-regen never writes a golden the test may not write
    result = inner.runpytest_inprocess("-k", "without_permission", "--fpemu-force-regen")
    assert outcomes(result) == {"failed": 1} and not (golden / "tiny_jmp_strict.json").exists()
