"""Inputs an outside fuzzer (issue 24, second round) still turned into exit 3, a hang or a write outside the
reports folder, each pinned: every one now ends in exit 0 or a named error (exit 2), or a clean result."""

import json
import os
import pathlib

import pytest

from fpemu.cli import main
from fpemu.traces import loads
from fpemu.traces.format import TraceError
from input_mutations import replaced, resealed

ROOT = pathlib.Path(__file__).resolve().parents[1]
RECORDED = ROOT / "examples" / "downstream" / "tests" / "golden" / "torch_loop.json"


def _golden(tmp_path, name, text, capsys):
    spec = tmp_path / f"{name}.toml"
    spec.write_text(text)
    code = main(["golden", str(spec), "--out", str(tmp_path / "golden"), "--quiet"])
    return code, capsys.readouterr().err, spec


def test_a_negative_zero_spread_is_zero(tmp_path, capsys):
    """`spread = -0.0` passed the bound [0, 120] and reached numpy's uniform(0.0, -0.0): 'high - low < 0', exit 3."""
    text = (ROOT / "specs" / "recipe_te_delayed_most_recent_e5m2.toml").read_text()
    assert "spread = 100.0" in text
    code, err, _ = _golden(tmp_path, "spread", text.replace("spread = 100.0", "spread = -0.0"), capsys)
    assert code == 0, err


def test_an_integer_amax_past_floats_range_is_refused_naming_the_key(tmp_path, capsys):
    text = (ROOT / "specs" / "recipe_te_current_kernel.toml").read_text()
    huge = "1" + "0" * 400
    code, err, spec = _golden(tmp_path, "amax", text.replace("sequence = [3.0,", f"sequence = [{huge},"), capsys)
    assert code == 2 and f"{spec}: amax.sequence: expected a non-empty list of amaxes" in err, err


@pytest.mark.parametrize("target", ["nul", "fifo", "folder"])
def test_a_recorded_overflow_trace_that_is_no_file_is_refused_without_waiting(tmp_path, capsys, target):
    """A NUL byte in the path was 'unexpected ValueError' (exit 3); a named pipe blocked the spec's loading for
    ever (no --timeout covers loading)."""
    path = {"nul": "a\u0000b.json", "fifo": "pipe.json", "folder": "folder.json"}[target]
    if target == "fifo":
        os.mkfifo(tmp_path / path)
    elif target == "folder":
        (tmp_path / path).mkdir()
    text = f'steps = 4\n[scaler]\nprofile = "torch"\n[overflow]\nsource = "recorded"\ntrace = {json.dumps(path)}\n'
    code, err, spec = _golden(tmp_path, "recorded", text, capsys)
    assert code == 2 and f"{spec}: overflow.trace: " in err, err
    assert {"nul": "embedded null byte", "fifo": "not a regular file (a named pipe)",
            "folder": "not a regular file (a folder)"}[target] in err


@pytest.mark.parametrize("group, value, says", [
    ("string", "\u00fcn\u00ef\u2603", "has other keys"),  # was AttributeError in compare: exit 3
    ("zero", 1e60, "zero: a share between 0 and 1"),  # was accepted
    ("hex", ["0x1p+0"], "min_nonzero_hex: a float\\.hex\\(\\) string"),  # was TypeError in compare: exit 3
])
def test_a_recorded_steps_group_statistics_are_checked(group, value, says):
    body = json.loads(RECORDED.read_text())
    stats = body["steps"][1]["grad_stats"]
    name = next(iter(stats))
    changed = {"string": value, "zero": {**stats[name], "zero": value},
               "hex": {**stats[name], "min_nonzero_hex": value}}[group]
    with pytest.raises(TraceError, match=f"steps\\[1\\].grad_stats: .*\\(group '{name}'.*{says}"):
        loads(resealed(replaced(body, ["steps", 1, "grad_stats", name], changed)), "t.json")


