"""Input bounds (fpemu.kinds.bounds) and the trace schema (fpemu.traces.schema): documented, and refused by name."""

import importlib
import json
import pathlib
import re
import time

import pytest

from fpemu.cli import main
from fpemu.specs import SpecError, parse_spec
from fpemu.harness.limits import JobTimedOut, time_limit
from fpemu.kinds.bounds import BOUNDS, bound_for
from fpemu.traces import read_trace
from fpemu.traces.format import TraceError
from fpemu.traces import schema
from input_mutations import DAMAGED_TRACES, resealed

ROOT = pathlib.Path(__file__).resolve().parents[1]
TABLE = re.compile(r"<!-- table: (\S+) -->\n(.*?)\n<!-- end table -->", re.DOTALL)


def test_docs_bounds_tables_are_the_tables():
    page = (ROOT / "docs" / "bounds.md").read_text()
    tables = TABLE.findall(page)
    assert [name for name, _ in tables] == ["fpemu.kinds.bounds.bounds_table", "fpemu.traces.schema.read_limits_table",
                                            "fpemu.traces.schema.schema_table"]
    for name, text in tables:
        module, _, function = name.rpartition(".")
        assert text == getattr(importlib.import_module(module), function)(), f"docs/bounds.md: {name} is stale"


def test_bound_rows_match_their_keys():
    assert bound_for("implementations.torch.expect_divergence.step").key == "implementations.*.expect_divergence.step"
    assert bound_for("ranks.world_sizes[12]").maximum == 16
    assert bound_for("recipe.params.amax_history_len").maximum == 1 << 16
    with pytest.raises(LookupError, match="no bound .* 'blocks.nowhere'"):
        bound_for("blocks.nowhere")
    assert len({row.key for row in BOUNDS}) == len(BOUNDS)


# The fuzzer's cases from issue 24: counts that reached numpy (exit 3) or ran until killed.
@pytest.mark.parametrize("spec, old, new, words", [
    ("bernoulli_flax", "steps = 400", "steps = 9223372036854775807", "steps: expected an integer in 1..100,000"),
    ("bernoulli_flax", "steps = 400", "steps = 1000000", "steps: expected an integer in 1..100,000 for a scaler"),
    ("model_fp16_mlp_torch", "steps = 60", "steps = 100000", "steps: expected an integer in 1..10,000 for a model"),
    ("step_bf16_torch", "steps = 40", "steps = 9223372036854775807", "steps: expected an integer in 1..10,000"),
    ("fp8_training_torchao_tensorwise", "steps = 6", "steps = 9223372036854775807",
     "steps: expected an integer in 1..1,000 for a fp8_training"),
    ("recipe_te_delayed_fused_events", "amax_history_len = 16", "amax_history_len = 9223372036854775807",
     "recipe.params.amax_history_len: expected an integer in 1..65,536"),
    ("factor3_near_max_flax", "growth_interval = 1", "growth_interval = 9223372036854775807",
     "scaler.params.growth_interval: expected an integer in -1,000,000,000..1,000,000,000"),
    ("bernoulli_flax", "steps = 400", "steps = " + "9" * 5000, "not valid TOML: Exceeds the limit"),
    ("bernoulli_flax", "steps = 400", "steps = 400\nx = " + "[" * 50_000 + "]" * 50_000, "nested too deep"),
])
def test_spec_counts_are_bounded_at_load(spec, old, new, words):
    text = (ROOT / "specs" / f"{spec}.toml").read_text()
    assert old in text
    with pytest.raises(SpecError, match=f"^{spec}.toml: .*{words}"):
        parse_spec(text.replace(old, new, 1), f"{spec}.toml")


