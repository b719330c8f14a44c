import dataclasses
import hashlib
import importlib.metadata
import json
import pathlib
import shutil
import sys

import pytest

import fpemu
from fpemu.cli import main
from fpemu.compare import compare_traces
from fpemu.harness import record_trace, reference_trace
from fpemu.specs import (BlocksScenario, Fp8TrainingScenario, RanksScenario, RecipeScenario, ScalerScenario, SpecError,
                         StepScenario, load_spec, load_specs, parse_spec)
import fpemu.errors
from fpemu.traces import TraceError, dumps, loads, read_trace, write_trace

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"

GOOD = """
description = "test"
steps = 6
[scaler]
profile = "torch"
params = { init_scale = 16.0, growth_interval = 2 }
[overflow]
source = "explicit"
sequence = [false, false, true, false, false, false]
"""


@pytest.mark.parametrize("spec,words", [
    ("steps = 3", "scaler: missing required key"),
    (GOOD.replace("steps = 6", "steps = 0"), "steps: expected an integer >= 1, got 0"),
    (GOOD.replace("steps = 6", 'steps = "6"'), "steps: expected an integer"),
    (GOOD.replace('profile = "torch"', 'profile = "pytorch"'), "scaler.profile: expected one of torch"),
    (GOOD.replace("growth_interval = 2", "period = 2"), "scaler.params: profile 'torch' has no parameter 'period'"),
    (GOOD.replace("growth_interval = 2", "growth_interval = 0"), "scaler.params: profile 'torch': growth_interval must be at least 1"),
    (GOOD.replace('source = "explicit"', 'source = "poisson"'), "overflow.source: expected one of explicit"),
    (GOOD.replace("sequence = [false, false, true, false, false, false]", "sequence = [false]"),
     "overflow.sequence: expected steps=6 flags, got 1"),
    (GOOD.replace("sequence = [false, false, true, false, false, false]", "sequence = [0, 1]"),
     "overflow.sequence: expected a list of true/false"),
    (GOOD + "\n[record]\nfields = [\"loss\"]\n", r"record.fields\[0\]: expected one of scale"),
    (GOOD + "\ncolour = 1\n", "colour: unknown key; allowed keys"),
    (GOOD + "\n[implementations.pytorch]\n", "implementations.pytorch: unknown implementation"),
    (GOOD + "\n[implementations.flax]\n", "implementations.flax.params: required"),
    (GOOD + "\n[implementations.torch]\nexpect_divergence = 3\n", "implementations.torch.expect_divergence: expected a table"),
    (GOOD + "\n[implementations.torch]\nexpect_divergence = { reason = \"r\" }\n",
     "implementations.torch.expect_divergence.step: missing required key"),
    (GOOD + '\n[implementations."jmp@cuda"]\nparams = { loss_scale = 1.0 }\n', "implementations.jmp@cuda: jmp runs on cpu only"),
    (GOOD + "\n[record]\nfields = []\n", "record.fields: expected a non-empty list"),
    (GOOD + "\n[record]\nfields = [\"hysteresis\"]\n", "record.fields: record at least one of scale"),
    (GOOD.replace('profile = "torch"', 'profile = "deepspeed"').replace("init_scale = 16.0, growth_interval = 2",
                                                                   "init_scale = 16.0")
     + "\n[record]\nfields = [\"growth_counter\"]\n[implementations.deepspeed_zero1]\n",
     r"implementations.deepspeed_zero1: records none of record.fields \(growth_counter\)"),
    ('name = "../escape"\n' + GOOD, "name: expected letters, digits"),
    ("steps = [", "not valid TOML"),
])
def test_spec_errors_name_file_and_key(spec, words):
    with pytest.raises(SpecError, match=f"^bad.toml: .*{words}"):
        parse_spec(spec, "bad.toml")


def test_shipped_specs_are_valid_and_cover_every_profile():
    scenarios = load_specs([SPECS])
    assert len(scenarios) >= 40
    scaler_scenarios = [s for s in scenarios if isinstance(s, ScalerScenario)]
    step_scenarios = [s for s in scenarios if isinstance(s, StepScenario)]
    recipe_scenarios = [s for s in scenarios if isinstance(s, RecipeScenario)]
    ranks_scenarios = [s for s in scenarios if isinstance(s, RanksScenario)]  # tests/test_ranks.py
    fp8_scenarios = [s for s in scenarios if isinstance(s, Fp8TrainingScenario)]  # tests/test_fp8_training_specs.py
    blocks_scenarios = [s for s in scenarios if isinstance(s, BlocksScenario)]  # tests/test_block_specs.py
    assert (len(scaler_scenarios) + len(step_scenarios) + len(recipe_scenarios) + len(ranks_scenarios)
            + len(fp8_scenarios) + len(blocks_scenarios)) == len(scenarios)
    assert set(fpemu.PROFILES) <= {s.profile for s in scaler_scenarios}
    assert {s.overflow.kind for s in scaler_scenarios} >= {"explicit", "bernoulli", "bursts", "periodic", "model"}
    assert {i.name for s in step_scenarios for i in s.implementations} == {"jax_step", "torch_step"}