@pytest.mark.parametrize("where, value", [(["metadata", "spec", "name"], "../../evil"),
                                          (["metadata", "spec", "name"], "/abs/evil"),
                                          (["metadata", "implementation"], "../x")])
def test_names_that_become_file_names_hold_no_folder(tmp_path, capsys, where, value):
    """`fpemu report` wrote plots/<spec name>.png: a spec name of ../../evil put a file outside --reports."""
    body = json.loads((ROOT / "reports" / "golden" / "bernoulli_flax.json").read_text())
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / "bernoulli_flax.json").write_text(resealed(replaced(body, where, value)))
    code = main(["report", "--golden", str(golden), "--reports", str(tmp_path / "reports" / "R")])
    err = capsys.readouterr().err
    assert code == 2 and "a name without '/'" in err, err
    assert not (tmp_path / "evil.png").exists() and not list(tmp_path.rglob("evil*"))


def test_report_on_a_recorded_run_names_its_scale_a_loss_scale(tmp_path, capsys):
    """A recorded run's spec text is a description, not TOML: the report said 'error: : not valid TOML'."""
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / RECORDED.name).write_bytes(RECORDED.read_bytes())
    code = main(["report", "--golden", str(golden), "--reports", str(tmp_path / "reports")])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "reports" / "plots" / "torch_loop.png").exists()


def test_merge_traces_bounds_what_it_parses(tmp_path, capsys):
    """A merge whose result nested 100,000 deep was a RecursionError (exit 3): it is left unsealed, exit 1."""
    body = json.loads((ROOT / "reports" / "golden" / "bernoulli_flax.json").read_text())
    base, ours, theirs = (tmp_path / f"{n}.json" for n in ("base", "ours", "theirs"))
    base.write_text(resealed(body))
    theirs.write_text(resealed(body))
    deep = resealed(replaced(body, ["metadata", "profile"], "PLACEHOLDER"))
    ours.write_text(deep.replace('"PLACEHOLDER"', "[" * 100_000 + "]" * 100_000))
    code = main(["merge-traces", str(base), str(ours), str(theirs)])
    said = capsys.readouterr()
    assert code == 1 and "nested 100,002 deep, over the reader's 64" in said.err + said.out, said


@pytest.mark.parametrize("change, says", [
    (lambda b: b["steps"][0]["params"].__setitem__(0, "inf"), r"steps\[0\].params: a list is not params_hex a list"),
    (lambda b: b["steps"][0]["params"].pop(), r"steps\[0\].params: a list is not params_hex"),
    (lambda b: b["steps"][0].pop("scale_hex"), r"steps\[0\].scale_hex: missing"),
    (lambda b: b["summary"].pop("final_scale"), r"summary.final_scale: missing"),
    (lambda b: b.__setitem__("summary", {}), r"summary.attempts: missing"),
])
def test_a_resealed_trace_missing_or_contradicting_a_float_form_is_refused(change, says):
    """Accepted before: a list field whose readable values are not its hex twin's (comparisons read the hex, so
    `fpemu compare` said 'identical'), a float without one of its forms, an empty summary (`fpemu diff` matched)."""
    body = json.loads((ROOT / "reports" / "golden" / "step_bf16_torch.json").read_text())
    assert "params" in body["steps"][0]
    change(body)
    with pytest.raises(TraceError, match=says):
        loads(resealed(body), "t.json")


@pytest.mark.parametrize("value", [-(1 << 63), 1 << 40, {"nested": 1}, "x" * 300, [1, 2]])
def test_a_resealed_golden_whose_parameters_are_no_parameters_is_refused(tmp_path, capsys, value):
    """metadata.params was typed only as an object: a resealed golden with amax_history_len = -2^63 read, and
    `fpemu diff` named it as a parameter change instead of refusing the file."""
    body = json.loads((ROOT / "reports" / "golden" / "recipe_te_delayed_unfused_events.json").read_text())
    assert body["metadata"]["params"]["amax_history_len"] == 16
    text = resealed(replaced(body, ["metadata", "params", "amax_history_len"], value))
    with pytest.raises(TraceError, match=r"metadata.params: expected an object of numbers \(integers within 2\^32"):
        loads(text, "t.json")
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / "recipe_te_delayed_unfused_events.json").write_text(text)
    code = main(["report", "--golden", str(golden), "--reports", str(tmp_path / "reports")])
    err = capsys.readouterr().err
    assert code == 2 and "recipe_te_delayed_unfused_events.json" in err and "metadata.params" in err, err



