"""fp8 recipe specs in the golden/diff workflow: [recipe] + [amax] specs load (bad ones are refused
naming the file and key), their golden traces are pure functions of the spec, and the real recipe
code (TE's unfused update and reference quantizer from its source, torchao's amax_to_scale) matches
fpemu's model or departs exactly where the spec declares, and why."""

import json
import math
import pathlib

import numpy as np
import pytest

from fpemu.cli import main
from fpemu.harness import reference_trace
from fpemu.scalers.fp8_recipes import simulate_recipe
from fpemu.specs import AmaxSource, RecipeScenario, SpecError, load_spec, parse_spec
from fpemu.traces import dumps

SPECS = pathlib.Path(__file__).resolve().parent.parent / "specs"
RECIPE_SPECS = sorted(SPECS.glob("recipe_*.toml"))

GOOD = '''
steps = 3
[recipe]
name = "te_delayed"
params = { amax_history_len = 2 }
[amax]
source = "explicit"
sequence = [1.0, nan, inf]
'''


def test_recipe_spec_loads_and_golden_is_the_model():
    scenario = parse_spec(GOOD, "good.toml")
    assert isinstance(scenario, RecipeScenario) and scenario.record == ("scale", "amax", "amax_used", "scale_inv")
    trace = reference_trace(scenario)
    assert trace.metadata["profile"] == "te_delayed" and trace.metadata["verified"] == "source-derived"
    assert trace.column("scale") == list(simulate_recipe([1.0, math.nan, math.inf], "te_delayed",
                                                         amax_history_len=2).scale)
    assert dumps(trace) == dumps(reference_trace(scenario)) and "host" not in trace.metadata


def test_generated_amaxes_are_seeded_with_events():
    source = AmaxSource("generated", seed=5, magnitude=3.0, spread=30.0, zero_rate=0.08, inf_rate=0.03, nan_rate=0.03)
    amaxes = source.amaxes(200)
    assert np.array_equal(amaxes, source.amaxes(200), equal_nan=True) and amaxes.dtype == np.float32
    assert (amaxes == 0).any() and np.isinf(amaxes).any() and np.isnan(amaxes).any()


@pytest.mark.parametrize("edit, words", [
    (('name = "te_delayed"', 'name = "te_nvfp4"'), "recipe.name: expected one of te_delayed"),
    (("amax_history_len = 2", "amax_history_len = 0"), "recipe.params.amax_history_len: expected an integer in 1..65,536"),
    (("amax_history_len = 2", "amax_history_len = 9223372036854775807"),
     "recipe.params.amax_history_len: expected an integer in 1..65,536"),
    (("amax_history_len = 2", "path = 'unfused'"), "recipe.params.path: set by the recipe itself"),
    (("[1.0, nan, inf]", "[1.0, -2.0, 3.0]"), "amax.sequence: expected a non-empty list of amaxes"),
    (("[1.0, nan, inf]", "[1.0]"), "amax.sequence: expected steps=3 amaxes, got 1"),
    (('source = "explicit"', 'source = "random"'), "amax.source: expected one of explicit, generated"),
    (("[amax]", "[overflow]\nsource = 'explicit'\n[amax]"), "overflow: a \\[recipe\\] scenario takes its amaxes"),
    (("sequence = [1.0, nan, inf]", "sequence = [1.0, nan, inf]\n[implementations.torch]"),
     "implementations.torch: unknown implementation for a recipe spec"),
    (("sequence = [1.0, nan, inf]", "sequence = [1.0, nan, inf]\n[record]\nfields = ['loss']"),
     "record.fields\\[0\\]: expected one of scale, amax, amax_used, scale_inv"),
])
def test_bad_recipe_specs_name_file_and_key(edit, words):
    with pytest.raises(SpecError, match=f"^bad.toml: .*{words}"):
        parse_spec(GOOD.replace(*edit), "bad.toml")


def test_shipped_recipe_specs_cover_every_recipe_and_adapter():
    scenarios = [load_spec(path) for path in RECIPE_SPECS]
    from fpemu.adapters import adapters_of_kind
    from fpemu.scalers.fp8_recipes import RECIPES
    assert {s.recipe for s in scenarios} == set(RECIPES)
    assert {i.name for s in scenarios for i in s.implementations} == set(adapters_of_kind("recipe"))
    assert {s.amax.kind for s in scenarios} == {"explicit", "generated"}


