"""fpemu simulate (and recipe) bound their counts as specs do (fpemu.kinds.bounds): --steps, the overflow steps and
an integer --param past its bound are exit 2 naming the option and the bound, at once (no run, no exit 3)."""

import time

import pytest

from fpemu.cli import main
from fpemu.kinds.bounds import MAX_SEED, bound_for
from fpemu.scalers import simulate_scaler
from fpemu.scalers.model import ScalerRules
from fpemu.scalers.simulate import run_rules

MAX_STEPS = bound_for("steps").limit("scaler")
MAX_PARAM = bound_for("scaler.params.growth_interval").maximum


def _refused(capsys, *argv):
    started = time.monotonic()
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2 and time.monotonic() - started < 5, (code, err)
    assert "Traceback" not in err and "unexpected" not in err, err
    return err


@pytest.mark.parametrize("option", ["--param", "--vs-param"])
def test_an_integer_param_past_its_bound_is_refused_naming_it(capsys, option):
    vs = ["--vs", "torch"] if option == "--vs-param" else []
    err = _refused(capsys, "simulate", "--steps", "4", *vs, option, "growth_interval=" + "1" + "0" * 30)
    assert f"{option} growth_interval=1{'0' * 30}" in err and f"{MAX_PARAM:,}" in err, err


def test_a_param_at_its_bound_runs(capsys):
    assert main(["simulate", "--steps", "4", "--param", f"growth_interval={MAX_PARAM}", "--json"]) == 0


def test_steps_past_the_bound_are_refused_naming_it(capsys):
    err = _refused(capsys, "simulate", "--steps", "100000000000000000000")
    assert "--steps 100000000000000000000" in err and f"{MAX_STEPS:,}" in err, err


@pytest.mark.parametrize("text", ["0-100000000000000", "3,100000", "99999999999999999999999"])
def test_overflow_steps_past_the_bound_are_refused_at_once(capsys, text):
    err = _refused(capsys, "simulate", "--overflow-steps", text)
    assert f"--overflow-steps {text}" in err and f"{MAX_STEPS - 1:,}" in err, err


def test_the_last_step_within_the_bound_runs(capsys):
    assert main(["simulate", "--overflow-steps", f"{MAX_STEPS - 1}", "--json"]) == 0


def test_a_recipe_param_past_its_bound_is_refused_naming_it(capsys):
    err = _refused(capsys, "recipe", "te_delayed", "--amax", "1", "2", "--param", "amax_history_len=" + "1" + "0" * 21)
    assert "--param amax_history_len" in err and f"{bound_for('recipe.params.amax_history_len').maximum:,}" in err, err


def test_a_huge_growth_interval_runs_in_the_library_as_never_growing():
    flags = [False, True, False, False]
    fast = simulate_scaler(flags, "torch", init_scale=8.0, growth_interval=10 ** 30)
    rules = ScalerRules(8.0, 2.0, 0.5, 10 ** 30)
    slow = run_rules(rules, flags, vectorize=False)
    assert fast.scales == slow.scales == [8.0, 8.0, 4.0, 4.0]


def test_docs_bounds_lists_the_option_bounds_it_imports():
    import pathlib
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "bounds.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ")[1:3] for line in page.splitlines()
            if line.startswith("| `fpemu ")}
    expected = {
        "`fpemu simulate --steps`": (1, MAX_STEPS),
        "`fpemu simulate --overflow-steps` (each step, each end of a range)": (0, MAX_STEPS - 1),
        "`fpemu simulate --param`, `--vs-param` (an integer)": (-MAX_PARAM, MAX_PARAM),
        "`fpemu emulate --steps`": (1, bound_for("steps").limit("model")),
        "`fpemu emulate --param` (an integer)": (-MAX_PARAM, MAX_PARAM),
        "`fpemu emulate --seed`": (0, MAX_SEED),
        "`fpemu recipe --amax` (how many)": (1, bound_for("steps").limit("recipe")),
        "`fpemu recipe --param amax_history_len=`": (1, bound_for("recipe.params.amax_history_len").maximum),
        "`fpemu recipe --param margin=`": (bound_for("recipe.params.margin").minimum,
                                           bound_for("recipe.params.margin").maximum),
        "`fpemu recipe --param` (another integer)": (bound_for("recipe.params.axis").minimum,
                                                     bound_for("recipe.params.axis").maximum),
    }
    found = {key: tuple(int(cell.replace(",", "")) for cell in rows.get(key, ("0", "0"))) for key in expected}
    assert found == expected
