"""[blocks] specs in the golden/diff workflow: a block scale rule on seeded probe blocks, one step per input
kind, fpemu's model (the golden, numpy only) against the real blocks adapters (torchao 0.18, TE's Python
references from its source) on the same blocks; bad specs are refused naming the file and key; a
divergence names its input kind and field, counts the differing codes and quotes the rules."""

import dataclasses
import json
import pathlib
import shutil
import sys

import numpy as np
import pytest

from fpemu.blocks import block_quantize
from fpemu.blocks.probes import PROBE_KINDS
from fpemu.cli import main
from fpemu.harness import write_golden
from fpemu.kinds.blocks.trace import block_record, probe_inputs
from fpemu.specs import BlocksScenario, SpecError, load_spec, parse_spec

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECS = sorted((ROOT / "specs").glob("blocks_*.toml"))
GOLDEN = ROOT / "reports" / "golden"
FIELDS = ("block_input", "block_count", "element_count", "block_tensor_scale", "scale_codes", "element_codes",
          "block_values")

GOOD = '''
[blocks]
rule = "torchao_floor"
element = "fp8_e4m3fn"
kinds = ["zeros", "random", "edges"]
rows = 16
'''


def test_spec_loads_with_the_adapters_that_drive_its_rule():
    scenario = parse_spec(GOOD, "good.toml")
    assert isinstance(scenario, BlocksScenario) and scenario.steps == 3 and scenario.record == FIELDS
    assert (scenario.rule, scenario.block_size, scenario.columns, scenario.seed) == ("torchao_floor", 32, 32, 0)
    assert [impl.name for impl in scenario.implementations] == ["torchao_blocks"]  # every adapter driving the rule
    nvfp4 = parse_spec('[blocks]\nrule = "te_nvfp4_reference"\n', "nvfp4.toml")
    assert (nvfp4.element, nvfp4.block_size, nvfp4.kinds) == ("fp4_e2m1fn", 16, PROBE_KINDS)
    assert [impl.name for impl in nvfp4.implementations] == ["te_block_reference"]
    assert parse_spec('[blocks]\nrule = "ocp"\n', "ocp.toml").implementations == ()  # no real code drives OCP


@pytest.mark.parametrize("edit, words", [
    (('rule = "torchao_floor"', 'rule = "torchao_round"'), "blocks.rule: expected one of ocp, torchao_floor"),
    (('element = "fp8_e4m3fn"', 'element = "fp16"'), "blocks.element: expected one of fp8_e4m3fn, fp8_e5m2"),
    (('"edges"]', '"edge"]'), "blocks.kinds\\[2\\]: expected one of random, wide, edges"),
    (('"edges"]', '"zeros"]'), "blocks.kinds: each kind once"),
    (("rows = 16", "rows = 0"), "blocks.rows: expected an integer >= 1, got 0"),
    (("rows = 16", "rows = 2.5"), "blocks.rows: expected an integer, got 2.5"),
    (("rows = 16", "rows = 1_000_000"), "blocks.rows: expected an integer in 1..65,536"),
    (("rows = 16", "rows = 16\nscale = 2"), "blocks.scale: unknown key"),
    (("rows = 16", "rows = 16\n[implementations.te_block_reference]"),
     "implementations.te_block_reference: te_block_reference does not drive rule 'torchao_floor'; it drives "
     "te_nvfp4_reference"),
    (("rows = 16", "rows = 16\n[implementations.torchao_blocks]\nparams = { rule = 'te_mxfp8' }"),
     "implementations.torchao_blocks.params.rule: torchao_blocks does not drive rule 'te_mxfp8'"),
    (("rows = 16", "rows = 16\n[implementations.torchao_blocks]\nparams = { rule = 'torchao_nvfp4' }"),
     "implementations.torchao_blocks.params.rule: rule 'torchao_nvfp4' takes fp4_e2m1fn, not blocks.element"),
    (("rows = 16", "rows = 16\nblock_size = 64\n[implementations.torchao_blocks]"),
     "implementations.torchao_blocks: torchao_blocks runs torchao_floor at its own block size 32"),
    (("rows = 16", "rows = 16\n[implementations.torch]"),
     "implementations.torch: unknown implementation for a blocks spec"),
    (("[blocks]", "steps = 3\n[blocks]"), "steps: a \\[blocks\\] scenario has one step per input kind"),
    (("rows = 16", "rows = 16\n[record]\nfields = ['scale']"), "record.fields\\[0\\]: expected one of block_input"),
])
def test_bad_specs_name_file_and_key(edit, words):
    with pytest.raises(SpecError, match=f"^bad.toml: .*{words}"):
        parse_spec(GOOD.replace(*edit), "bad.toml")