def test_a_spec_over_the_size_bound_is_refused_unread(tmp_path, capsys):
    big = tmp_path / "big.toml"
    big.write_text("steps = 1\n" + "# padding\n" * 300_000)
    assert main(["golden", str(big), "--out", str(tmp_path / "g"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{big}: " in err and "over the 2,097,152 a reader of it accepts" in err, err


def _golden_body(name: str = "bernoulli_flax"):
    return json.loads((ROOT / "reports" / "golden" / f"{name}.json").read_text())


# Structurally wrong traces whose checksum was recomputed: each is refused, naming the field.
@pytest.mark.parametrize("edit, words", [
    (lambda b: b["metadata"].update(device=None), "metadata.device: expected a string, got null"),
    (lambda b: b["metadata"].update(device=-1), "metadata.device: expected a string, got -1"),
    (lambda b: b["metadata"].update(packages=[[]]), "metadata.packages: expected an object of strings, got a list"),
    (lambda b: b["metadata"].pop("fpemu_version"), "metadata.fpemu_version: missing"),
    (lambda b: b["metadata"].update(extra=1), "metadata.extra: unknown key"),
    (lambda b: b["steps"][0].update(scale_hex=1), r"steps\[0\].scale_hex: expected a float.hex\(\) string, got 1"),
    (lambda b: b["steps"][1].update(scale_hex="../../etc/passwd"), r"steps\[1\].scale_hex: expected a float.hex"),
    (lambda b: b["steps"][2].update(step=7), r"steps\[2\].step: expected 2 \(records are in step order\), got 7"),
    (lambda b: b["steps"][0].update(overflow="no"), r"steps\[0\].overflow: expected true or false, got 'no'"),
    (lambda b: b["steps"][0].update(growth_counter=[1, 2]), r"steps\[0\].growth_counter: expected an integer"),
    (lambda b: b["steps"].__setitem__(0, []), r"steps\[0\]: expected an object, got a list"),
    (lambda b: b["steps"][0].update(scale=0.5), r"steps\[0\].scale: 0.5 is not scale_hex 0x1.0000000000000p\+16"),
    (lambda b: b["summary"].update(final_scale="nan"), "summary.final_scale: 'nan' is not final_scale_hex"),
    (lambda b: b["summary"].update(events="x"), "summary.events: expected a list of \\[step, text\\] pairs"),
    (lambda b: b["summary"].update(attempts=-1), "summary.attempts: expected an integer >= 0, got -1"),
    (lambda b: b.update(steps={}), "steps: expected a list of step records, got an object"),
    # each value fits on its own, not with the others: ranges, one kind's fields, the counts, the spec's digest
    (lambda b: b["steps"][0].update(scale=-1.0, scale_hex=(-1.0).hex()), r"steps\[0\].scale: expected a number >= 0"),
    (lambda b: b["steps"][3].update(amax=1.0, amax_hex="0x1p+0"),
     r"steps\[3\].amax: no scenario kind records it beside applied, growth_counter, overflow, scale \(it is "
     r"recorded by recipe; this is a trace of any kind but a recorded run's\)"),
    (lambda b: b["steps"][0].update(grad_norm=1.0, grad_norm_hex="0x1p+0"), r"steps\[0\].grad_norm: no scenario kind"),
    (lambda b: b["steps"][4].pop("overflow"), r"steps\[4\].overflow: missing \(every record of the trace holds it"),
    (lambda b: b["summary"].update(attempts=3), r"summary.attempts: expected \d+ \(the number of step records\)"),
    (lambda b: b["summary"].update(skipped_updates=b["summary"]["skipped_updates"] + 1),
     r"summary.skipped_updates: expected \d+ \(the steps whose applied is false\)"),
    (lambda b: b["metadata"]["spec"].update(text=b["metadata"]["spec"]["text"] + "# edited\n"),
     r"metadata.spec.sha256: expected [0-9a-f]{64} \(the sha256 of metadata.spec.text\)"),
])
def test_a_resealed_wrong_trace_is_refused_naming_the_field(tmp_path, edit, words):
    body = _golden_body()
    edit(body)
    path = tmp_path / "t.json"
    path.write_text(resealed(body))
    with pytest.raises(TraceError, match=f"t.json: not a valid trace: {words}"):
        read_trace(path)


@pytest.mark.parametrize("golden, edit, words", [
    ("recipe_torchao_tensorwise", lambda b: b["steps"][1].update(overflow=True),
     r"steps\[1\].overflow: no scenario kind records it beside amax, amax_used, scale, scale_inv"),
    ("recipe_torchao_tensorwise", lambda b: b["steps"][0].update(amax=-2.0, amax_hex=(-2.0).hex()),
     r"steps\[0\].amax: expected a number >= 0"),
    ("model_fp16_mlp_torch", lambda b: b["steps"][0].update(underflow_share=1.5, underflow_share_hex=(1.5).hex()),
     r"steps\[0\].underflow_share: expected a share between 0 and 1, got 1.5"),
    ("blocks_torchao_nvfp4", lambda b: b["steps"][0].update(block_count=-3), r"steps\[0\].block_count: expected an "
                                                                              r"integer >= 0"),
    ("step_fp16_torch", lambda b: b["steps"][2].update(block_input="edges"),
     r"steps\[2\].block_input: no scenario kind records it beside"),
])
def test_a_resealed_trace_of_another_kind_is_refused_naming_the_field(tmp_path, golden, edit, words):
    """Every kind's golden is held to its kind's fields and their ranges, not only the scaler's."""
    body = _golden_body(golden)
    edit(body)
    path = tmp_path / "t.json"
    path.write_text(resealed(body))
    with pytest.raises(TraceError, match=f"t.json: not a valid trace: {words}"):
        read_trace(path)


@pytest.mark.parametrize("damage, words", [
    ("deep_list", "JSON nested 100,000 deep, over the reader's 64"),
    ("deep_object", "JSON nested 50,000 deep"),
    ("huge_int", "a number of 5,001 digits, over the reader's 64"),
    ("huge_float", "a number of 5,000 digits, over the reader's 64"),
    ("nan_literal", "the literal NaN"),
    ("truncated", "invalid JSON"),
    ("garbage", "invalid JSON"),
    ("empty", "invalid JSON"),
    ("bare_list", "'format' is not 'fpemu-trace'"),
])
def test_damaged_traces_are_refused_before_parsing(tmp_path, capsys, damage, words):
    golden = ROOT / "reports" / "golden" / "bernoulli_flax.json"
    path = tmp_path / "t.json"
    path.write_text(DAMAGED_TRACES[damage](golden.read_text()))
    assert main(["compare", str(path), str(golden)]) == 2
    err = capsys.readouterr().err
    assert f"{path}: not a trace file" in err and words in err, err


def test_the_scan_leaves_strings_out():
    text = json.dumps({"a": 'x\\" [[[ "' + "9" * 100, "b": [12345, 1.5e300, [[[]]]]})
    assert schema._scan(text.encode()) == (5, 5)  # escaped quotes end no string; digits in strings are no number


def test_an_oversize_trace_is_refused_before_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "t.json"
    path.write_text((ROOT / "reports" / "golden" / "bernoulli_flax.json").read_text())
    monkeypatch.setitem(schema.READ_LIMITS, "bytes", 1000)
    with pytest.raises(TraceError, match=r"t.json: [\d,]+ bytes, over the 1,000 a reader of it accepts"):
        read_trace(path)


def test_a_trace_over_the_step_bound_is_refused(tmp_path, monkeypatch):
    body = _golden_body()
    monkeypatch.setitem(schema.READ_LIMITS, "steps", 10)
    path = tmp_path / "t.json"
    path.write_text(resealed(body))
    with pytest.raises(TraceError, match="steps: 400 records, over the reader's 10"):
        read_trace(path)


def test_a_job_past_timeout_is_one_result_line(tmp_path, capsys):
    pytest.importorskip("torch")
    spec = tmp_path / "long_torch.toml"
    spec.write_text((ROOT / "specs" / "bernoulli_torch.toml").read_text().replace("steps = 400", "steps = 100000"))
    assert main(["golden", str(spec), "--out", str(tmp_path / "g"), "--quiet"]) == 0
    code = main(["diff", str(spec), "--golden", str(tmp_path / "g"), "--impl", "torch", "--timeout", "0.5", "--quiet"])
    out = capsys.readouterr().out
    assert code == 1 and "cannot run  long_torch / torch@cpu" in out and "timed out after 0.5 s (--timeout)" in out, out


def test_a_golden_past_timeout_is_one_line_and_keeps_the_current_golden(tmp_path, capsys):
    quick, slow = tmp_path / "quick.toml", tmp_path / "slow.toml"
    model = (ROOT / "specs" / "model_fp16_mlp_torch.toml").read_text()
    quick.write_text(model)
    slow.write_text(re_steps(model, 10_000))  # a model-driven spec at its bound: minutes of training
    out = tmp_path / "g"
    code = main(["golden", str(quick), str(slow), "--out", str(out), "--timeout", "1", "--quiet"])
    printed = capsys.readouterr().out
    assert code == 1 and "no golden for slow: its reference model timed out after 1 s (--timeout)" in printed, printed
    assert (out / "quick.json").exists() and not (out / "slow.json").exists()


def re_steps(text: str, steps: int) -> str:
    return re.sub(r"^steps = \d+", f"steps = {steps}", text, flags=re.M)


def test_timeout_must_be_positive(tmp_path, capsys):
    assert main(["diff", str(ROOT / "specs" / "bernoulli_torch.toml"), "--golden", str(tmp_path), "--timeout", "-1"]) == 2
    assert "--timeout -1.0: expected seconds > 0" in capsys.readouterr().err


@pytest.mark.parametrize("text, words", [
    ('{"verdicts": ' + "[" * 10_000 + "]" * 10_000 + "}", "not a diff result: JSON nested 10,001 deep"),
    ('{"verdicts": [{"spec": 1}]}', r"verdicts\[0\].spec: expected a string, got 1"),
    ('{"verdicts": [{"spec": "s", "implementation": "torch@cpu", "status": "fine"}]}', r"verdicts\[0\].status: expected one of"),
    ('{"verdicts": [' + "1" * 5000 + "]}", "not a diff result: a number of 5,000 digits"),
])
def test_report_refuses_a_bad_diff_result_naming_the_key(tmp_path, capsys, text, words):
    bad = tmp_path / "diff.json"
    bad.write_text(text)
    assert main(["report", "--reports", str(tmp_path / "r"), "--golden", str(ROOT / "reports" / "golden"),
                 "--diff", str(bad), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert re.search(f"{bad}: {words}", err), err


def test_a_timeout_during_a_frameworks_import_leaves_it_importable_for_the_next_job(tmp_path):
    """The limit waits for an import in progress: raised inside torch's import, it would leave torch half-imported
    and every later torch job of the process failing (pinned: the run after a 1 ms limit matches).  The limited
    job itself ends in 0 or 1: it is stopped once no import is in progress, which a short job may never see."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    spec, golden = ROOT / "specs" / "bernoulli_torch.toml", tmp_path / "g"
    script = (f"from fpemu.cli import main\n"
              f"assert main(['golden', {str(spec)!r}, '--out', {str(golden)!r}, '--quiet']) == 0\n"
              f"first = main(['diff', {str(spec)!r}, '--golden', {str(golden)!r}, '--impl', 'torch', '--timeout', '0.001', '--quiet'])\n"
              f"second = main(['diff', {str(spec)!r}, '--golden', {str(golden)!r}, '--impl', 'torch', '--quiet'])\n"
              f"print('codes', first, second)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert re.search(r"codes [01] 0", run.stdout), run.stdout + run.stderr


class _SlowArgument:
    """A ctypes argument type whose conversion runs Python code past the limit (as fpemu's compiled rounding
    kernels' numpy arrays do, briefly): a limit reached there came out as ctypes.ArgumentError, exit 3."""

    @classmethod
    def from_param(cls, value):
        time.sleep(5)
        return value


def test_a_limit_reached_inside_a_c_call_argument_conversion_is_still_the_limit():
    import ctypes
    absolute = ctypes.CDLL(None).abs
    absolute.argtypes = [_SlowArgument]
    started = time.monotonic()
    with pytest.raises(JobTimedOut, match="timed out after 0.05 s") as raised:
        with time_limit(0.05):
            absolute(ctypes.c_int(-1))
    assert isinstance(raised.value.__cause__, ctypes.ArgumentError) and time.monotonic() - started < 2


def test_a_limit_the_job_swallowed_still_ends_it():
    with pytest.raises(JobTimedOut):
        with time_limit(0.05):
            try:
                time.sleep(5)
            except BaseException:  # noqa: BLE001 -- a framework's catch-all fallback
                pass


@pytest.mark.parametrize("where", ["main thread", "other thread"])
def test_a_job_cut_off_by_its_limit_leaves_torchs_modes_as_they_were(where):
    """A job stopped between a mode's switch and the block that switches it back (inside torch.no_grad()'s
    __enter__, or a loop's own set_grad_enabled(False) stretch) left gradients off for the process's later jobs:
    a suite run's later torch tests failed with "element 0 of tensors does not require grad"."""
    torch = pytest.importorskip("torch")

    def job():
        with pytest.raises(JobTimedOut):
            with time_limit(0.05):
                torch.set_grad_enabled(False)
                torch.set_autocast_enabled("cpu", True)
                torch.set_autocast_dtype("cpu", torch.float16)
                _busy(5)  # (not a sleep: another thread's limit is raised between bytecodes)
        return torch.is_grad_enabled(), torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")
    assert (job() if where == "main thread" else _in_a_thread(job)) == (True, False, torch.bfloat16)


def _in_a_thread(fn):
    import threading
    outcome = []

    def run():
        try:
            outcome.append(fn())
        except BaseException as error:  # noqa: BLE001 -- handed to the test
            outcome.append(error)
    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return outcome[0]


def _busy(seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "finished"


def test_a_limit_in_another_thread_than_the_main_one_stops_its_job():
    # as in a Dask worker's task thread, where SIGALRM cannot reach
    def job():
        with time_limit(0.1):
            return _busy(5)
    started = time.monotonic()
    outcome = _in_a_thread(job)
    assert isinstance(outcome, JobTimedOut) and "timed out after 0.1 s" in str(outcome)
    assert time.monotonic() - started < 2


def test_a_thread_limit_that_did_not_pass_never_reaches_the_caller_later():
    def job():
        with time_limit(0.2):
            _busy(0.05)
        return _busy(0.5)  # past where the limit would have been
    assert _in_a_thread(job) == "finished"