def test_a_golden_is_read_by_its_specs_kind_and_reported_as_that_kind_says():
    """harness.md's section of a scenario asks its kind (fpemu.kinds.kind_of_trace) what its scale is called:
    every committed golden's kind is its spec's, and the kinds without a scale record none."""
    from fpemu.kinds import kind_of, kind_of_trace
    scenarios = {s.name: s for s in load_specs([SPECS])}
    goldens = sorted((ROOT / "reports" / "golden").glob("*.json"))
    assert len(goldens) >= 80
    labels = set()
    for path in goldens:
        trace = read_trace(path)
        kind = kind_of_trace(trace)
        assert kind is kind_of(scenarios[path.stem]), path.name
        assert (kind.scale_label is None) == ("scale" not in trace.steps[0]), path.name
        assert (kind.scale_label == "fp8 scale") == ("amax" in trace.steps[0]), path.name
        labels.add(kind.scale_label)
    assert labels == {None, "loss scale", "fp8 scale"}


def test_traces_are_deterministic_lossless_and_checked(tmp_path):
    scenario = load_spec(SPECS / "factor3_near_max_torch.toml")
    first, second = dumps(reference_trace(scenario)), dumps(reference_trace(scenario))
    assert first == second
    assert "host" not in loads(first).metadata and "platform" not in first  # nothing of the host in a golden
    trace = loads(first)
    assert [float.fromhex(s["scale_hex"]) for s in trace.steps] == \
        fpemu.simulate_scaler(scenario.overflow.flags(scenario.steps), "torch", **scenario.params).scales
    path = write_trace(trace, tmp_path / "t.json")
    assert path.read_text() == first and [p.name for p in tmp_path.iterdir()] == ["t.json"]
    tampered = first.replace('"growth_counter": 0', '"growth_counter": 1', 1)
    (tmp_path / "bad.json").write_text(tampered)
    with pytest.raises(TraceError, match="bad.json: checksum mismatch"):
        read_trace(tmp_path / "bad.json")
    (tmp_path / "v2.json").write_text(first.replace('"version": 1', '"version": 2'))
    with pytest.raises(TraceError, match="v2.json: trace version 2"):
        read_trace(tmp_path / "v2.json")


def test_plugin_assert_trace_matches(assert_trace_matches):
    assert assert_trace_matches(reference_trace(load_spec(SPECS / "seed_example_1.toml"))).status == "match"
    assert assert_trace_matches(reference_trace(load_spec(SPECS / "seed_example_2.toml"))).status == "match"


@pytest.mark.fpemu_torch
def test_plugin_real_torch_matches_golden(assert_trace_matches):
    scenario = load_spec(SPECS / "seed_example_1.toml")
    recorded = record_trace(scenario, scenario.implementation("torch"))
    verdict = assert_trace_matches(recorded, "seed_example_1")
    assert verdict.status == "match" and verdict.steps_compared == 5
    host = recorded.metadata["host"]  # a recorded run keeps what its numerics depend on
    # torch's tiers; never XLA's, even where another job imported jax (a trace depends on its own job only)
    assert set(host) == {"platform", "machine", "python", "cpu_features", "flags", "torch_cpu"}
    assert host["torch_cpu"]["aten_cpu_capability"] == sys.modules["torch"].backends.cpu.get_cpu_capability()
    assert recorded.metadata["packages"]["torch"] == importlib.metadata.version("torch")  # build tag kept (+cpu)
    from fpemu.host import NUMERIC_CPU_FEATURES, cpu_flags
    assert set(host["cpu_features"]) == cpu_flags() & set(NUMERIC_CPU_FEATURES)


def test_host_features_use_linux_names():
    """/proc/cpuinfo spells AVX512-FP16 avx512_fp16: the old name avx512fp16 matched no CPU, so
    recorded traces of Sapphire Rapids hosts lacked the one feature that explains their f16 results."""
    from fpemu.host import NUMERIC_CPU_FEATURES
    assert {"avx512_fp16", "avx512_bf16", "amx_bf16", "amx_tile"} <= set(NUMERIC_CPU_FEATURES)
    assert "avx512fp16" not in NUMERIC_CPU_FEATURES


@pytest.mark.fpemu_flax
def test_plugin_known_divergence(assert_trace_matches):
    scenario = load_spec(SPECS / "flax_vs_torch_timing.toml")
    assert_trace_matches(reference_trace(scenario))
    flax = scenario.implementation("flax")
    verdict = assert_trace_matches(record_trace(scenario, flax), expect_divergence=flax.expect_divergence)
    assert verdict.status == "known divergence" and verdict.divergence.cause.startswith("growth timing")
    # A divergence anywhere else is a failure, even for an implementation with a declared one.
    elsewhere = dataclasses.replace(flax.expect_divergence, step=5)
    assert compare_traces(read_trace(pathlib.Path(__file__).parent / "golden" / "flax_vs_torch_timing.json"),
                          record_trace(scenario, flax), elsewhere).status == "diverged"


# --- the CLI -----------------------------------------------------------------

