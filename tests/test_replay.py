"""Replay (fpemu.traces.replay and the spec source `recorded`) of a tiny real GPT-2 run recorded with
fpemu.record_torch: under the run's own scaler it reproduces the recorded trajectory bit for bit (through
`fpemu golden` and `fpemu compare` too); under other parameters it is exact while it stays on the recorded
trajectory, as a real rerun shows; bad specs name the key."""

import hashlib
import json
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from fpemu.cli import main  # noqa: E402
from fpemu.compare import compare_traces, trace_changes  # noqa: E402
from fpemu.compare.diff import likely_cause  # noqa: E402
from fpemu.traces.replay import replay  # noqa: E402
from fpemu.specs import load_spec  # noqa: E402
from fpemu.specs import SpecError  # noqa: E402
from fpemu.traces import Trace, read_trace  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import gpt2_loop  # noqa: E402

STEPS = 10
BASE = {"init_scale": 2.0 ** 22, "growth_interval": 2}
TINY = dict(layers=2, width=32, batch=2, length=8, shadow_every=2)


def record(path, **params):
    return gpt2_loop.record(path, steps=STEPS, name=path.stem, **TINY, **{**BASE, **params})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("replay")
    return folder, record(folder / "base.json"), record(folder / "slower.json", growth_interval=3)


def test_replay_under_its_own_scaler_is_the_run_bit_for_bit(runs):
    _, base, _ = runs
    trace = read_trace(base._path)
    assert any(step.overflow for step in base.steps) and not all(step.overflow for step in base.steps)
    same = replay(trace, trace.metadata["profile"], **trace.metadata["params"])
    assert [s.hex() for s in same.trace.scales] == [step.scale.hex() for step in base.steps]
    assert same.flags == [step.overflow for step in base.steps]
    assert same.trace.growth_counter.tolist() == [step.growth_counter for step in base.steps]
    assert same.counts() == {"recorded": STEPS, "implied": 0, "estimated": 0} and same.first_estimate is None


def test_replay_holds_while_on_the_recorded_trajectory(runs):
    _, base, slower = runs
    params = {**read_trace(base._path).metadata["params"], "growth_interval": 3}
    replayed = replay(read_trace(base._path), "torch", **params)
    real = [step.scale for step in slower.steps]
    first_off = next((i for i, kind in enumerate(replayed.decisions) if kind != "recorded"), STEPS)
    # up to the first step the replay could not take from the recording, the real rerun agrees exactly
    assert [s.hex() for s in replayed.trace.scales[:first_off + 1]] == [s.hex() for s in real[:first_off + 1]]
    assert first_off < STEPS  # a slower growth leaves the recorded scales: the rest is a prediction


def test_replay_recounts_shadow_underflow_at_the_replayed_scale(runs):
    """The shadow histograms replayed: at the run's own scales the float32 gradients rounded once, exactly;
    under another growth interval, on the steps before the scales part, what the real rerun's own float32
    pass gives at its own scale, bit for bit."""
    _, base, slower = runs
    trace = read_trace(base._path)
    same = replay(trace, "torch", **trace.metadata["params"])
    sampled = [i for i, step in enumerate(base.steps) if step.shadow_histogram is not None]
    assert sampled == list(range(0, STEPS, 2)) and same.shadow_total[1] is None
    for i in sampled:
        step = base.steps[i]
        assert same.shadow[i] == {group: histogram.shares(step.scale, "fp16")
                                  for group, histogram in step.shadow_histogram.items()}
        assert all(shares.exact for shares in same.shadow[i].values())  # power-of-two scales
    assert any(same.shadow_total[i].underflow[0] > 0 for i in sampled)
    in_bf16 = replay(trace, "torch", compute="bf16", **trace.metadata["params"])
    assert all(in_bf16.shadow_total[i].underflow[1] <= same.shadow_total[i].underflow[0] for i in sampled)
    slower_replay = replay(trace, "torch", **{**trace.metadata["params"], "growth_interval": 3})
    scales = [step.scale for step in slower.steps]
    parted = next(i for i, (a, b) in enumerate(zip(scales, [s.scale for s in base.steps])) if a != b)
    assert parted > 0 and [s.hex() for s in slower_replay.trace.scales[:parted + 1]] == [s.hex() for s in scales[:parted + 1]]
    for i in (i for i in sampled if i <= parted):
        rerun = slower.steps[i]
        assert rerun.shadow_histogram == base.steps[i].shadow_histogram  # the same weights, the same float32 pass
        assert slower_replay.shadow[i] == {group: histogram.shares(rerun.scale, "fp16")
                                           for group, histogram in rerun.shadow_histogram.items()}


def spec(folder, name, profile, params, trace="base.json", extra=""):
    path = folder / f"{name}.toml"
    params_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in params.items())
    path.write_text(f'name = "{name}"\nsteps = {STEPS}\n\n[scaler]\nprofile = "{profile}"\n'
                    f"params = {{ {params_toml} }}\n\n[overflow]\nsource = \"recorded\"\ntrace = \"{trace}\"\n{extra}"
                    f"\n[implementations.torch]\n")
    return path


def test_spec_source_recorded_through_golden_compare_and_diff(runs, capsys):
    folder, base, _ = runs
    params = {k: v for k, v in read_trace(base._path).metadata["params"].items()}
    specs = folder / "specs"
    specs.mkdir(exist_ok=True)
    spec(specs, "self", "torch", params, trace="../base.json")
    spec(specs, "bf16", "torch", params, trace="../base.json", extra='compute = "bf16"\n')
    assert load_spec(specs / "bf16.toml").overflow.compute == "bf16"
    assert main(["golden", str(specs), "--out", str(folder / "golden")]) == 0
    assert main(["compare", str(base._path), str(folder / "golden" / "self.json")]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["compare", str(base._path), str(folder / "golden" / "bf16.json")]) == 1  # bf16 never overflows
    assert "(likely cause: recording differs: compute format fp16 -> bf16)" in capsys.readouterr().out
    assert main(["diff", str(specs), "--golden", str(folder / "golden"), "--impl", "torch", "--quiet"]) == 0