def test_a_recipe_says_driven_exactly_when_real_code_drives_it():
    from fpemu.adapters import adapters_of_kind
    from fpemu.scalers.fp8_recipes import RECIPES
    adapted = {adapter.profile for adapter in adapters_of_kind("recipe").values()}
    driven = {name for name, row in RECIPES.items() if row.source.verified == "driven"}
    assert adapted == driven  # rowwise also through torchao's casts and Float8Linear (test_float8_training_trace...)
    assert {row.source.verified for name, row in RECIPES.items() if name not in driven} == {"source-derived"}


def test_recipe_specs_diff_against_the_real_code(capsys, tmp_path):
    """Every shipped recipe spec: the real code matches the model, or departs where the spec declares."""
    pytest.importorskip("torch")
    from fpemu.adapters import unavailable_reason
    for name in ("te_unfused", "torchao_float8"):
        if unavailable_reason(name):
            pytest.skip(f"{name}: {unavailable_reason(name)}")
    golden = tmp_path / "golden"
    assert main(["golden", *map(str, RECIPE_SPECS), "--out", str(golden), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["diff", *map(str, RECIPE_SPECS), "--golden", str(golden), "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    verdicts = {(v["spec"], v["implementation"]): v for v in result["verdicts"]}
    statuses = {key: v["status"] for key, v in verdicts.items()}
    assert set(statuses.values()) == {"match", "known divergence"}
    assert statuses[("recipe_te_delayed_unfused_events", "te_unfused@cpu")] == "match"
    assert statuses[("recipe_torchao_tensorwise", "torchao_float8@cpu")] == "match"
    assert statuses[("recipe_torchao_rowwise", "torchao_float8_rowwise@cpu")] == "match"
    zero = verdicts[("recipe_te_delayed_zero_amax", "te_unfused@cpu")]["divergence"]
    assert (zero["step"], zero["field"]) == (1, "amax_used")


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_training_trace_matches_the_model(recipe, tmp_path, capsys):
    """A Float8Linear MLP trained for real: every cast's amaxes, scales and fp8 codes per step, torchao's
    and fpemu's model's on the same tensors, are the same traces; they round-trip through trace files."""
    pytest.importorskip("torchao.float8")
    from fpemu.compare import compare_traces
    from fpemu.harness import float8_training_traces
    from fpemu.traces import read_trace, write_trace
    observed, model = float8_training_traces(recipe, steps=4)
    verdict = compare_traces(model, observed)
    assert verdict.status == "match" and verdict.steps_compared == 4
    assert sum(map(len, observed.steps[0]["tensor_scale"])) == (12 if recipe == "tensorwise" else 224)
    paths = [write_trace(t, tmp_path / f"{name}.json") for name, t in (("torchao", observed), ("model", model))]
    assert read_trace(paths[0]).steps == observed.steps
    assert main(["compare", str(paths[1]), str(paths[0])]) == 0
    tampered = dict(observed.steps[2], tensor_scale_hex=[["0x1p+0"]] + observed.steps[2]["tensor_scale_hex"][1:])
    broken = type(observed)(observed.metadata, observed.steps[:2] + (tampered,) + observed.steps[3:], observed.summary)
    divergence = compare_traces(model, broken).divergence
    assert (divergence.step, divergence.field, divergence.element) == (2, "tensor_scale", "layer0.input")


def test_cli_recipe_side_by_side(capsys):
    assert main(["recipe", "te_delayed", "--vs", "te_delayed_unfused", "--amax", "4", "0", "0", "1", "1",
                 "--param", "amax_history_len=2"]) == 0
    out = capsys.readouterr().out
    assert [line.endswith("differ") for line in out.splitlines()[-5:]] == [False, False, False, True, False]
    assert main(["recipe", "te_current", "--amax", "2", "inf", "nan", "--param", "fp8_format=fp8_e5m2", "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert [s["te_current_scale"] for s in steps] == [28672.0, 1.0, 1.0]
    bad = ((["recipe", "te_nvfp4", "--amax", "1"], "recipe te_nvfp4: unknown recipe"),
           (["recipe", "te_delayed", "--amax", "-1"], "--amax: an amax is |x|"),
           (["recipe", "te_delayed", "--amax", "1", "--param", "fp8_format=e4m3"], "fp8_format: expected"))
    for argv, words in bad:
        assert main(argv) == 2 and words in capsys.readouterr().err
