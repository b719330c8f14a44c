"""fpemu.compare.trace_changes and `fpemu compare`: any two traces, what differs and whether it matters.

Every trace here is made by the harness from a shipped spec (a reference, or real torch)."""

import dataclasses
import json
import math
import pathlib

import pytest

from fpemu.cli import main
from fpemu.compare import IDENTICAL, NUMERICS, TRAJECTORY, trace_changes
from fpemu.compare.changes import relative_difference, step_ranges
from fpemu.errors import FpemuInputError
from fpemu.harness import record_trace, reference_trace
from fpemu.specs import load_spec, parse_spec
from fpemu.traces import Trace, write_trace

SPECS = pathlib.Path(__file__).resolve().parent.parent / "specs"


def spec_variant(name: str, old: str = "", new: str = ""):
    """The shipped spec ``name``, with ``old`` replaced by ``new`` in its text (same path and name)."""
    path = SPECS / f"{name}.toml"
    text = path.read_text()
    assert old in text
    return parse_spec(text.replace(old, new), f"specs/{name}.toml")


@pytest.fixture(scope="module")
def settle():
    """The fp16 linear model under torch's scaler, growth_interval 8 and 4: the model decides the
    overflows, so a parameter change flips overflow verdicts and moves the final scale."""
    before = reference_trace(spec_variant("model_fp16_linear_settle"))
    after = reference_trace(spec_variant("model_fp16_linear_settle", "growth_interval = 8", "growth_interval = 4"))
    return before, after


