"""Inputs an outside fuzzer (issue 24, rounds two to four) still turned into exit 3, a hang, a write outside the
reports folder or an accepted nonsense, each pinned: every one now ends in exit 0 or a named error (exit 2), or a
clean result."""

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


def _compare_mutated(tmp_path, capsys, original, edit):
    """`fpemu compare` of ``original`` edited by ``edit`` (parsed body -> body) and resealed, against itself:
    (exit code, stderr, the mutated file)."""
    mutated = tmp_path / original.name
    mutated.write_text(resealed(edit(json.loads(original.read_text()))))
    code = main(["compare", str(mutated), str(original), "--quiet"])
    return code, capsys.readouterr().err, mutated


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
    donor = json.loads((ROOT / "reports" / "golden" / "recipe_te_delayed_fused_events.json").read_text())
    code, err, mutated = _compare_mutated(tmp_path, capsys, ROOT / "reports" / "golden" / "model_fp16_mlp_torch.json",
                                          lambda body: {**body, "metadata": donor["metadata"]})
    assert code == 2 and f"{mutated}: not a valid trace: steps[0]." in err and "a recipe spec never records it" in err, err


@pytest.mark.parametrize("golden, profile", [("model_fp16_mlp_torch", "nope"), ("bernoulli_torch", "te_delayed"),
                                             ("blocks_torchao_nvfp4", "torch"), (None, "nope")])
def test_a_trace_naming_a_profile_its_kind_never_writes_is_refused(tmp_path, capsys, golden, profile):
    """metadata.profile was any string (outside fuzzer, round 3: a golden resealed with profile "nope" compared as
    a parameter change); a spec-made trace names one of its kind's profiles, a recorded run (no spec) any kind's."""
    original = ROOT / "reports" / "golden" / f"{golden}.json" if golden else RECORDED
    code, err, mutated = _compare_mutated(tmp_path, capsys, original,
                                          lambda body: replaced(body, ["metadata", "profile"], profile))
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


# --- round 4 (recipes, ranks, tensor files, model files) ------------------------------------------------------


@pytest.mark.parametrize("margin, refused", [(-1024, True), (128, True), (-128, True), (127, False), (-127, False)])
def test_a_margin_past_float32s_range_is_refused_naming_the_key(tmp_path, capsys, margin, refused):
    """margin = -1024 (inside the documented -1024..1024) was 'unexpected OverflowError' (exit 3) in the fused
    update's 2^-margin; margins past +-127 gave every scale 0 or inf: the bound is where 2^margin stays a finite,
    nonzero float32 factor, in a spec and on the command line."""
    text = (ROOT / "specs" / "recipe_te_delayed_fused_events.toml").read_text()
    code, err, spec = _golden(tmp_path, "margin", text.replace("margin = 2 }", f"margin = {margin} }}"), capsys)
    assert (code, f"{spec}: recipe.params.margin: expected an integer in -127..127" in err) == \
        ((2, True) if refused else (0, False)), err
    code = main(["recipe", "te_delayed", "--amax", "1", "2", "--param", f"margin={margin}"])
    assert code == (2 if refused else 0) and ("--param margin=" in capsys.readouterr().err) == refused


@pytest.mark.parametrize("value", ['"false"', "0", "1.5", "nan", "inf"])
def test_a_recipes_flag_is_true_or_false(tmp_path, capsys, value):
    """power_of_2 = "false" turned the option ON (a truthy string); nan and inf reached the trace writer
    ('Out of range float values are not JSON compliant', exit 3)."""
    text = (ROOT / "specs" / "recipe_torchao_pow2_edges.toml").read_text()
    code, err, spec = _golden(tmp_path, "pow2", text.replace("power_of_2 = true", f"power_of_2 = {value}"), capsys)
    assert code == 2 and f"{spec}: recipe.params.power_of_2: expected true or false" in err, err


def test_a_float_hex_past_float64_is_refused_naming_the_field(tmp_path, capsys):
    """'0x1p+99999' in a resealed trace's _hex field was 'unexpected OverflowError' in the schema check (exit 3)."""
    code, err, _ = _compare_mutated(tmp_path, capsys, ROOT / "reports" / "golden" / "model_fp16_mlp_torch.json",
                                    lambda body: replaced(body, ["steps", 0, "scale_hex"], "0x1p+99999"))
    assert code == 2 and "steps[0].scale_hex: expected a float.hex() string, got '0x1p+99999'" in err, err