def test_committed_goldens_regenerate_byte_identical_without_torch(tmp_path, monkeypatch):
    """The goldens are fpemu's model alone: regenerated over the committed ones with torch and torchao
    unimportable, they keep the committed bytes (whatever numpy and ml_dtypes are installed: versions are
    provenance), and hold nothing of the host."""
    from fpemu.adapters import BLOCKS, adapters_of_kind, driven_rules
    assert {load_spec(path).rule for path in SPECS} == {rule for name in adapters_of_kind(BLOCKS)
                                                        for rule in driven_rules(name)}  # a spec per driven rule
    monkeypatch.chdir(ROOT)
    for module in ("torch", "torchao"):
        monkeypatch.setitem(sys.modules, module, None)
    for path in SPECS:
        shutil.copy(GOLDEN / f"{path.stem}.json", tmp_path)
    written = write_golden([str(path.relative_to(ROOT)) for path in SPECS], tmp_path)
    assert len(written) == len(SPECS)
    for path in written:
        text = path.read_text()
        assert text == (GOLDEN / path.name).read_text(), f"{path.name}: regenerate it with `fpemu golden`"
        assert '"host"' not in text and "/work" not in text and "/tmp" not in text


def _verdicts(capsys, *args) -> tuple:
    capsys.readouterr()
    code = main([*args, "--json", "--quiet"])
    return code, {(v["spec"], v["implementation"]): v for v in json.loads(capsys.readouterr().out)["verdicts"]}


def test_shipped_specs_match_the_real_code(capsys):
    """One match per spec x adapter x device; TE's specs skip with the adapter's own reason where its source is
    absent, the CUDA rows where CUDA is."""
    pytest.importorskip("torchao")
    from fpemu.adapters import unavailable_reason
    code, verdicts = _verdicts(capsys, "diff", *map(str, SPECS), "--golden", str(GOLDEN), "--allow-skips")
    assert code == 0 and {name for name, _ in verdicts} == {path.stem for path in SPECS}
    assert {implementation.partition("@")[2] for _, implementation in verdicts} == {"cpu", "cuda"}
    for (name, implementation), verdict in verdicts.items():
        reason = unavailable_reason(*implementation.split("@"))
        assert (verdict["status"], verdict["note"] if reason else "") == ("skipped" if reason else "match",
                                                                         reason or ""), name
        if not reason:
            assert verdict["steps_compared"] == len(load_spec(ROOT / "specs" / f"{name}.toml").kinds)


