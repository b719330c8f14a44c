"""fpemu matrix and fpemu bisect: version sets, the behaviour table, the report, the bisection.

The table, report and bisection tests run on real recorded traces without a network:
``tests/data/upgrades/jax_steps/`` holds traces of seed 002's step recorded under jax.jit by
``fpemu matrix matrices/jax_steps.toml`` in one environment per JAX release (their ``host``
entry removed, as committed files must not carry the host).  The recording path itself runs
for real through an environment whose Python is this interpreter (no build).  Tests that build
environments with pip run where FPEMU_TEST_ENVS=1.
"""

import json
import pathlib
import sys

import pytest

from fpemu.cli import main
from fpemu.errors import FpemuInputError
from fpemu import environments
from fpemu.harness.bisect import assumption, bisect_versions, bisection_results, versions_in_range
from fpemu.harness.matrix import (CANNOT_INSTALL, Cell, Column, MatrixPlan, VersionSet, host_free, load_plan,
                                  matrix_results, package_set, plan_from_options, product_sets, read_column,
                                  record_column, reference_traces)
from fpemu.reports.upgrades import read_results, write_results
from fpemu.traces import read_trace

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIXTURES = pathlib.Path(__file__).parent / "data" / "upgrades" / "jax_steps"
VERSIONS = ["0.4.31", "0.4.33", "0.4.35", "0.5.3", "0.6.0", "0.7.2", "0.9.2", "0.10.2"]
SPECS = [str(ROOT / "specs" / "step_fp16_jax_default.toml"), str(ROOT / "specs" / "step_bf16_jax_strict.toml")]
needs_env_builds = pytest.mark.stage2("builds venvs with pip (network, ~1 min each); the matrix over recorded "
                                      "columns in the tests above")


def recorded(version: str) -> Column:
    """The real recording of jax ``version`` (one folder of fixtures)."""
    return read_column(VersionSet(f"jax {version}"), FIXTURES / version)


def raw_behaviours(version: str) -> dict:
    """spec -> the steps and summary of its fixture, as plain JSON text: an oracle independent of
    fpemu's digest."""
    out = {}
    for path in sorted((FIXTURES / version).glob("*.json")):
        body = json.loads(path.read_text())
        out[body["metadata"]["spec"]["name"]] = json.dumps([body["steps"], body["summary"]], sort_keys=True)
    return out


def expected_letters(spec: str) -> list:
    letters, seen = [], {}
    for version in VERSIONS:
        behaviour = raw_behaviours(version)[spec]
        letters.append(seen.setdefault(behaviour, chr(ord("A") + len(seen))))
    return letters


# --- version sets and plans ---------------------------------------------------------

def test_a_jax_version_brings_its_jaxlib_and_axes_multiply():
    assert package_set("jax", "0.4.31", ("numpy==2.4.6",)).requirements == ("jax==0.4.31", "jaxlib<=0.4.31",
                                                                           "numpy==2.4.6")
    sets = product_sets({"jax": ["0.4.31", "0.10.2"], "flax": ["0.8.0", "0.12.8"]})
    assert [s.label for s in sets] == ["jax 0.4.31, flax 0.8.0", "jax 0.4.31, flax 0.12.8",
                                       "jax 0.10.2, flax 0.8.0", "jax 0.10.2, flax 0.12.8"]
    assert sets[1].requirements == ("jax==0.4.31", "jaxlib<=0.4.31", "flax==0.12.8")
    assert len({s.slug for s in sets}) == 4


def test_committed_plans_load():
    plan = load_plan(ROOT / "matrices" / "jax_steps.toml")
    assert plan.name == "jax_steps" and plan.implementations == ("jax_step",)
    assert [s.label for s in plan.sets] == [f"jax {v}" for v in VERSIONS]
    assert plan.sets[0].requirements[-2:] == ("numpy==2.4.6", "ml_dtypes==0.6.0")
    for name in ("flax_dynamic_scale", "keras3", "torch", "paddle"):
        assert load_plan(ROOT / "matrices" / f"{name}.toml").name == name