def test_bad_recorded_specs_name_the_key(runs):
    folder, base, _ = runs
    params = read_trace(base._path).metadata["params"]
    with pytest.raises(SpecError, match=r"overflow\.trace: .*missing\.json"):
        load_spec(spec(folder, "missing", "torch", params, trace="missing.json"))
    golden = folder / "golden_like.json"
    golden.write_bytes((ROOT / "reports" / "golden" / "seed_example_1.json").read_bytes())  # a reference trace
    with pytest.raises(SpecError, match=r"overflow\.trace: .*not a recorded run"):
        load_spec(spec(folder, "golden", "torch", params, trace=golden.name))
    trace = read_trace(base._path)
    from fpemu.traces import write_trace
    write_trace(Trace({**trace.metadata, "source": "reference"}, trace.steps, trace.summary), golden)
    with pytest.raises(SpecError, match=r"overflow\.trace: .*steps\[0\]\.\w+: no scenario kind records it .*"
                                        r"this is a trace of any kind but a recorded run's"):
        load_spec(spec(folder, "golden", "torch", params, trace=golden.name))  # a recorded run's fields
    long = spec(folder, "long", "torch", params).read_text().replace(f"steps = {STEPS}", f"steps = {STEPS + 1}")
    (folder / "long.toml").write_text(long)
    with pytest.raises(SpecError, match=rf"steps: the recorded run .* has {STEPS} attempts"):
        load_spec(folder / "long.toml")
    with pytest.raises(SpecError, match=r"overflow\.compute"):
        load_spec(spec(folder, "fmt", "torch", params, extra='compute = "fp13"\n'))


def test_a_changed_parameter_is_named_as_the_cause_not_timing(runs, capsys):
    """Two real recordings (growth_interval 2 and 3), and a replay's reference trace against a recording:
    every comparison reads both traces' parameters and names the one that differs."""
    folder, base, slower = runs
    a, b = read_trace(base._path), read_trace(slower._path)
    expected = "parameters differ: growth_interval 2 -> 3"
    changes = trace_changes(a, b)
    assert changes.divergence.cause == expected
    first = changes.divergence
    assert likely_cause(first.field, first.step, a, b).startswith("growth timing")  # what the steps alone suggest
    assert compare_traces(a, b).divergence.cause == expected  # what the pytest plugin's failure prints
    assert main(["compare", str(base._path), str(slower._path)]) == 1
    assert f"(likely cause: {expected})" in capsys.readouterr().out
    other_format = Trace({**b.metadata, "params": a.metadata["params"],
                          "recorder": {**b.metadata["recorder"], "compute_format": "bf16"}}, b.steps, b.summary)
    assert trace_changes(a, other_format).divergence.cause == "recording differs: compute format fp16 -> bf16"
    specs = folder / "specs_gi3"
    specs.mkdir(exist_ok=True)
    spec(specs, "gi3", "torch", {**a.metadata["params"], "growth_interval": 3}, trace="../base.json")
    flax = spec(specs, "flax", "flax", {"scale": BASE["init_scale"], "growth_interval": 3}, trace="../base.json")
    flax.write_text(flax.read_text().replace("[implementations.torch]", "[implementations.flax]"))
    assert main(["golden", str(specs), "--out", str(folder / "golden_gi3"), "--quiet"]) == 0
    replayed = read_trace(folder / "golden_gi3" / "gi3.json")
    cause = compare_traces(a, replayed).divergence.cause
    assert cause == expected, cause  # a replay of the run, not another scenario
    under_flax = trace_changes(a, read_trace(folder / "golden_gi3" / "flax.json")).divergence.cause
    assert under_flax == "profiles differ: torch -> flax", under_flax


def test_the_replayed_file_is_pinned_and_recorded_by_sha256(runs, tmp_path, capsys):
    folder, base, slower = runs
    run = tmp_path / "run.json"
    run.write_bytes(base._path.read_bytes())
    params = read_trace(run).metadata["params"]
    sha = hashlib.sha256(run.read_bytes()).hexdigest()
    plain = spec(tmp_path, "plain", "torch", params, trace="run.json")
    pinned = spec(tmp_path, "pinned", "torch", params, trace="run.json", extra=f'sha256 = "{sha}"\n')
    assert load_spec(pinned).overflow.trace_sha256 == load_spec(plain).overflow.trace_sha256 == sha
    assert main(["golden", str(plain), "--out", str(tmp_path / "golden"), "--quiet"]) == 0
    golden = read_trace(tmp_path / "golden" / "plain.json")
    assert golden.metadata["replayed"] == {"trace": "run.json", "sha256": sha, "compute": "fp16"}
    run.write_bytes(slower._path.read_bytes())  # the recorded run changed under the specs
    now = hashlib.sha256(run.read_bytes()).hexdigest()
    with pytest.raises(SpecError, match=rf"overflow\.sha256: .*run\.json changed since the spec pinned it: its "
                                        rf"sha256 is {now}, the spec pins {sha}"):
        load_spec(pinned)
    assert main(["diff", str(plain), "--golden", str(tmp_path / "golden"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert (f"plain.json: golden trace was replayed from another version of run.json (its sha256 was {sha[:12]}, "
            f"the file's is now {now[:12]}): the recorded run changed; regenerate it with `fpemu golden`") in err