def test_a_trace_with_an_unknown_top_level_key_is_refused(tmp_path, capsys):
    code, err, _ = _compare_mutated(tmp_path, capsys, ROOT / "reports" / "golden" / "model_fp16_mlp_torch.json",
                                    lambda body: {**body, "zz_unknown": 1})
    assert code == 2 and "zz_unknown: unknown key; a trace holds format, version" in err, err


@pytest.mark.parametrize("name, content, says", [
    ("huge.npy", None, "mmap length is greater than file size"),  # a header alone: was MemoryError (373 GiB)
    ("cut.npz", b"PK\x03\x04" + b"\x00" * 46, "File is not a zip file"),  # was BadZipFile: exit 3
    ("garbage.npy", bytes(range(200)), "not a .npy file"),  # numpy named it pickled data
])
def test_a_tensor_file_that_is_no_array_is_refused_naming_it(tmp_path, capsys, name, content, says):
    path = tmp_path / name
    if content is None:
        import numpy as np
        with open(path, "wb") as file:
            np.lib.format.write_array_header_1_0(file, {"descr": "<f4", "fortran_order": False, "shape": (10**11,)})
    else:
        path.write_bytes(content)
    code = main(["underflow", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and f"{path}: cannot read as {path.suffix}: " in err and says in err, err


def test_ranks_errors_name_the_ranks_table_and_a_divergence_step_past_the_run(tmp_path):
    """`[ranks.overflow.1] seed = ...` was named 'overflow.seed' (neither ranks. nor the rank); a declared
    divergence at step 100,000 of a 12-step run was accepted and then reported as an undeclared one (exit 1)."""
    from fpemu.specs import SpecError, parse_spec
    text = (ROOT / "specs" / "ranks_megatron_model_parallel.toml").read_text()
    with pytest.raises(SpecError, match=r"ranks.overflow.1.seed: unknown key; allowed keys: sequence, source"):
        parse_spec(text.replace('source = "explicit"\n', 'source = "explicit"\nseed = 4294967296\n'), "r.toml")
    with pytest.raises(SpecError, match=r"ranks.expect_divergence.grad_after_reduce.step: expected a step of the "
                                        r"run \(0..11: steps = 12\), got 100000"):
        parse_spec(text.replace("step = 2\n", "step = 100000\n"), "r.toml")


def test_recipe_amaxes_are_bounded_and_a_huge_number_is_named_short(capsys):
    assert main(["recipe", "te_delayed", "--amax", *["1"] * 100_001]) == 2
    err = capsys.readouterr().err
    assert "--amax: expected at most 100,000 amaxes (a recipe spec's steps bound), got 100,001" in err, err
    assert main(["recipe", "te_delayed", "--amax", "1", "--param", "margin=" + "9" * 5000]) == 2
    err = capsys.readouterr().err  # was "margin: expected an integer, got inf", the option 5,000 digits long
    assert "expected a number within float64's range" in err and "(5000 characters)" in err and len(err) < 400, err


def test_a_users_exception_or_value_that_cannot_be_shown_is_named_by_its_type():
    """A model file's exception whose __str__ raises, and a FRAMEWORK whose __repr__ raises, ended `fpemu emulate`
    with exit 3 while the error line was being written."""
    from fpemu.errors import raised, shown

    class Unprintable(Exception):
        def __str__(self):
            raise RuntimeError("str fails")

    class Unshowable:
        def __repr__(self):
            raise RuntimeError("repr fails")

    assert raised(Unprintable()) == "Unprintable: (no message: its __str__ raised)"
    assert raised(KeyboardInterrupt()) == "KeyboardInterrupt" and raised(ValueError("x")) == "ValueError: x"
    assert shown(Unshowable()) == "a Unshowable (its __repr__ raised)"


def test_a_jax_gradient_that_is_no_float_array_is_refused():
    """A JAX model file whose grads() returned int32 gradients was emulated as if they were gradients."""
    jax = pytest.importorskip("jax")
    from fpemu.emulate._jax_loop import run_jax_steps
    state = {"w": jax.numpy.ones(3), "b": jax.numpy.ones(3)}

    def grads(params, scale, index):
        return (params["w"] * scale).sum(), {"w": params["w"], "b": params["b"].astype("int32")}

    with pytest.raises(ValueError, match=r"step 0: grads\(\) returned a gradient\['b'\] of int32"):
        run_jax_steps(grads, lambda params, g, index: params, state, steps=1)