@pytest.mark.parametrize("text, message", [
    ('name = "x"\nspecs = ["../specs/timing_flax.toml"]\n', "no version sets"),
    ('name = "x y"\nspecs = []\n', "name: expected a word"),
    ('name = "x"\nspecs = ["../specs/timing_flax.toml"]\nwhat = 1\n', "unknown keys \\['what'\\]"),
    ('name = "x"\nspecs = ["../specs/timing_flax.toml"]\n[[set]]\nlabel = "a"\n', "give either requirements or "
     "environment"),
    ('name = "x"\nspecs = ["../specs/timing_flax.toml"]\n[[set]]\nlabel = "a"\nenvironment = "nope"\n',
     "unknown environment 'nope'"),
    ('name = "x"\nspecs = ["../specs/timing_flax.toml"]\n[versions]\njax = ["1", "1"]\n', "labels repeat: jax 1"),
    ('name = "x"\nspecs = ["../specs/nope.toml"]\n[versions]\njax = ["1"]\n', "nope.toml"),
])
def test_bad_plans_are_input_errors_naming_the_key(tmp_path, text, message):
    (tmp_path / "plans").mkdir()
    plan = tmp_path / "plans" / "p.toml"
    plan.write_text(text.replace("../specs/", f"{ROOT}/specs/"))
    with pytest.raises(FpemuInputError, match=message):
        load_plan(plan)


def test_matrix_cli_without_a_plan_or_versions_is_exit_2(capsys):
    assert main(["matrix", "--name", "x"]) == 2
    assert "give --name, --specs and at least one version option" in capsys.readouterr().err
    assert main(["matrix", "--name", "x", "--specs", SPECS[0], "--jax", " , "]) == 2
    assert "--jax: expected versions separated by commas" in capsys.readouterr().err


def test_host_free_keeps_package_paths_and_drops_the_machine():
    home = str(pathlib.Path.home())
    text = (f"ModuleNotFoundError at {home}/.cache/fpemu/envs/matrix-x/lib/python3.11/site-packages/jax/_src/a.py:3"
            " / pip: /tmp/fpemu-stage-1/fpemu-source does not exist")
    assert host_free(text) == ("ModuleNotFoundError at jax/_src/a.py:3 / pip: …/fpemu-source does not exist")


# --- the table, from real recordings ---------------------------------------------------

@pytest.fixture(scope="module")
def results():
    return matrix_results("jax_steps", [recorded(v) for v in VERSIONS], reference_traces(SPECS), "test")


def test_rows_letter_each_behaviour_in_order_of_first_appearance(results):
    for row in results["rows"]:
        assert [cell["behaviour"] for cell in row["cells"]] == expected_letters(row["spec"])


def test_a_change_is_marked_where_the_behaviour_differs_from_the_column_before(results):
    for row in results["rows"]:
        letters = expected_letters(row["spec"])
        marked = [cell["change"] is not None for cell in row["cells"]]
        assert marked == [i > 0 and letters[i] != letters[i - 1] for i in range(len(letters))]
        for index, cell in enumerate(row["cells"]):
            back = letters[index] in letters[:index - 1] if index else False
            assert (cell["returns_to"] is not None) == (marked[index] and back)
            if cell["change"] is not None:
                assert cell["change"].startswith(("numerics only:", "trajectory changed:"))


def test_the_real_jax_history_changes_and_flips_back(results):
    """What the recordings say (the matrix in reports/upgrades.md): JAX's step numerics change at
    several releases, and at least one change returns to a behaviour an older release had."""
    changes = [(row["spec"], VERSIONS[i]) for row in results["rows"] for i, cell in enumerate(row["cells"])
               if cell["change"]]
    assert ("step_fp16_jax_default", "0.4.33") in changes
    assert any(cell["returns_to"] for row in results["rows"] for cell in row["cells"])


