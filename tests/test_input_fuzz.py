"""The input fuzz test (issue 24): mutated specs and traces through the CLI in-process, every one ending in
exit 0 or 2 (a named error: the file, then the key or field), never exit 3 or a hang.

Deterministic (hypothesis ``derandomize``) and bounded: a fixed number of examples, each under a time
limit (fpemu.harness.limits.time_limit), the whole under 30 s.  The mutations are tests/input_mutations.py's.
"""

import contextlib
import io
import json
import pathlib
import re
import tomllib

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from fpemu.cli import main
from fpemu.harness.limits import time_limit
from fpemu.traces import loads
from fpemu.traces.fields import FIELDS
from fpemu.traces.format import TraceError
from input_mutations import (DAMAGED_TRACES, HOSTILE_VALUES, MEANINGLESS, key_paths, mutated_spec, replaced,
                             resealed)

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Specs whose golden is fpemu's model alone (an [fp8_training] golden trains torchao for real: minutes, not a fuzz
# case) and whose loading covers every parser: scaler sources, model, step, recipe, blocks and ranks specs.
SPECS = ("bernoulli_flax", "bursts_torch", "periodic_torch_sharded", "timing_jmp", "model_fp16_mlp_torch",
         "step_bf16_torch", "recipe_te_delayed_fused_events", "recipe_te_current_kernel", "blocks_torchao_nvfp4",
         "hysteresis_megatron", "ranks_ddp_grad_scaler", "ranks_megatron_model_parallel")
GOLDENS = ("bernoulli_flax", "model_fp16_mlp_torch", "step_bf16_torch", "recipe_te_delayed_fused_events",
           "blocks_torchao_nvfp4", "hysteresis_megatron")
EXAMPLE_SECONDS = 20  # one example past this is a hang
# A spec error names the file, then the key (or says the file is not TOML / cannot be read); a [ranks] spec that
# loads is refused by `fpemu golden` as such (their goldens are `fpemu run`'s), naming the file.
NAMED = re.compile(r"error: (?P<file>\S+\.toml): ([^\s:]+: |not valid TOML|cannot read|[\d,]+ characters"
                   r"|\[ranks\] spec, which `fpemu golden` does not run)")


def _cli(argv) -> tuple:
    err = io.StringIO()
    with time_limit(EXAMPLE_SECONDS), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in argv])
    return code, err.getvalue()


def _spec_raw(name: str) -> dict:
    return tomllib.loads((ROOT / "specs" / f"{name}.toml").read_text())


@st.composite
def spec_mutations(draw):
    name = draw(st.sampled_from(SPECS))
    raw = _spec_raw(name)
    path = draw(st.sampled_from(list(key_paths(raw))))
    action = draw(st.sampled_from(("set", "set", "set", "delete", "add")))
    value = draw(st.sampled_from(HOSTILE_VALUES) | st.integers(-3, 3))
    return name, mutated_spec(raw, path, action, value)


def _check_spec(tmp_path, name: str, text: str) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    code, err = _cli(["golden", path, "--out", tmp_path / "golden", "--quiet"])
    assert code in (0, 2), err
    if code == 2:
        named = NAMED.search(err)
        assert named and named["file"] == str(path), err


