"""[fp8_training] specs in the golden/diff workflow: a torchao Float8Linear model trained for real on the CPU,
every cast's amax, scale and fp8 codes per step against fpemu's model of the recipe; bad specs are refused
naming the file and key; a divergence names its step and cast; without torchao the job is a skip line.

The real runs are short (6 steps of a 16-32-16 MLP); the committed goldens hold for the packages in their
metadata, and a test that needs them to equal this run skips with the reason where the versions differ.
FPEMU_TEST_ENVS=1 adds 20-step runs of every model and recipe (about 15 s)."""

import json
import pathlib
import shutil
import sys

import pytest

from fpemu.cli import main
from fpemu.errors import FpemuInputError
from fpemu.specs import Fp8TrainingScenario, load_spec, parse_spec
from fpemu.traces import read_trace, write_trace

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("fp8_training_*.toml"))
GOLDEN = ROOT / "reports" / "golden"

GOOD = '''
steps = 3
[fp8_training]
model = "mlp"
recipe = "tensorwise"
seed = 1
'''


def test_spec_loads_with_its_real_run_and_every_fp8_field():
    scenario = parse_spec(GOOD, "good.toml")
    assert isinstance(scenario, Fp8TrainingScenario) and (scenario.recipe, scenario.seed, scenario.steps) == (
        "tensorwise", 1, 3)
    assert scenario.record == ("fp8_casts", "tensor_amax", "tensor_scale", "fp8_codes")
    assert [impl.name for impl in scenario.implementations] == ["torchao_float8_linear"]
    assert scenario.profile == "torchao_tensorwise" and scenario.golden_needs == "torchao_float8_linear"


@pytest.mark.parametrize("edit, words", [
    (('recipe = "tensorwise"', 'recipe = "nvfp4"'), "fp8_training.recipe: expected one of tensorwise, rowwise"),
    (('recipe = "tensorwise"', ''), "fp8_training.recipe: expected one of"),
    (('model = "mlp"', 'model = "gpt2"'), "fp8_training.model: expected one of mlp"),
    (("seed = 1", 'seed = "1"'), "fp8_training.seed: expected an integer"),
    (("steps = 3", "steps = 1.5"), "steps: expected an integer"),
    (("steps = 3", ""), "steps: missing required key"),
    (("seed = 1", "seed = 1\nlr = 0.1"), "fp8_training.lr: unknown key"),
    (('[fp8_training]\nmodel = "mlp"\nrecipe = "tensorwise"\nseed = 1', 'fp8_training = "tensorwise"'),
     "fp8_training: expected a table"),
    (("steps = 3", "steps = 3\n[amax]\nsource = 'explicit'"), "amax: an \\[fp8_training\\] scenario trains"),
    (("seed = 1", "seed = 1\n[record]\nfields = ['scale']"), "record.fields\\[0\\]: expected one of fp8_casts"),
])
def test_bad_specs_name_file_and_key(edit, words):
    with pytest.raises(FpemuInputError, match=f"^bad.toml: .*{words}"):
        parse_spec(GOOD.replace(*edit), "bad.toml")


def test_committed_goldens_are_current_and_hold_nothing_of_the_host():
    assert [path.stem for path in SPECS] == ["fp8_training_torchao_rowwise", "fp8_training_torchao_tensorwise"]
    for spec in SPECS:
        golden = read_trace(GOLDEN / f"{spec.stem}.json")
        meta = golden.metadata
        assert meta["spec"]["sha256"] == load_spec(spec).sha256 and meta["implementation"] == "reference"
        assert "host" not in meta and set(meta["packages"]) == {"numpy", "ml_dtypes", "torch", "torchao"}
        assert golden.steps[0]["fp8_casts"][:2] == ["layer0.input", "layer0.weight"] and len(golden.steps) == 6
        text = (GOLDEN / f"{spec.stem}.json").read_text()
        assert "/" not in json.dumps(meta["params"]) and "cpu_features" not in text and "/work" not in text


def _same_versions_as_golden(spec):
    """Skip unless torch and torchao, whose casts the golden holds, are the golden's releases (numpy's and
    ml_dtypes' are provenance: fpemu's model is the same on every supported release)."""
    from fpemu.adapters import package_versions
    held = {name: version for name, version in read_trace(GOLDEN / f"{spec.stem}.json").metadata["packages"].items()
            if name in ("torch", "torchao")}
    here = package_versions(held)
    if here != held:
        pytest.skip(f"the committed golden holds for {held}; here {here}")