@pytest.mark.parametrize("donor", ["bernoulli_torch", "recipe_te_delayed_fused_events", "step_bf16_torch"])
def test_report_refuses_a_trace_whose_steps_are_not_of_its_specs_kind(tmp_path, capsys, donor):
    """A blocks golden given another kind's metadata, resealed (found by an outside fuzzer, round 3): `fpemu report`
    drew it as its spec's kind and failed in the plot with exit 3 (float(None) of a scale the steps do not hold)."""
    body = json.loads((ROOT / "reports" / "golden" / "blocks_torchao_nvfp4.json").read_text())
    body["metadata"] = json.loads((ROOT / "reports" / "golden" / f"{donor}.json").read_text())["metadata"]
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / "blocks_torchao_nvfp4.json").write_text(resealed(body))
    code = main(["report", "--golden", str(golden), "--reports", str(tmp_path / "reports")])
    err = capsys.readouterr().err
    assert code == 2 and "blocks_torchao_nvfp4.json: not a valid trace: steps[0].block_count: a " in err, err


def test_compare_refuses_a_trace_whose_steps_are_not_of_its_specs_kind(tmp_path, capsys):
    """An mlp model golden given a recipe spec's metadata, resealed: `fpemu compare` called it identical to the
    original (round 3 of the outside fuzzer)."""
    original = ROOT / "reports" / "golden" / "model_fp16_mlp_torch.json"
    body = json.loads(original.read_text())
    body["metadata"] = json.loads((ROOT / "reports" / "golden" / "recipe_te_delayed_fused_events.json").read_text())["metadata"]
    mutated = tmp_path / "model_fp16_mlp_torch.json"
    mutated.write_text(resealed(body))
    code = main(["compare", str(mutated), str(original), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"{mutated}: not a valid trace: steps[0]." in err and "a recipe spec never records it" in err, err


@pytest.mark.parametrize("golden, profile", [("model_fp16_mlp_torch", "nope"), ("bernoulli_torch", "te_delayed"),
                                             ("blocks_torchao_nvfp4", "torch"), (None, "nope")])
def test_a_trace_naming_a_profile_its_kind_never_writes_is_refused(tmp_path, capsys, golden, profile):
    """metadata.profile was any string (outside fuzzer, round 3: a golden resealed with profile "nope" compared as
    a parameter change); a spec-made trace names one of its kind's profiles, a recorded run (no spec) any kind's."""
    original = ROOT / "reports" / "golden" / f"{golden}.json" if golden else RECORDED
    mutated = tmp_path / original.name
    mutated.write_text(resealed(replaced(json.loads(original.read_text()), ["metadata", "profile"], profile)))
    code = main(["compare", str(mutated), str(original), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"{mutated}: not a valid trace: metadata.profile: expected " in err, err
    assert f"got {profile!r}" in err, err


def test_a_spec_name_too_long_for_a_trace_file_name_is_refused_naming_the_key(tmp_path, capsys):
    """A 240-character spec name failed as "cannot write ...: File name too long", naming the output file
    (outside fuzzer, round 3); the name is bounded where the spec is read."""
    text = (ROOT / "specs" / "bernoulli_torch.toml").read_text()
    code, err, spec = _golden(tmp_path, "s", f'name = "{"n" * 129}"\n' + text, capsys)
    assert code == 2 and f"{spec}: name: expected at most 128 characters" in err, err
    code, err, _ = _golden(tmp_path, "s", f'name = "{"n" * 128}"\n' + text, capsys)
    assert code == 0, err