@settings(max_examples=120, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(spec_mutations())
# The outside fuzzer's cases (issue 24) and this test's own finds, pinned.
@example(("bernoulli_flax", "steps = 9223372036854775807\n[scaler]\nprofile = \"flax\"\n"))
@example(("factor3_near_max_flax", (ROOT / "specs" / "factor3_near_max_flax.toml").read_text()
          .replace("growth_interval = 1", "growth_interval = 9223372036854775807")))
@example(("recipe_torchao_pow2_edges", (ROOT / "specs" / "recipe_torchao_pow2_edges.toml").read_text()
          .replace("params = { power_of_2 = true }", "params = { power_of_2 = 1979-05-27 }", 1)))
def test_mutated_specs_exit_0_or_2_naming_file_and_key(tmp_path_factory, case):
    _check_spec(tmp_path_factory.mktemp("spec"), *case)


def _golden(name: str) -> pathlib.Path:
    return ROOT / "reports" / "golden" / f"{name}.json"


def _jsonable(value):
    """A hostile value as JSON can hold it (JSON has no dates, NaN or inf: their text)."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    return value if isinstance(value, (type(None), bool, int, float, str, list, dict)) else str(value)


@st.composite
def trace_mutations(draw):
    """(golden, a damage of DAMAGED_TRACES, None) or (golden, key path, hostile value): short, so a failing
    example reads as what was done."""
    name = draw(st.sampled_from(GOLDENS))
    if draw(st.integers(0, 9)) == 0:
        return name, draw(st.sampled_from(sorted(DAMAGED_TRACES))), None
    body = json.loads(_golden(name).read_text())
    path = draw(st.sampled_from([p for p in key_paths(body) if p[0] != "checksum"]))
    return name, path, _jsonable(draw(st.sampled_from(HOSTILE_VALUES) | st.integers(-3, 3)))


def _mutated_trace(name: str, how, value) -> str:
    text = _golden(name).read_text()
    if isinstance(how, str):
        return DAMAGED_TRACES[how](text)
    return resealed(replaced(json.loads(text), how, value))


def _refused_field(path, value):
    """The field a resealed mutation at ``path`` must be refused naming, where ``value`` cannot fit there
    (a typed step field set to a value of the wrong type); else None."""
    if len(path) != 3 or path[0] != "steps" or not isinstance(path[2], str):
        return None
    field = path[2][:-4] if path[2].endswith("_hex") else path[2]
    if field not in FIELDS:
        return None
    readable, exact = FIELDS[field].value
    check = exact if path[2] != field else readable
    return f"steps[{path[1]}].{path[2]}" if check and check(value) else None


@settings(max_examples=150, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(trace_mutations())
@example(("bernoulli_flax", ("metadata", "device"), None))  # a golden whose metadata.device is null (issue 24)
@example(("bernoulli_flax", ("metadata", "device"), -1))
@example(("model_fp16_mlp_torch", ("steps", 0, "scale_hex"), "../../etc/passwd"))
@example(("bernoulli_flax", "deep_object", None))
@example(("bernoulli_flax", "huge_int", None))
def test_mutated_traces_are_compared_or_refused_naming_the_field(tmp_path_factory, case):
    name, how, value = case
    mutated = tmp_path_factory.mktemp("trace") / f"{name}.json"
    mutated.write_text(_mutated_trace(name, how, value))
    code, err = _cli(["compare", mutated, _golden(name), "--quiet"])
    assert code in (0, 1, 2), err
    if code == 2:
        assert f"{mutated}: " in err, err
    field = None if isinstance(how, str) else _refused_field(how, value)
    if field is not None:
        assert code == 2 and f"not a valid trace: {field}: expected" in err, err
    if how == ("metadata", "device") and not isinstance(value, str):
        assert code == 2 and "not a valid trace: metadata.device: expected a string, got " in err, err


@st.composite
def meaningless_traces(draw):
    """(golden name, mutation name, the resealed text), or None where the mutation does not apply to it."""
    name, other = draw(st.sampled_from(GOLDENS)), draw(st.sampled_from(GOLDENS))
    how = draw(st.sampled_from(sorted(MEANINGLESS)))
    body, donor = json.loads(_golden(name).read_text()), json.loads(_golden(other).read_text())
    applied = MEANINGLESS[how](body, donor, draw(st.integers(0, 1000)))
    return name, how, resealed(body) if applied else None


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(meaningless_traces())
def test_well_typed_meaningless_traces_are_refused_naming_the_field(case):
    """Every value fits its type, and the trace still means nothing (a field of another kind, a record short of
    one, counts that are not the steps', an edited spec): refused, naming where."""
    name, how, text = case
    if text is None:
        return
    with pytest.raises(TraceError, match=r"not a valid trace: (steps\[\d+\]\.\w+|summary\.\w+|metadata\.spec"
                                         r"\.sha256): "):
        loads(text, f"{name}.json")


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(trace_mutations(), st.sampled_from(("ours", "theirs", "base")))
@example(("bernoulli_flax", "deep_object", None), "theirs")
@example(("bernoulli_flax", ("metadata", "params", "seed"), -(1 << 63)), "base")
def test_mutated_traces_merge_or_are_refused_naming_the_file(tmp_path_factory, case, side):
    """git's merge driver (`fpemu merge-traces`) on a mutated base, ours or theirs: merged (0), a conflict (1)
    or a named error (2), never exit 3 or a hang."""
    name, how, value = case
    folder = tmp_path_factory.mktemp("merge")
    paths = {which: folder / f"{which}.json" for which in ("base", "ours", "theirs")}
    for which, path in paths.items():
        path.write_text(_mutated_trace(name, how, value) if which == side else _golden(name).read_text())
    code, err = _cli(["merge-traces", paths["base"], paths["ours"], paths["theirs"], "--quiet"])
    assert code in (0, 1, 2), err


@settings(max_examples=6, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(trace_mutations())
@example(("bernoulli_flax", ("metadata", "spec", "name"), "../../evil"))
def test_mutated_goldens_are_reported_or_refused_naming_the_file(tmp_path_factory, case):
    """`fpemu report` over a golden folder holding one mutated trace: written (0) or a named error (2) naming the
    file, never exit 3, a hang or a file outside --reports."""
    name, how, value = case
    folder = tmp_path_factory.mktemp("report")
    (folder / "golden").mkdir()
    mutated = folder / "golden" / f"{name}.json"
    mutated.write_text(_mutated_trace(name, how, value))
    code, err = _cli(["report", "--golden", folder / "golden", "--reports", folder / "out" / "reports", "--quiet"])
    assert code in (0, 2), err
    if code == 2:
        assert str(mutated) in err, err
    assert {p.parent.name for p in folder.rglob("*") if p.is_file()} <= {"golden", "reports", "plots", "out"}