def test_cells_without_a_trace_keep_their_status_and_are_no_change(results):
    broken = Column(VersionSet("jax 0.5.0"), {}, {}, "No matching distribution found for jaxlib<=0.5.0",
                    CANNOT_INSTALL)
    columns = [recorded("0.4.33"), broken, recorded("0.4.35")]
    out = matrix_results("t", columns, {})
    for row in out["rows"]:
        cells = row["cells"]
        assert cells[1]["status"] == CANNOT_INSTALL and cells[1]["behaviour"] == CANNOT_INSTALL
        assert cells[1]["change"] is None
        # the comparison steps over the column that did not install
        assert (cells[2]["change"] is None) == (cells[0]["digest"] == cells[2]["digest"])


def test_the_same_refusal_in_two_releases_is_one_behaviour_and_a_refusal_is_a_change(results):
    refusal = ("ValueError in keras {v}: LossScaleOptimizer does not support `clipnorm`. (raised at "
               "keras/src/optimizers/loss_scale_optimizer.py:{line})")
    key = ("api_keras_clipnorm", "keras_clipnorm@cpu")
    accepted = recorded("0.4.31").cells[("step_fp16_jax_default", "jax_step@cpu")]
    columns = [Column(VersionSet(f"keras {v}"), {}, {key: cell}) for v, cell in [
        ("3.11.3", accepted), ("3.12.0", Cell("cannot run", None, refusal.format(v="3.12.0", line=84))),
        ("3.15.1", Cell("cannot run", None, refusal.format(v="3.15.1", line=90)))]]
    cells = matrix_results("k", columns, {})["rows"][0]["cells"]
    assert [c["change"] is not None for c in cells] == [False, True, False]
    assert cells[1]["change"].startswith("recorded -> cannot run: ValueError in keras 3.12.0")


def test_a_set_whose_recording_crashed_is_a_row_of_cells_for_every_planned_job():
    from fpemu.harness.matrix import planned_keys
    plan = MatrixPlan("t", tuple(SPECS), (), ("jax_step",))
    crashed = Column(VersionSet("jax 0.4.31"), {}, {}, "fpemu record exited 3: boom", "internal error")
    out = matrix_results("t", [crashed], {}, planned=planned_keys(plan))
    assert [(r["spec"], r["cells"][0]["status"]) for r in out["rows"]] == [
        ("step_bf16_jax_strict", "internal error"), ("step_fp16_jax_default", "internal error")]


def test_what_a_framework_prints_to_stdout_does_not_hide_the_recording():
    from fpemu.harness.matrix import _last_json
    assert _last_json('I0101 paddle says {hi}\n{\n "written": [],\n "unrecorded": []\n}\n') == {
        "written": [], "unrecorded": []}
    assert _last_json("only noise\n{ not json") is None


def test_report_is_host_free_and_marks_changes(results, tmp_path):
    written, left = write_results(tmp_path, results)
    assert [p.name for p in written] == ["jax_steps.json", "upgrades.md", "README.md"] and left == []
    assert "[upgrades.md](upgrades.md) | Behaviour per released version" in written[2].read_text()
    text = (tmp_path / "upgrades.md").read_text()
    assert "| step_fp16_jax_default / jax_step@cpu |" in text and "◆" in text and "What changed:" in text
    for host in (str(pathlib.Path.home()), "Linux-", "cpu_features", str(ROOT)):
        assert host not in text and host not in written[0].read_text()
    assert read_results(written[0]) == json.loads(json.dumps(results))
    again = (tmp_path / "upgrades.md").read_bytes()
    write_results(tmp_path, results)
    assert (tmp_path / "upgrades.md").read_bytes() == again  # regenerating changes nothing


def test_a_readme_fpemu_did_not_write_is_left_alone(results, tmp_path):
    """A matrix run in a user's repository writes its own files and never overwrites their README."""
    (tmp_path / "README.md").write_text("# My project's reports\n")
    written, left = write_results(tmp_path, results)
    assert [p.name for p in written] == ["jax_steps.json", "upgrades.md"] and left == [tmp_path / "README.md"]
    assert (tmp_path / "README.md").read_text() == "# My project's reports\n"