def test_an_adapter_run_under_another_rule_diverges_at_the_kind_and_field(capsys, tmp_path):
    """The golden models torchao FLOOR; the spec runs torchao itself with CEIL: `fpemu diff` exits 1 naming the
    first kind and field that differ (zeros agree: no scale to round), with the counts and both rules."""
    pytest.importorskip("torchao")
    spec = tmp_path / "floor_vs_ceil.toml"
    spec.write_text(GOOD + "[implementations.torchao_blocks]\nparams = { rule = 'torchao_ceil' }\n")
    assert main(["golden", str(spec), "--out", str(tmp_path / "golden"), "--quiet"]) == 0
    code, verdicts = _verdicts(capsys, "diff", str(spec), "--golden", str(tmp_path / "golden"),
                               "--save", str(tmp_path / "observed"))
    divergence = verdicts["floor_vs_ceil", "torchao_blocks@cpu"]["divergence"]
    assert code == 1 and verdicts["floor_vs_ceil", "torchao_blocks@cpu"]["status"] == "diverged"
    assert (divergence["step"], divergence["field"], divergence["element"]) == (1, "scale_codes", "random")
    assert divergence["message"].startswith("step 1, scale_codes of random: ")
    assert divergence["cause"].startswith("random blocks; 16 of 16 scale codes, ")
    assert ("torchao_blocks@cpu ran rule torchao_ceil (torchao 0.18.0 to_mx, ScaleCalculationMode.CEIL) where "
            "the golden is fpemu's model of torchao_floor") in divergence["cause"]
    # the counts are the recorded trace's own, made on the same blocks (not compared: metadata)
    from fpemu.traces import read_trace
    observed = read_trace(tmp_path / "observed" / "floor_vs_ceil.torchao_blocks-cpu.json")
    ceil = block_quantize(probe_inputs(load_spec(spec))[1][1], "fp8_e4m3fn", scale_rule="torchao_ceil")
    floor = block_quantize(probe_inputs(load_spec(spec))[1][1], "fp8_e4m3fn", scale_rule="torchao_floor")
    assert observed.metadata["model_differences"]["random"]["element_codes"] == int(
        np.count_nonzero(ceil.element_codes != floor.element_codes))
    assert observed.metadata["model_differences"]["zeros"]["scale_codes"] == 0

    spec.write_text(spec.read_text() + "expect_divergence = { step = 1, field = 'scale_codes', "
                                       "reason = 'CEIL rounds the scale up where FLOOR truncates' }\n")
    assert main(["golden", str(spec), "--out", str(tmp_path / "golden"), "--quiet"]) == 0
    code, verdicts = _verdicts(capsys, "diff", str(spec), "--golden", str(tmp_path / "golden"))
    assert code == 0 and verdicts["floor_vs_ceil", "torchao_blocks@cpu"]["status"] == "known divergence"


def test_scale_digests_take_any_nan_code_alike_and_element_codes_as_they_are():
    """e4m3 has two NaN codes (0x7F, 0xFF): TE's reference NVFP4 of a NaN tensor makes every scale NaN, and
    which code it stores is no behaviour; a NaN element's code is (the rule's NaN policy)."""
    x = probe_inputs(parse_spec('[blocks]\nrule = "te_nvfp4_reference"\nkinds = ["nan"]\nrows = 4\n', "n.toml"))[0][1]
    q = block_quantize(x, "fp4_e2m1fn", scale_rule="te_nvfp4_reference")
    assert np.isnan(q.scales).all()
    flipped = dataclasses.replace(q, scale_codes=q.scale_codes ^ np.uint8(0x80))
    assert block_record(0, "nan", q, FIELDS)["scale_codes"] == block_record(0, "nan", flipped, FIELDS)["scale_codes"]
    recoded = dataclasses.replace(q, element_codes=q.element_codes ^ np.uint8(0x8))
    assert block_record(0, "nan", q, FIELDS)["element_codes"] != block_record(0, "nan", recoded, FIELDS)[
        "element_codes"]
    assert block_record(0, "nan", q, FIELDS)["block_tensor_scale_hex"] == "nan"


def test_without_te_source_its_specs_are_skip_lines_naming_the_reason(tmp_path):
    """Where TE's source is absent (a fresh process: the source reads are cached), `fpemu diff` gives each TE
    spec one skip line with the adapter's reason and its versions, not an error."""
    import os
    import subprocess
    env = {**os.environ, "FPEMU_TE_SOURCE": str(tmp_path / "no-te"), "PYTHONPATH": str(ROOT)}
    specs = [str(path) for path in SPECS if load_spec(path).rule.startswith("te_")]
    run = subprocess.run([sys.executable, "-m", "fpemu", "diff", *specs, "--golden", str(GOLDEN), "--allow-skips",
                          "--json", "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    verdicts = json.loads(run.stdout)["verdicts"]
    assert len(verdicts) == 2 * len(specs) == 4 and {v["status"] for v in verdicts} == {"skipped"}  # (cpu, cuda)
    assert all(v["note"].startswith("no TransformerEngine reference source") for v in verdicts)
    assert verdicts[0]["packages"]["transformer_engine (source)"] == "not found"