def cli(capsys, *argv):
    code = main([*map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def differing_steps(a: Trace, b: Trace, field: str) -> list:
    return [i for i, (x, y) in enumerate(zip(a.column(field), b.column(field)))
            if (x.hex() if isinstance(x, float) else x) != (y.hex() if isinstance(y, float) else y)]


def test_a_parameter_change_is_a_trajectory_change_blamed_on_the_parameter(settle):
    before, after = settle
    changes = trace_changes(before, after)
    assert changes.kind == TRAJECTORY and not changes.identical
    flips = changes.overflow_flips
    assert list(flips.steps) == differing_steps(before, after, "overflow") and flips.count == 11
    assert changes.field("scale").count == len(differing_steps(before, after, "scale")) == 23
    assert changes.field("scale").max_rel == 3.0 and changes.field("scale").max_ulp is None
    assert changes.field("loss").max_ulp > 0 and changes.field("loss").numeric
    summary = {c.name: (c.before, c.after) for c in changes.summary}
    assert summary["final_scale"] == (65536.0, 131072.0) and summary["skipped_updates"] == (29, 34)
    assert summary["attempts"] == (80, 80) and summary["stopped_at"] == (None, None)
    assert [p.describe() for p in changes.params] == ["growth_interval 8 -> 4"] and changes.packages == ()
    assert changes.divergence.cause == "parameters differ: growth_interval 8 -> 4"  # not "growth timing"
    assert (changes.divergence.step, changes.divergence.field) == (28, "growth_counter")
    assert changes.verdict() == (
        "trajectory changed: overflow flipped at 11 of 80 steps, skipped updates 29 -> 34, final scale 65536.0 -> "
        "131072.0, completed updates 51 -> 46, scale at 23 of 80 steps, applied at 11 of 80 steps, 3 more (see the "
        "table) [parameters differ: growth_interval 8 -> 4]")
    # Trajectory fields rank above numerics-only ones in the table too.
    names = [f.field for f in changes.fields]
    assert names == ["scale", "overflow", "applied", "growth_counter", "loss", "overflow_share"]


def test_a_trace_compared_with_itself_is_identical(settle, tmp_path, capsys):
    before, _ = settle
    changes = trace_changes(before, before)
    assert changes.identical and changes.kind == IDENTICAL and changes.fields == () and changes.divergence is None
    assert changes.verdict().startswith("identical: 80 steps agree bit for bit on scale, overflow, applied")
    path = write_trace(before, tmp_path / "a.json")
    code, out, _ = cli(capsys, "compare", path, path)
    assert code == 0 and out.startswith("identical: 80 steps") and "first divergence" not in out
    code, out, _ = cli(capsys, "compare", path, path, "--json")
    report = json.loads(out)
    assert code == 0 and report["identical"] and report["exit_code"] == 0 and report["divergence"] is None


def test_cli_prints_the_verdict_divergence_and_what_differs(settle, tmp_path, capsys):
    a, b = (write_trace(trace, tmp_path / f"{name}.json") for name, trace in zip("ab", settle))
    code, out, _ = cli(capsys, "compare", a, b)
    lines = out.splitlines()
    assert code == 1 and lines[0].startswith("trajectory changed: overflow flipped at 11 of 80 steps")
    assert lines[1] == ("first divergence: step 28, growth_counter: before 4, after 0 (likely cause: parameters "
                        "differ: growth_interval 8 -> 4)")
    assert "overflow              11 / 80           -          -  29, 33-34, 40, 43, 45, 54, 65, 70, 75-76" in lines
    assert "final_scale                       65536.0               131072.0  *" in lines
    assert lines[-1] == f"after: {b} (model_fp16_linear_settle / reference)"
    code, out, _ = cli(capsys, "compare", a, b, "--json")
    report = json.loads(out)
    assert code == 1 and report["kind"] == TRAJECTORY and report["overflow_flips"] == 11
    assert report["params"] == [{"name": "growth_interval", "before": 8, "after": 4, "changed": True}]
    final = next(s for s in report["summary"] if s["name"] == "final_scale")
    assert final["before_hex"] == "0x1.0000000000000p+16" and final["after"] == 131072.0


def test_numerics_only_changes_rank_below_trajectory_ones(settle):
    # The same step in two semantics (the mode parameter): the scale and skips agree, the loss does not.
    before = reference_trace(load_spec(SPECS / "step_bf16_torch.toml"))
    after = reference_trace(spec_variant("step_bf16_torch", 'mode = "torch_cpu"', 'mode = "seed"'))
    changes = trace_changes(before, after)
    assert changes.kind == NUMERICS and [f.field for f in changes.fields] == ["loss"]
    assert changes.verdict() == ("numerics only: loss at 1 of 40 steps (max 1 ulp), scale and skips identical "
                                 "[parameters differ: mode torch_cpu -> seed]")
    assert trace_changes(*settle).kind == TRAJECTORY


@pytest.mark.fpemu_torch_step
def test_real_torch_against_another_semantics_is_numerics_only_and_timing_is_not_blamed():
    scenario = load_spec(SPECS / "step_bf16_jax_strict.toml")
    torch_step = next(impl for impl in scenario.implementations if impl.name == "torch_step")
    changes = trace_changes(reference_trace(scenario), record_trace(scenario, torch_step))
    assert changes.kind == NUMERICS and changes.profile.describe() == "profile seed_step -> torch_step"
    assert changes.params == ()  # the profiles' parameters are not comparable, so none is listed
    assert changes.divergence.cause.startswith("tensor arithmetic")
    assert changes.field("loss").max_ulp == 1 and changes.field("params").count == 40


@pytest.mark.fpemu_torch
def test_audit_groups_changes_by_the_package_whose_version_changed(capsys, tmp_path, monkeypatch):
    import torch
    import fpemu.adapters
    baseline = tmp_path / "baseline"
    assert cli(capsys, "record", SPECS / "timing_torch.toml", "--out", baseline, "--impl", "torch", "--quiet")[0] == 0

    class EagerGradScaler(torch.amp.GradScaler):
        """Planted upgrade, same parameters: each growth doubles the scale twice."""

        def update(self, new_scale=None):
            before = self._scale.item()
            super().update(new_scale)
            if self._scale.item() > before:
                self._scale.mul_(2.0)

    real_versions = fpemu.adapters.package_versions
    monkeypatch.setattr(fpemu.adapters, "package_versions",
                        lambda packages, environment=None: {**real_versions(packages, environment), "torch": "9.9.9"})
    monkeypatch.setattr(torch.amp, "GradScaler", EagerGradScaler)
    code, out, _ = cli(capsys, "audit", "--baseline", baseline, "--quiet")
    lines = out.splitlines()
    assert code == 1 and lines[1] == f"torch {torch.__version__} -> 9.9.9: 1 change"
    assert lines[2].startswith("CHANGED timing_torch / torch@cpu: step 4, scale: baseline 128.0 "
                               "(0x1.0000000000000p+7), now 256.0 (0x1.0000000000000p+8) (likely cause: "
                               f"torch {torch.__version__} -> 9.9.9: ")
    assert lines[3].startswith("        impact: trajectory changed: final scale")
    assert "summary: final_scale" in out and "numpy" not in out  # only the package that differs


def test_a_spec_change_without_parameter_changes_is_named(tmp_path):
    before = reference_trace(load_spec(SPECS / "bernoulli_torch.toml"))
    after = reference_trace(spec_variant("bernoulli_torch", "steps = 400", "steps = 300"))
    changes = trace_changes(before, after)
    assert (changes.divergence.step, changes.divergence.field) == (300, "steps")
    assert changes.divergence.cause.startswith("the spec changed (sha256 ")
    assert changes.divergence.cause.endswith("): steps 400 -> 300")  # the key that changed, named
    assert changes.field("steps").count == 100 and changes.steps_compared == 300 and changes.steps_differ == 0
    assert changes.kind == TRAJECTORY and "attempts 400 -> 300" in changes.verdict()


def test_steps_that_agree_with_summaries_that_do_not_are_a_change():
    before = reference_trace(load_spec(SPECS / "timing_torch.toml"))
    after = dataclasses.replace(before, summary={**before.summary, "final_scale": 512.0,
                                                 "final_scale_hex": (512.0).hex()})
    changes = trace_changes(before, after)
    assert changes.fields == () and changes.kind == TRAJECTORY
    assert (changes.divergence.step, changes.divergence.field) == (28, "summary.final_scale")


def test_bad_input_exits_2_naming_the_file_and_internal_errors_exit_3(settle, tmp_path, capsys, monkeypatch):
    good = write_trace(settle[0], tmp_path / "good.json")
    code, _, err = cli(capsys, "compare", good, tmp_path / "missing.json")
    assert code == 2 and "missing.json: cannot read" in err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": "something else"}))
    code, _, err = cli(capsys, "compare", other, good)
    assert code == 2 and "other.json: not a trace file" in err
    tampered = tmp_path / "tampered.json"
    tampered.write_text(good.read_text().replace('"growth_counter": 1', '"growth_counter": 2', 1))
    code, out, err = cli(capsys, "compare", good, tampered, "--json")
    assert code == 2 and "tampered.json: checksum mismatch" in err and json.loads(out)["exit_code"] == 2
    steps = tuple({"step": r["step"]} for r in settle[0].steps)  # a kind that never skips: every step completes
    bare = write_trace(dataclasses.replace(settle[0], steps=steps, summary={
        **settle[0].summary, "completed_updates": len(steps), "skipped_updates": 0}), tmp_path / "bare.json")
    code, _, err = cli(capsys, "compare", good, bare)
    assert code == 2 and f"{good} vs {bare}: the traces share no step field to compare" in err
    with pytest.raises(FpemuInputError, match="records no field"):
        trace_changes(settle[0], Trace(settle[0].metadata, tuple({"step": 0} for _ in range(3)), settle[0].summary))
    monkeypatch.setattr("fpemu.compare.trace_changes", lambda a, b, explain=None: 1 / 0)
    code, _, err = cli(capsys, "compare", good, good)
    assert code == 3 and "unexpected ZeroDivisionError" in err


def test_relative_size_and_step_runs_are_exact():
    assert relative_difference(16384.0, 2048.0) == 0.875
    assert relative_difference(math.nan, math.nan) == 0.0 and relative_difference(-0.0, 0.0) == 0.0
    assert relative_difference(math.nan, 1.0) == math.inf and relative_difference(0.0, 1e-45) == math.inf
    assert relative_difference(math.inf, -math.inf) == math.inf
    assert relative_difference([1.0, 4.0], [1.0, 5.0]) == 0.25 and relative_difference([1.0], [1.0, 2.0]) == math.inf
    assert step_ranges((3, 7, 8, 9, 20), 5) == "3, 7-9, 20"
    assert step_ranges((0, 1), 90) == "0-1, ... (88 more)"
    assert step_ranges(tuple(range(0, 40, 2)), 20, limit=3) == "0, 2, 4, ... (17 more)"