def test_a_results_file_or_plot_fpemu_did_not_write_is_left_alone(results, tmp_path):
    """Issue 28: the user's own files at the paths of a matrix's results and plot are never overwritten; the report
    is written from the results files that are fpemu's."""
    mine = {"results": tmp_path / "upgrades" / "jax_steps.json", "plot": tmp_path / "plots" / "upgrades_jax_steps.png"}
    for path in mine.values():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text('{"my": "own notes"}\n')
    written, left = write_results(tmp_path, results)
    assert [p.name for p in written] == ["upgrades.md", "README.md"] and left == list(mine.values())
    assert all(path.read_text() == '{"my": "own notes"}\n' for path in mine.values())
    assert "jax_steps" not in (tmp_path / "upgrades.md").read_text()
    mine["results"].unlink()  # the results are fpemu's again; the plot is still the user's: linked nowhere
    written, left = write_results(tmp_path, results)
    assert left == [mine["plot"]] and mine["plot"].read_text() == '{"my": "own notes"}\n'
    report = (tmp_path / "upgrades.md").read_text()
    assert "jax_steps" in report and "upgrades_jax_steps.png" not in report


def test_without_matplotlib_the_report_links_no_image(results, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    write_results(tmp_path, results)
    assert "![" not in (tmp_path / "upgrades.md").read_text() and not (tmp_path / "plots").exists()


def test_a_results_file_of_another_kind_is_refused(tmp_path):
    (tmp_path / "x.json").write_text('{"format": "fpemu-trace"}')
    with pytest.raises(FpemuInputError, match="not an fpemu matrix results file"):
        read_results(tmp_path / "x.json")


# --- bisection, over the real recordings -------------------------------------------------

def _probe(log, missing=()):
    def probe(version):
        log.append(version)
        if version in missing:
            return Column(VersionSet(f"jax {version}"), {}, {}, "no wheel for this Python", CANNOT_INSTALL)
        return recorded(version)
    return probe


def _true_changes() -> set:
    out = set()
    for spec in raw_behaviours(VERSIONS[0]):
        for before, after in zip(VERSIONS, VERSIONS[1:]):
            if raw_behaviours(before)[spec] != raw_behaviours(after)[spec]:
                out.add((spec, before, after))
    return out


def test_stride_one_tests_every_version_and_finds_every_change():
    log = []
    found = bisect_versions(VERSIONS, _probe(log), stride=1)
    assert log == VERSIONS
    assert {(c.spec, c.before, c.after) for c in found.changes} == _true_changes()
    assert all(not c.untested for c in found.changes)
    assert assumption(1).startswith("none")


def test_a_coarse_pass_bisects_each_differing_gap_to_neighbouring_releases():
    log = []
    found = bisect_versions(VERSIONS, _probe(log), stride=4)
    assert log[:3] == ["0.4.31", "0.6.0", "0.10.2"] and len(set(log)) == len(log)
    found_changes = {(c.spec, c.before, c.after) for c in found.changes if not c.untested}
    assert found_changes <= _true_changes()  # each change it pins between neighbours is real
    # every gap between tested versions that behave differently was narrowed to neighbours
    tested = [v for v in VERSIONS if v in found.tested]
    assert all(not c.untested for c in found.changes), tested
    assert "flips back within the 3 versions" in assumption(4)


def test_a_version_that_cannot_install_is_stepped_over_and_named():
    log = []
    found = bisect_versions(VERSIONS[:3], _probe(log, missing={"0.4.33"}), stride=1)
    assert found.cannot_install == ["0.4.33"]
    assert {(c.before, c.after, c.untested) for c in found.changes} <= {("0.4.31", "0.4.35", ("0.4.33",))}
    plan = MatrixPlan("b", tuple(SPECS), ())
    out = bisection_results("b", "jax", plan, found)
    assert out["bisect"]["cannot_install"] == ["0.4.33"] and out["columns"][1]["problem_status"] == CANNOT_INSTALL


def test_version_ranges_leave_out_pre_releases_and_need_two():
    assert versions_in_range(["0.4.30", "0.4.31", "0.5.0rc1", "0.5.0"], "0.4.31") == ["0.4.31", "0.5.0"]
    with pytest.raises(FpemuInputError, match="a bisection needs two"):
        versions_in_range(["0.4.30", "0.4.31"], "0.4.31")


# --- recording for real, in an environment that is this interpreter -------------------------

@pytest.fixture
def here(tmp_path, monkeypatch):
    monkeypatch.setenv("FPEMU_ENV_DIR", str(tmp_path / "envs"))
    monkeypatch.setitem(environments.ENVIRONMENTS, "here", ("numpy",))
    folder = environments.environment_dir("here")
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (folder / "bin" / "python").chmod(0o755)
    (folder / environments.MANIFEST).write_text(json.dumps({"packages": {"numpy": "2.4.6"}}))
    yield "here"
    environments.close_workers()


def test_a_column_records_through_fpemu_record_in_the_environment(here, tmp_path):
    plan = MatrixPlan("t", (str(ROOT / "specs" / "timing_torch.toml"),), (), None)
    column = record_column(plan, VersionSet("here", environment="here"), tmp_path / "traces")
    cell = column.cells[("timing_torch", "torch@cpu")]
    assert cell.status == "recorded" and cell.trace.metadata["packages"]["torch"].startswith("2.")
    assert read_trace(next((tmp_path / "traces").rglob("timing_torch*.json"))).implementation == "torch@cpu"


@needs_env_builds  # no build, but Keras and JAX imported in a subprocess: ~10 s
def test_a_job_that_raises_in_the_environment_is_one_cell(here, tmp_path):
    specs = (str(ROOT / "matrices" / "specs" / "api_keras_clipnorm.toml"),
             str(ROOT / "matrices" / "specs" / "api_keras_iterations.toml"))
    column = record_column(MatrixPlan("t", specs, (), None), VersionSet("here", environment="here"), tmp_path)
    # Keras 3.12+ refuses clipnorm= (a ValueError the adapter reads as an api change): one cell saying so, and the
    # other job still records
    clip = column.cells[("api_keras_clipnorm", "keras_clipnorm@cpu")]
    assert clip.status == "api changed" and "ValueError in keras" in clip.note and "does not support `clipnorm`" in clip.note
    assert column.cells[("api_keras_iterations", "keras_iterations@cpu")].status == "recorded"


# --- building real environments (FPEMU_TEST_ENVS=1) --------------------------------------------

@needs_env_builds
def test_matrix_over_two_jax_releases_marks_the_change(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("FPEMU_MATRIX_DIR", str(tmp_path / "traces"))
    code = main(["matrix", "--name", "two_jax", "--specs", SPECS[0], "--jax", "0.4.31,0.4.33", "--impl", "jax_step",
                 "--with", "numpy==2.4.6", "ml_dtypes==0.6.0", "--reports", str(tmp_path / "reports"), "--quiet"])
    assert code == 0
    body = read_results(tmp_path / "reports" / "upgrades" / "two_jax.json")
    assert [cell["behaviour"] for cell in body["rows"][0]["cells"]] == ["A", "B"]
    assert body["columns"][1]["packages"] == {"jax": "0.4.33", "jaxlib": "0.4.33", "ml_dtypes": "0.6.0", "numpy": "2.4.6"}


@needs_env_builds
def test_a_set_pip_cannot_install_is_a_column_of_cells(tmp_path):
    plan = MatrixPlan("t", (SPECS[0],), (), ("jax_step",))
    column = record_column(plan, VersionSet("broken", ("./no-such-distribution-here",)), tmp_path)
    assert column.problem_status == CANNOT_INSTALL and "no-such-distribution-here" in column.problem
    out = matrix_results("t", [column, recorded("0.4.31")], {})
    assert out["rows"][0]["cells"][0]["status"] == CANNOT_INSTALL


@pytest.mark.parametrize("module", ["fpemu.harness.matrix", "fpemu.harness.bisect"])
def test_docstring_examples(module):
    import doctest
    import importlib
    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


@needs_env_builds  # asks the package index
def test_pip_lists_released_versions_oldest_first():
    from fpemu.harness.bisect import pip_versions
    versions = pip_versions("jmp")
    assert versions[:4] == ["0.0.1", "0.0.2", "0.0.3", "0.0.4"]
    with pytest.raises(FpemuInputError, match="pip finds no released version"):
        pip_versions("fpemu-no-such-distribution-anywhere")


# --- refusing early, exit codes, the user's own loop --------------------------------------------

def test_a_set_that_can_run_no_job_is_refused_before_any_install(tmp_path, monkeypatch, capsys):
    """`--impl jmp` with no jmp in the sets: exit 2 naming what to add, and no environment is built."""
    monkeypatch.setenv("FPEMU_ENV_DIR", str(tmp_path / "envs"))
    spec = str(ROOT / "specs" / "floor_jmp.toml")
    code = main(["matrix", "--name", "x", "--specs", spec, "--jax", "0.4.31", "--impl", "jmp",
                 "--reports", str(tmp_path / "reports")])
    assert code == 2 and not (tmp_path / "envs").exists() and not (tmp_path / "reports").exists()
    assert ("set 'jax 0.4.31' can run none of the jobs (jmp@cpu): it does not install jmp; add them to every set "
            "(--with jmp==VERSION") in capsys.readouterr().err
    # with jmp added (or flax, which pulls jax in, for the flax adapter) the plan is accepted
    assert plan_from_options("x", [spec], {"jax": "0.4.31"}, ("jmp==0.0.4",), ["jmp"]).sets
    assert plan_from_options("x", [str(ROOT / "specs" / "floor_flax.toml")], {"flax": "0.10.0"}, (), ["flax"]).sets


LOOP = '''
import os, pathlib, sys
from fpemu.harness import reference_trace
from fpemu.specs import load_spec
from fpemu.traces import write_trace
if len(sys.argv) > 1 and sys.argv[1] == "--fail":
    raise SystemExit("my loop: this release lacks what it needs")
write_trace(reference_trace(load_spec(os.environ["MY_SPEC"])), pathlib.Path(os.environ["FPEMU_TRACE_DIR"]) / "mine.json")
'''


def test_a_plan_runs_the_users_own_loop_in_each_set(here, tmp_path, monkeypatch, capsys):
    """run = [script]: the set's Python runs it from the plan's folder; its traces are the rows.  A loop that
    fails in every set records nothing: exit 1, and a README the user wrote is left alone."""
    monkeypatch.setenv("MY_SPEC", str(ROOT / "specs" / "seed_example_1.toml"))
    (tmp_path / "loop.py").write_text(LOOP)
    plan = tmp_path / "plan.toml"
    plan.write_text('name = "mine"\nrun = ["loop.py"]\n[[set]]\nlabel = "here"\nenvironment = "here"\n')
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "README.md").write_text("# Our reports\n")
    assert main(["matrix", str(plan), "--reports", str(reports), "--traces", str(tmp_path / "traces"),
                 "--json", "--quiet"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [(row["spec"], row["implementation"], row["cells"][0]["status"]) for row in body["rows"]] == [
        ("seed_example_1", "reference", "recorded")]
    assert (reports / "README.md").read_text() == "# Our reports\n" and body["left_alone"] == [str(reports / "README.md")]

    plan.write_text('name = "mine"\nrun = ["loop.py", "--fail"]\n[[set]]\nlabel = "here"\nenvironment = "here"\n')
    assert main(["matrix", str(plan), "--reports", str(reports), "--traces", str(tmp_path / "traces"),
                 "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "here: no jobs (loop.py exited 1: my loop: this release lacks what it needs)" in out
    assert "nothing was recorded" in out and "changes:" not in out


def test_a_plan_whose_loop_script_is_missing_is_an_input_error(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text('name = "mine"\nrun = ["nope.py"]\n[[set]]\nlabel = "a"\nrequirements = ["jax==0.4.31"]\n')
    with pytest.raises(FpemuInputError, match=r"plan.toml: run: the script 'nope.py' is not a file"):
        load_plan(plan)
