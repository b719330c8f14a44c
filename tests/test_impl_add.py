"""`--impl +NAME` adds an implementation to specs that do not list it (real torch GradScaler and its
sharded twin, torch 2.13 here); a +NAME that fits no spec is an error naming it."""

import pytest

from fpemu.cli import main
from fpemu.harness.jobs import implementations_for
from fpemu.specs import load_specs

SPECS = ["specs/floor_torch.toml", "specs/step_bf16_torch.toml"]


def test_plain_names_filter_and_plus_names_add():
    scaler, step = load_specs(SPECS)
    assert [i.name for i in implementations_for(scaler, ["torch_sharded"])] == []
    (added,) = implementations_for(scaler, ["+torch_sharded@cpu"])
    assert (added.name, added.device, added.params) == ("torch_sharded", "cpu", scaler.params)
    assert implementations_for(scaler, ["+flax"]) == []  # flax's profile takes no init_scale
    assert [i.name for i in implementations_for(step, ["+jax_step"])] == ["jax_step"]
    assert [i.name for i in implementations_for(step, ["jax_step"])] == []  # it lists torch_step only


@pytest.mark.fpemu_torch
def test_diff_runs_an_added_implementation_against_the_golden(tmp_path, capsys):
    golden = tmp_path / "golden"
    assert main(["golden", SPECS[0], "--out", str(golden), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["diff", SPECS[0], "--golden", str(golden), "--impl", "torch", "+torch_sharded", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "match  floor_torch / torch_sharded@cpu" in out and "2 jobs: 2 match" in out


def test_a_plus_name_that_fits_no_spec_is_an_error_naming_it(tmp_path, capsys):
    assert main(["diff", SPECS[0], "--golden", str(tmp_path), "--impl", "+flax", "--quiet"]) == 2
    assert "--impl +flax: fits none of the specs given (flax is a scaler adapter;" in capsys.readouterr().err
    assert main(["diff", SPECS[0], "--golden", str(tmp_path), "--impl", "+nosuch", "--quiet"]) == 2
    assert "--impl +nosuch: unknown implementation; known: torch, " in capsys.readouterr().err