def run_cli(capsys, *argv):
    code = main([*map(str, argv), "--quiet"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def spec_dir(tmp_path):
    folder = tmp_path / "specs"
    folder.mkdir()
    for name in ("seed_example_1", "timing_torch", "flax_vs_torch_timing"):
        shutil.copy(SPECS / f"{name}.toml", folder)
    return folder


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_flax
def test_golden_and_diff(capsys, tmp_path, spec_dir):
    golden = tmp_path / "golden"
    assert run_cli(capsys, "golden", spec_dir, "--out", golden)[0] == 0
    code, out, _ = run_cli(capsys, "diff", spec_dir, "--golden", golden, "--json")
    verdicts = json.loads(out)["verdicts"]
    assert code == 0 and {v["status"] for v in verdicts} == {"match", "known divergence"}
    code, out, _ = run_cli(capsys, "diff", spec_dir, "--golden", golden, "--exclude", "flax", "--json")
    kept = {v["implementation"] for v in json.loads(out)["verdicts"]}
    assert code == 0 and "torch@cpu" in kept and "flax@cpu" not in kept
    import torch
    code, out, err = run_cli(capsys, "diff", spec_dir / "timing_torch.toml", "--golden", golden, "--impl", "torch@cuda")
    if torch.cuda.is_available():
        assert code == 0 and "match  timing_torch / torch@cuda" in out
    else:  # skipped with the reason; a run that compares nothing is not a success unless allowed
        assert code == 1 and "skipped  timing_torch / torch@cuda: CUDA is not available" in out
        assert "nothing compared: every job was skipped: torch@cuda (1 spec): CUDA is not available" in err
        assert "--allow-skips" in err
        assert run_cli(capsys, "diff", spec_dir / "timing_torch.toml", "--golden", golden, "--impl", "torch@cuda",
                       "--allow-skips")[0] == 0
    code, _, err = run_cli(capsys, "diff", spec_dir / "timing_torch.toml", "--golden", golden, "--exclude", "torch")
    assert code == 2 and "nothing to run" in err and "outside --exclude torch" in err
    code, _, err = run_cli(capsys, "diff", spec_dir, "--golden", golden, "--exclude", "pytorch")
    assert code == 2 and "--exclude pytorch: unknown implementation" in err
    code, _, err = run_cli(capsys, "diff", spec_dir, "--golden", tmp_path / "nowhere")
    assert code == 2 and "no golden trace for spec" in err


@pytest.mark.fpemu_torch
def test_diff_catches_a_gradscaler_that_grows_one_step_late(capsys, tmp_path, spec_dir, monkeypatch):
    import torch

    class LateGradScaler(torch.amp.GradScaler):
        """Planted change: needs growth_interval + 1 good steps."""

        def __init__(self, device, growth_interval=2000, **kwargs):
            super().__init__(device, growth_interval=growth_interval + 1, **kwargs)

    golden = tmp_path / "golden"
    spec = spec_dir / "timing_torch.toml"
    run_cli(capsys, "golden", spec, "--out", golden)
    monkeypatch.setattr(torch.amp, "GradScaler", LateGradScaler)
    code, out, _ = run_cli(capsys, "diff", spec, "--golden", golden, "--impl", "torch")
    assert code == 1
    assert "diverged  timing_torch / torch@cpu: first divergence at step 3, growth_counter: expected 0, got 4" in out
    # the real scaler's parameters are read back: the planted interval is named, not blamed on growth timing
    assert "(likely cause: parameters differ: growth_interval 4 -> 5)" in out


@pytest.mark.fpemu_torch
def test_diff_catches_a_changed_profile_parameter(capsys, tmp_path, spec_dir, monkeypatch):
    golden = tmp_path / "golden"
    spec = spec_dir / "timing_torch.toml"
    profile = fpemu.PROFILES["torch"]
    planted = dataclasses.replace(profile, build=lambda p: dataclasses.replace(profile.build(p), arithmetic="fp32",
                                                                               growth_factor=2.5))
    monkeypatch.setitem(fpemu.PROFILES, "torch", planted)
    run_cli(capsys, "golden", spec, "--out", golden)
    monkeypatch.setitem(fpemu.PROFILES, "torch", profile)
    code, out, _ = run_cli(capsys, "diff", spec, "--golden", golden)
    assert code == 1 and "step 4, scale: expected 160.0" in out


@pytest.mark.fpemu_torch
def test_audit_lists_behaviour_changes_with_versions(capsys, tmp_path, spec_dir, monkeypatch):
    import torch
    baseline = tmp_path / "baseline"
    assert run_cli(capsys, "record", spec_dir / "timing_torch.toml", spec_dir / "seed_example_1.toml",
                   "--out", baseline, "--impl", "torch")[0] == 0
    code, out, _ = run_cli(capsys, "audit", "--baseline", baseline)
    assert code == 0 and out.startswith("2 recorded behaviours unchanged, 0 changed")

    class SaturatingGradScaler(torch.amp.GradScaler):
        """Planted upgrade: backs off by a quarter instead of the configured factor."""

        def __init__(self, device, backoff_factor=0.5, **kwargs):
            super().__init__(device, backoff_factor=0.25, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", SaturatingGradScaler)
    code, out, _ = run_cli(capsys, "audit", "--baseline", baseline, "--json")
    report = json.loads(out)
    assert code == 1 and len(report["changes"]) == 2
    change = report["changes"][0]
    assert change["packages_before"]["torch"] == torch.__version__
    # The real GradScaler's parameters are read back: the planted one's own backoff is the cause.
    assert change["divergence"]["cause"] == "parameters differ: backoff_factor 0.5 -> 0.25"

    class LateGradScaler(torch.amp.GradScaler):
        """Planted upgrade: needs growth_interval + 1 good steps."""

        def __init__(self, device, growth_interval=2000, **kwargs):
            super().__init__(device, growth_interval=growth_interval + 1, **kwargs)

    monkeypatch.setattr(torch.amp, "GradScaler", LateGradScaler)
    code, out, _ = run_cli(capsys, "audit", "--baseline", baseline)
    assert code == 1
    assert ("CHANGED timing_torch / torch@cpu: step 3, growth_counter: baseline 0, now 4 "
            "(likely cause: parameters differ: backoff_factor 0.5 -> 0.25, growth_interval 4 -> 5)") in out
    assert "impact: trajectory changed: final scale 256.0 -> 16.0" in out


def test_cli_bad_input_exits_2_naming_the_file(capsys, tmp_path):
    bad = tmp_path / "broken.toml"
    bad.write_text(GOOD.replace("steps = 6", "steps = -1"))
    code, _, err = run_cli(capsys, "golden", bad, "--out", tmp_path / "g")
    assert code == 2 and "broken.toml: steps: expected an integer >= 1" in err
    assert not (tmp_path / "g").exists()
    golden = tmp_path / "g2"
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    run_cli(capsys, "golden", good, "--out", golden)
    trace_file = golden / "good.json"
    trace_file.write_text(trace_file.read_text().replace("16.0", "32.0", 1))
    code, _, err = run_cli(capsys, "diff", good, "--golden", golden, "--impl", "torch")
    assert code == 2 and "good.json: checksum mismatch" in err
    code, _, err = run_cli(capsys, "audit", "--baseline", tmp_path / "empty")
    assert code == 2 and "no recorded implementation traces" in err


def test_model_driven_specs_show_why_fp16_needs_loss_scaling():
    traces = {name: reference_trace(load_spec(SPECS / f"{name}.toml"))
              for name in ("model_fp16_mlp_unscaled", "model_fp16_mlp_torch", "model_bf16_mlp_unscaled")}
    unscaled = traces["model_fp16_mlp_unscaled"].column("underflow_share")
    assert min(unscaled) > 0.5
    assert max(traces["model_fp16_mlp_torch"].column("underflow_share")) < 0.01
    assert max(traces["model_bf16_mlp_unscaled"].column("underflow_share")) == 0.0
    with pytest.raises(SpecError, match="overflow.source: a model-driven source needs a scaler that skips"):
        parse_spec(GOOD.replace('profile = "torch"', 'profile = "optax"').replace(
            "params = { init_scale = 16.0, growth_interval = 2 }", "params = { max_consecutive_errors = 1 }").replace(
            'source = "explicit"\nsequence = [false, false, true, false, false, false]', 'source = "model"'), "m.toml")


@pytest.mark.fpemu_jax_step
@pytest.mark.fpemu_torch_step
def test_step_scenarios_are_bit_exact_with_jax_and_torch(capsys, tmp_path):
    specs = [SPECS / f"step_bf16_{name}.toml" for name in ("jax_strict", "torch")]
    golden = tmp_path / "golden"
    run_cli(capsys, "golden", *specs, "--out", golden)
    code, out, _ = run_cli(capsys, "diff", *specs, "--golden", golden, "--json")
    verdicts = {(v["spec"], v["implementation"]): v for v in json.loads(out)["verdicts"]}
    assert code == 0
    assert verdicts[("step_bf16_jax_strict", "jax_step@cpu")]["status"] == "match"
    assert verdicts[("step_bf16_torch", "torch_step@cpu")]["status"] == "match"
    assert verdicts[("step_bf16_jax_strict", "jax_step@cpu")]["max_ulp"] == {"loss": 0, "params": 0}
    torch_vs_xla = verdicts[("step_bf16_jax_strict", "torch_step@cpu")]
    assert torch_vs_xla["status"] == "known divergence" and torch_vs_xla["max_ulp"]["loss"] > 0


def test_independent_spec_mistakes_are_reported_together():
    with pytest.raises(SpecError) as caught:
        parse_spec('steps = "x"\n[overflow]\nsource = "explicit"\nsequence = [false]\n'
                   '[record]\nfields = ["scale", "loss"]\n', "s.toml")
    assert str(caught.value).splitlines() == [
        "s.toml: scaler: missing required key",
        "s.toml: steps: expected an integer, got 'x'",
        "s.toml: record.fields[1]: expected one of scale, overflow, applied, growth_counter, hysteresis, update_ratio, got 'loss'"]
    with pytest.raises(SpecError) as caught:
        parse_spec('steps = 0\n[step]\nbatch = 9\n[record]\nfields = []\n', "s.toml")
    assert [line.split(":")[1].strip() for line in str(caught.value).splitlines()] == ["steps", "step.batch",
                                                                                       "record.fields"]


@pytest.mark.parametrize("extra,words", [
    ('[scaler]\nprofile = "torch"\n', r"scaler: a \[step\] scenario has its own scale rule"),
    ("[implementations.jmp]\n", "implementations.jmp: unknown implementation for a step spec"),
    ('[implementations.jax_step]\nparams = { mode = "torch_cpu" }\n', "implementations.jax_step.params.mode: expected one of"),
    ('mode = "torch_cpu"\ncompute = "fp8_e4m3fn"\n', "step.compute: expected one of bf16, fp16, got 'fp8_e4m3fn'"),
])
def test_step_spec_errors(extra, words):
    base = "steps = 4\n[step]\nbatch = 2\n"
    with pytest.raises(SpecError, match=words):
        parse_spec(base + extra, "s.toml")
    with pytest.raises(SpecError, match=r"s.toml: step.batch: expected an integer in 1..4"):
        parse_spec("steps = 4\n[step]\nbatch = 9\n", "s.toml")


def test_cli_refuses_work_it_cannot_do(capsys, tmp_path, spec_dir):
    spec = spec_dir / "timing_torch.toml"
    code, _, err = run_cli(capsys, "record", spec, "--out", tmp_path / "r", "--impl", "torch@tpu")
    assert code == 2 and "--impl torch@tpu: unknown device 'tpu'" in err
    code, _, err = run_cli(capsys, "record", spec, "--out", tmp_path / "r", "--impl", "jmp")
    assert code == 2 and "nothing to run: no spec declares or matches --impl jmp" in err
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, _, err = run_cli(capsys, "golden", spec, "--out", blocker)
    assert code == 2 and "cannot write" in err
    golden = tmp_path / "golden"
    run_cli(capsys, "golden", spec, "--out", golden)
    save = tmp_path / "saved"
    code, _, err = run_cli(capsys, "diff", spec_dir, "--golden", golden, "--save", save)
    assert code == 2 and "no golden trace for spec" in err and not save.exists()  # checked before any run


def test_comparison_is_bit_exact_and_refuses_nothing_to_compare(tmp_path):
    trace = reference_trace(load_spec(SPECS / "step_bf16_torch.toml"))
    flipped = [dict(record) for record in trace.steps]
    zero = next(i for i, v in enumerate(flipped[0]["params_hex"]) if float.fromhex(v) != 0)
    flipped[3]["params_hex"] = list(flipped[3]["params_hex"])
    flipped[3]["params_hex"][zero] = (-float.fromhex(flipped[3]["params_hex"][zero])).hex()
    verdict = compare_traces(trace, dataclasses.replace(trace, steps=tuple(flipped)))
    assert verdict.status == "diverged" and (verdict.divergence.step, verdict.divergence.field) == (3, "params")
    signed_zero = [dict(record) for record in trace.steps]
    signed_zero[0]["loss_hex"] = (-0.0).hex()
    base = [dict(record) for record in trace.steps]
    base[0]["loss_hex"] = (0.0).hex()
    verdict = compare_traces(dataclasses.replace(trace, steps=tuple(base)),
                             dataclasses.replace(trace, steps=tuple(signed_zero)))
    assert verdict.status == "diverged" and verdict.max_ulp["loss"] == 0  # -0 vs +0: 0 ulp, still different
    bare = dataclasses.replace(trace, steps=tuple({"step": r["step"]} for r in trace.steps))
    with pytest.raises(fpemu.errors.FpemuInputError, match="share no field to compare"):
        compare_traces(trace, bare)


def test_spec_names_are_unique(tmp_path):
    for folder in ("x", "y"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "a.toml").write_text(GOOD)
    with pytest.raises(SpecError, match="name 'a' is also the name of"):
        load_specs([tmp_path])


def test_trace_files_with_bad_structure_or_nan_literals_are_refused(tmp_path, capsys):
    text = dumps(reference_trace(parse_spec(GOOD, "g.toml")))
    path = tmp_path / "g.json"
    path.write_text(text.replace('"scale": 16.0', '"scale": NaN', 1))
    with pytest.raises(TraceError, match="not a trace file: the literal NaN"):
        read_trace(path)
    body = json.loads(text)
    del body["metadata"]["spec"]
    body.pop("checksum")
    from fpemu.traces.format import checksum
    body["checksum"] = checksum(body)
    path.write_text(json.dumps(body))
    with pytest.raises(TraceError, match="not a valid trace: metadata.spec: missing"):
        read_trace(path)
    code, _, err = run_cli(capsys, "report", "--reports", tmp_path / "r", "--golden", tmp_path / "nowhere")
    assert code == 2 and "--golden" in err and "no such folder" in err
    bad = tmp_path / "diff.json"
    bad.write_text("{")
    code, _, err = run_cli(capsys, "report", "--reports", tmp_path / "r", "--diff", bad)
    assert code == 2 and "not a diff result" in err


def test_run_drops_traces_of_removed_specs(tmp_path, capsys):
    specs = tmp_path / "specs"
    specs.mkdir()
    (specs / "a.toml").write_text(GOOD.replace('profile = "torch"', 'profile = "apex"').replace(
        "params = { init_scale = 16.0, growth_interval = 2 }", "params = { init_scale = 16.0 }"))
    reports = tmp_path / "reports"
    assert run_cli(capsys, "run", "--specs", specs, "--reports", reports)[0] == 0
    (specs / "a.toml").rename(specs / "b.toml")
    assert run_cli(capsys, "run", "--specs", specs, "--reports", reports)[0] == 0
    assert sorted(p.name for p in (reports / "golden").iterdir()) == ["b.json"]
    assert "### a" not in (reports / "harness.md").read_text()


# --- upgrades: every job isolated, nothing compared is not success ---------------

TWO_IMPLS = GOOD + """
[implementations.torch]
[implementations.flax_renamed]
params = { init_scale = 16.0, growth_interval = 2 }
"""


def _adapter_row(monkeypatch, name, entry, profile, packages=("jax", "jaxlib", "flax"), modules=("jax", "flax")):
    """A row of the adapter table, as a release with another API would need: real frameworks, no mocks."""
    from fpemu.adapters import ADAPTERS, Adapter
    monkeypatch.setitem(ADAPTERS, name, Adapter(name, "scaler", entry, packages, modules, profile=profile))


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_flax
def test_a_framework_that_rejects_an_argument_is_one_result_line(capsys, tmp_path, monkeypatch):
    import flax
    # flax's DynamicScale has no init_scale: the installed flax raises a real TypeError, as flax 0.6.9
    # did for minimum_scale.  The torch job of the same spec still runs and matches.
    _adapter_row(monkeypatch, "flax_renamed", "fpemu.adapters.jax_scalers:record_flax", "torch")
    spec = tmp_path / "two.toml"
    spec.write_text(TWO_IMPLS)
    golden = tmp_path / "golden"
    run_cli(capsys, "golden", spec, "--out", golden)
    code, out, _ = run_cli(capsys, "diff", spec, "--golden", golden)
    assert code == 1
    lines = out.splitlines()
    assert lines[0] == "           match  two / torch@cpu"
    assert lines[1].startswith(f"     api changed  two / flax_renamed@cpu (flax {flax.__version__}, jax ")
    assert "TypeError" in lines[1] and "init_scale" in lines[1] and "(raised at fpemu/adapters/jax_scalers.py:" in lines[1]
    assert lines[-1] == "2 jobs: 1 api changed, 1 match"
    code, out, _ = run_cli(capsys, "diff", spec, "--golden", golden, "--json")
    failed = json.loads(out)["verdicts"][1]
    assert code == 1 and failed["status"] == "api changed" and failed["packages"]["flax"] == flax.__version__

    # record: the torch trace is written (atomically, as its job ends), the failure reported, no partial file.
    baseline = tmp_path / "baseline"
    old = tmp_path / "old.toml"
    old.write_text(GOOD)
    assert run_cli(capsys, "record", old, "--out", baseline, "--impl", "torch")[0] == 0
    code, out, _ = run_cli(capsys, "record", spec, "--out", baseline)
    assert code == 1
    assert sorted(p.name for p in baseline.iterdir()) == ["two.torch-cpu.json"]
    assert "api changed  two / flax_renamed@cpu" in out
    assert f"removed 1 stale trace from {baseline} (not written by this run): old.torch-cpu.json" in out
    code, _, err = run_cli(capsys, "record", spec, "--out", golden)
    assert code == 2 and "holds golden (reference) traces" in err


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_flax
def test_audit_isolates_each_job_and_selects_implementations(capsys, tmp_path, monkeypatch):
    import flax
    _adapter_row(monkeypatch, "flax_moved", "fpemu.adapters.jax_scalers:record_flax", "flax")
    spec = tmp_path / "moved.toml"
    spec.write_text(TWO_IMPLS.replace("flax_renamed]\nparams = { init_scale = 16.0, growth_interval = 2 }",
                                      "flax_moved]\nparams = { scale = 16.0, growth_interval = 2 }"))
    baseline = tmp_path / "baseline"
    assert run_cli(capsys, "record", spec, "--out", baseline)[0] == 0
    assert run_cli(capsys, "audit", "--baseline", baseline)[0] == 0
    # The next release moved the module: importing the entry fails inside flax's package.
    _adapter_row(monkeypatch, "flax_moved", "flax.training.no_such_module:record_flax", "flax")
    code, out, _ = run_cli(capsys, "audit", "--baseline", baseline)
    assert code == 1 and out.startswith("1 recorded behaviours unchanged, 0 changed, 0 skipped, 1 failed (1 cannot run)")
    assert f"cannot run  moved / flax_moved@cpu (flax {flax.__version__}, jax" in out
    assert "ModuleNotFoundError" in out and f"was recorded with flax {flax.__version__}" in out
    assert run_cli(capsys, "audit", "--baseline", baseline, "--impl", "torch")[:2] == \
        (0, "1 recorded behaviours unchanged, 0 changed, 0 skipped\n")
    assert run_cli(capsys, "audit", "--baseline", baseline, "--exclude", "flax_moved")[0] == 0
    code, _, err = run_cli(capsys, "audit", "--baseline", baseline, "--impl", "torch@cuda")
    assert code == 2 and "nothing to audit" in err and "--impl torch@cuda" in err
    code, _, err = run_cli(capsys, "audit", "--baseline", baseline, "--impl", "pytorch")
    assert code == 2 and "--impl pytorch: unknown implementation" in err
    # A framework present in the baseline and missing now: not audited, so not a success unless allowed.
    monkeypatch.setitem(sys.modules, "flax", None)
    code, out, err = run_cli(capsys, "audit", "--baseline", baseline)
    assert code == 1 and "skipped  moved / flax_moved@cpu: flax not installed" in out
    assert "1 baseline behaviour not audited" in err and "flax_moved@cpu (1 spec): flax not installed" in err
    assert run_cli(capsys, "audit", "--baseline", baseline, "--allow-skips")[0] == 0


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_flax
def test_an_error_in_fpemu_itself_is_exit_3_after_every_job_ran(capsys, tmp_path, monkeypatch):
    # An entry that returns flax's own object instead of a trace: the harness trips over it (a bug in
    # fpemu, not a divergence nor the framework's fault), and the torch job still runs.
    _adapter_row(monkeypatch, "flax_raw", "flax.training.dynamic_scale:DynamicScale", "flax")
    spec = tmp_path / "raw.toml"
    spec.write_text(TWO_IMPLS.replace("flax_renamed]\nparams = { init_scale = 16.0, growth_interval = 2 }",
                                      "flax_raw]\nparams = { scale = 16.0 }"))
    golden = tmp_path / "golden"
    run_cli(capsys, "golden", spec, "--out", golden)
    code, out, err = run_cli(capsys, "diff", spec, "--golden", golden)
    assert code == 3 and "match  raw / torch@cpu" in out
    assert "internal error  raw / flax_raw@cpu" in out and "AttributeError" in out and "a bug in fpemu" in out
    assert "Traceback" in err


def test_impl_jax_step_runs_only_on_step_specs_that_do_not_name_their_implementations(capsys, tmp_path):
    from fpemu.harness import implementations_for
    for torch_only in ("step_bf16_torch", "step_fp16_torch"):
        assert implementations_for(load_spec(SPECS / f"{torch_only}.toml"), ["jax_step"]) == []
    assert [i.name for i in implementations_for(load_spec(SPECS / "step_bf16_jax_strict.toml"), ["jax_step"])] == \
        ["jax_step"]
    assert implementations_for(load_spec(SPECS / "timing_torch.toml"), ["jax_step"]) == []
    open_spec = parse_spec("steps = 4\n[step]\nbatch = 2\n", "open.toml")
    assert [i.name for i in implementations_for(open_spec, ["jax_step", "torch_step"])] == ["jax_step", "torch_step"]
    golden = tmp_path / "golden"
    run_cli(capsys, "golden", SPECS / "step_bf16_torch.toml", "--out", golden)
    code, _, err = run_cli(capsys, "diff", SPECS / "step_bf16_torch.toml", "--golden", golden, "--impl", "jax_step")
    assert code == 2 and "nothing to run: no spec declares or matches --impl jax_step" in err


_CORE_ONLY = ("torch", "jax", "jaxlib", "flax", "jmp", "keras", "optax", "deepspeed", "megatron", "matplotlib",
              "tensorflow", "tf_keras", "paddle")


def test_run_on_a_core_install_writes_reports_and_says_nothing_was_compared(capsys, tmp_path, monkeypatch):
    # A core install (numpy + ml_dtypes): every framework, and matplotlib, absent.
    for module in _CORE_ONLY:
        monkeypatch.setitem(sys.modules, module, None)
    monkeypatch.setenv("FPEMU_ENV_DIR", str(tmp_path / "no-environments"))
    specs = tmp_path / "specs"
    specs.mkdir()
    for name in ("timing_torch", "floor_flax", "step_bf16_jax_strict", "timing_apex"):
        shutil.copy(SPECS / f"{name}.toml", specs)
    reports = tmp_path / "reports"
    code, out, err = run_cli(capsys, "run", "--specs", specs, "--reports", reports)
    assert code == 1
    assert "skipped  floor_flax / flax@cpu: jax, flax not installed" in out
    assert "nothing compared: every job was skipped: " in err and "torch@cpu (1 spec): torch not installed" in err
    assert "jax_step@cpu (1 spec): jax not installed" in err and "--allow-skips" in err
    assert out.splitlines()[-1].startswith("wrote ") and "files under" in out.splitlines()[-1]
    profiles = (reports / "profiles.md").read_text()
    assert "plots/profiles.png" not in profiles and "matplotlib is not installed" in profiles
    assert not (reports / "plots").exists()
    assert (reports / "golden" / "timing_apex.json").exists()  # the reference traces are still written
    assert run_cli(capsys, "run", "--specs", specs, "--reports", reports, "--allow-skips")[0] == 0
    # Only source-derived profiles: there was nothing to compare, and nothing was skipped.
    for name in ("timing_torch", "floor_flax", "step_bf16_jax_strict"):
        (specs / f"{name}.toml").unlink()
    assert run_cli(capsys, "run", "--specs", specs, "--reports", reports)[0] == 0


def test_errors_from_isolated_environments_take_the_remote_exception_type():
    from fpemu.environments import EnvironmentCallError, EnvironmentTimeout
    from fpemu.harness.jobs import classify_failure
    remote = ('Traceback (most recent call last):\n  File "adapter.py", line 3, in record\n'
              "TypeError: GradScaler.__init__() got an unexpected keyword argument 'incr_every_n_steps'\n")
    assert classify_failure(EnvironmentCallError("environment 'paddle', m:f raised: TypeError: ...", remote)) == \
        "api changed"
    assert classify_failure(EnvironmentCallError("raised", "ModuleNotFoundError: No module named 'packaging'")) == \
        "cannot run"
    assert classify_failure(EnvironmentTimeout("no result within 60 s (the worker was killed)")) == "cannot run"
    assert classify_failure(ModuleNotFoundError("No module named 'packaging'")) == "cannot run"


@pytest.mark.fpemu_torch
def test_a_divergence_on_unverified_versions_names_them(tmp_path):
    """The torch adapter was verified on torch 2.13.0+cpu: a recorded trace claiming another torch
    that diverges says which versions fpemu's model was checked on."""
    from fpemu.harness.jobs import _with_unverified_versions, unverified_versions
    scenario = load_spec(SPECS / "seed_example_1.toml")
    impl = scenario.implementation("torch")
    recorded = record_trace(scenario, impl)
    other = dataclasses.replace(recorded, metadata={**recorded.metadata,
                                                    "packages": {**recorded.metadata["packages"], "torch": "2.99.0"}})
    assert unverified_versions(impl, other) == ["torch 2.13.0+cpu -> 2.99.0"]
    golden = reference_trace(scenario)
    changed = dataclasses.replace(golden, steps=golden.steps[:-1] + (
        {**golden.steps[-1], "applied": not golden.steps[-1]["applied"]},))
    verdict = _with_unverified_versions(compare_traces(changed, other), impl, other)
    assert verdict.failed and "verified on other versions: torch 2.13.0+cpu -> 2.99.0" in verdict.note
    same = _with_unverified_versions(compare_traces(golden, other), impl, other)
    assert not same.failed and "verified" not in same.note


@pytest.mark.fpemu_torch
def test_audit_reports_a_baseline_this_fpemu_refuses_and_audits_the_rest(capsys, tmp_path):
    """A baseline recorded by an older fpemu whose spec this one refuses is one result line; the
    other baselines are still audited."""
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(SPECS / "timing_torch.toml", specs)
    shutil.copy(SPECS / "seed_example_1.toml", specs)
    baseline = tmp_path / "baseline"
    assert run_cli(capsys, "record", specs, "--out", baseline, "--impl", "torch")[0] == 0
    old = baseline / "timing_torch.torch-cpu.json"
    trace = read_trace(old)
    spec = trace.metadata["spec"]
    text = spec["text"].replace("[scaler]", "colour = 1\n[scaler]")
    refused = {**spec, "text": text, "sha256": hashlib.sha256(text.encode()).hexdigest()}
    write_trace(dataclasses.replace(trace, metadata={**trace.metadata, "spec": refused}), old)
    code, out, err = run_cli(capsys, "audit", "--baseline", baseline)
    assert code == 1
    assert "cannot run  timing_torch / torch@cpu" in out and "colour: unknown key" in out
    assert "1 recorded behaviours unchanged" in out


def test_fpemu_golden_keeps_a_golden_whose_behaviour_is_unchanged(tmp_path, capsys):
    """Versions, host and the spec's path as typed are provenance: `fpemu golden` over a golden made with
    other releases leaves its bytes alone; a change of behaviour rewrites it."""
    from fpemu.traces import Trace, read_trace, write_trace
    spec = SPECS / "seed_example_1.toml"
    assert main(["golden", str(spec), "--out", str(tmp_path), "--quiet"]) == 0
    path = tmp_path / "seed_example_1.json"
    made = read_trace(path)
    older = {**made.metadata, "packages": {"numpy": "1.26.0", "ml_dtypes": "0.5.0"}, "fpemu_version": "0.0.9",
             "spec": {**made.metadata["spec"], "path": "/elsewhere/specs/seed_example_1.toml"}}
    write_trace(Trace(older, made.steps, made.summary), path)
    before = path.read_bytes()
    assert main(["golden", str(spec), "--out", str(tmp_path), "--quiet"]) == 0
    assert path.read_bytes() == before
    changed = [{**made.steps[0], "growth_counter": made.steps[0]["growth_counter"] + 1}, *made.steps[1:]]
    write_trace(Trace(older, tuple(changed), made.summary), path)
    assert main(["golden", str(spec), "--out", str(tmp_path), "--quiet"]) == 0
    assert read_trace(path).steps == made.steps and read_trace(path).metadata == made.metadata