def test_real_run_diffs_against_the_golden_and_names_the_cast(capsys, tmp_path):
    """torchao's Float8Linear run matches the committed golden bit for bit; a golden with one scale changed
    is reported at its step and cast, by `fpemu diff` and by `fpemu compare`."""
    pytest.importorskip("torchao.float8")
    spec = ROOT / "specs" / "fp8_training_torchao_tensorwise.toml"
    _same_versions_as_golden(spec)
    observed = tmp_path / "observed"
    assert main(["diff", str(spec), "--golden", str(GOLDEN), "--save", str(observed), "--json", "--quiet"]) == 0
    verdict, = json.loads(capsys.readouterr().out)["verdicts"]
    assert (verdict["status"], verdict["steps_compared"]) == ("match", 6)
    recorded = read_trace(observed / "fp8_training_torchao_tensorwise.torchao_float8_linear-cpu.json")
    assert recorded.metadata["same_tensors_model"] == {"status": "match", "divergence": None}

    golden = read_trace(GOLDEN / "fp8_training_torchao_tensorwise.json")
    step = dict(golden.steps[4])
    scales = [list(values) for values in step["tensor_scale_hex"]]
    scales[3] = [(float.fromhex(scales[3][0]) * 2).hex()]  # layer1.weight's scale, one binade off
    step["tensor_scale_hex"] = scales
    step["tensor_scale"] = [[float.fromhex(h) for h in values] for values in scales]  # the readable twin too
    changed = type(golden)(golden.metadata, golden.steps[:4] + (step,) + golden.steps[5:], golden.summary)
    write_trace(changed, tmp_path / "golden" / "fp8_training_torchao_tensorwise.json")
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "golden" / "fp8_training_torchao_tensorwise.json"),
                 str(observed / "fp8_training_torchao_tensorwise.torchao_float8_linear-cpu.json")]) == 1
    out = capsys.readouterr().out
    assert "first divergence: step 4, tensor_scale of layer1.weight:" in out
    assert "the real casts equal fpemu's model on this run's own tensors" in out


def test_without_torchao_the_job_is_a_skip_line_and_the_golden_is_kept(capsys, tmp_path, monkeypatch):
    """torchao absent (its import fails, as where it is not installed): `fpemu golden` keeps a current golden
    and makes none where there is none; `fpemu diff` gives one skip line naming the reason."""
    monkeypatch.setitem(sys.modules, "torchao", None)
    kept, empty = tmp_path / "kept", tmp_path / "empty"
    kept.mkdir()
    shutil.copy(GOLDEN / "fp8_training_torchao_rowwise.json", kept)
    spec = str(ROOT / "specs" / "fp8_training_torchao_rowwise.toml")
    capsys.readouterr()
    assert main(["golden", spec, "--out", str(kept), "--quiet"]) == 0
    assert (kept / "fp8_training_torchao_rowwise.json").read_bytes() == (
        GOLDEN / "fp8_training_torchao_rowwise.json").read_bytes()
    assert capsys.readouterr().out.startswith(f"kept {kept / 'fp8_training_torchao_rowwise.json'} for "
                                              "fp8_training_torchao_rowwise: its golden needs a real run")
    assert main(["golden", spec, "--out", str(empty), "--quiet"]) == 0 and not list(empty.glob("*.json"))
    assert "no golden for fp8_training_torchao_rowwise" in capsys.readouterr().out
    for golden in (kept, empty):
        assert main(["diff", spec, "--golden", str(golden), "--json", "--quiet", "--allow-skips"]) == 0
        verdict, = json.loads(capsys.readouterr().out)["verdicts"]
        assert (verdict["status"], verdict["note"]) == ("skipped", "torchao not installed")


@pytest.mark.stage2("20-step runs of every model; the shipped specs' runs against their goldens above")
@pytest.mark.parametrize("model", ["mlp", "mlp_wide"])
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_every_model_and_recipe_matches_for_20_steps(model, recipe):
    pytest.importorskip("torchao.float8")
    from fpemu.compare import compare_traces
    from fpemu.harness import float8_training_traces
    observed, reference = float8_training_traces(recipe, steps=20, model=model)
    verdict = compare_traces(reference, observed)
    assert (verdict.status, verdict.steps_compared) == ("match", 20)
    assert observed.metadata["same_tensors_model"]["status"] == "match" and len(observed.steps[0]["fp8_casts"]) == 12
