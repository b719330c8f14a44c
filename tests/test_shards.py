"""Shards that merge (fpemu.harness.shards): `fpemu run --shard I/N` then `fpemu merge` writes the reports
one `fpemu run` writes, byte for byte, however the shards were started: a CI matrix (the example workflow,
expanded here), a SLURM array (the index from its environment variables), or by hand."""

import hashlib
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys

import pytest

from fpemu.cli import main
from fpemu.errors import FpemuInputError
from fpemu.harness import shards

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"
WORKFLOW = ROOT / "examples" / "ci" / "github-actions.yml"
SBATCH = ROOT / "examples" / "slurm" / "fpemu-shards.sbatch"


def tree(folder: pathlib.Path) -> dict:
    """relative path -> sha256 of every file under ``folder``, less the shards' partial results."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and shards.FOLDER not in p.relative_to(folder).parts}


def spec_folder(folder: pathlib.Path, names) -> pathlib.Path:
    folder.mkdir(parents=True)
    for name in names:
        shutil.copy(SPECS / f"{name}.toml", folder)
    return folder


def test_assign_is_balanced_deterministic_and_stable():
    names = [f"spec_{i}" for i in range(101)]
    taken = shards.assign(names, 4)
    counts = sorted(list(taken.values()).count(i) for i in range(1, 5))
    assert counts == [25, 25, 25, 26]  # the shards' spec counts differ by one at most
    assert shards.assign(list(reversed(names)), 4) == taken  # the order specs are listed in changes nothing
    grown = shards.assign(names + ["spec_new"], 4)
    moved = [n for n in names if grown[n] != taken[n]]
    assert len(moved) <= 3, moved  # a new spec moves at most one other across each of the N - 1 cuts
    by_family = shards.assign([f"jax_{i}" for i in range(8)] + [f"torch_{i}" for i in range(8)], 2)
    assert {by_family[f"jax_{i}"] for i in range(8)} == {1, 2}  # a family is spread, not one shard's
    assert shards.shard_names(["a", "b"], shards.Shard(3, 3)) == frozenset()  # more shards than specs: one idles
    assert shards.select(["a", "b", "c"], None) == ["a", "b", "c"]


@pytest.mark.parametrize("text", ["3/2", "0/2", "2", "a/b", "1/0", ""])
def test_a_shard_that_is_not_I_of_N_is_refused_naming_the_option(text):
    with pytest.raises(FpemuInputError, match=rf"^--shard {text}: expected I/N with 1 <= I <= N"):
        shards.parse_shard(text)


def test_the_shard_comes_from_the_option_fpemu_shard_or_a_slurm_array():
    assert shards.requested_shard(None, {}) is None
    assert shards.requested_shard("2/3", {"FPEMU_SHARD": "1/3"}) == shards.Shard(2, 3)  # the option first
    assert shards.requested_shard(None, {"FPEMU_SHARD": "1/3"}) == shards.Shard(1, 3)
    with pytest.raises(FpemuInputError, match=r"^\$FPEMU_SHARD= 4/3: expected I/N"):
        shards.requested_shard(None, {"FPEMU_SHARD": "4/3"})
    zero_based = {"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0"}
    assert shards.requested_shard("slurm", zero_based) == shards.Shard(1, 4)
    one_based = {"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}
    assert shards.requested_shard(None, {**one_based, "FPEMU_SHARD": "slurm"}) == shards.Shard(4, 4)
    stepped = {"SLURM_ARRAY_TASK_ID": "6", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "2",
               "SLURM_ARRAY_TASK_STEP": "2"}  # --array=2-6:2
    assert shards.requested_shard("slurm", stepped) == shards.Shard(3, 3)
    with pytest.raises(FpemuInputError, match=r"--shard slurm: \$SLURM_ARRAY_TASK_ID and \$SLURM_ARRAY_TASK_COUNT "
                                              "not set"):
        shards.requested_shard("slurm", {})


SHARDED_SPECS = ("seed_example_1", "floor_jmp", "static_scale")
WITH_RANKS = pytest.param(SHARDED_SPECS + ("ranks_ddp_grad_scaler",), id="with-ranks", marks=pytest.mark.stage2(
    "the same merge without the 2-rank spec (its processes cost 30 s)"))


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_jmp
@pytest.mark.fpemu_torch_ddp
@pytest.mark.parametrize("specs", [pytest.param(SHARDED_SPECS, id="single-rank"), WITH_RANKS])
def test_two_shards_merge_into_the_reports_of_one_run_byte_for_byte(specs, tmp_path, monkeypatch, capsys):
    """Unsharded vs shard 1/2 (--shard) and 2/2 (a SLURM array task) merged: every file the same, the
    goldens, observed traces, per-rank traces, diff.json, harness.md, ranks.md and the plots."""
    monkeypatch.chdir(tmp_path)
    spec_folder(tmp_path / "specs", specs)
    assert main(["run", "--specs", "specs", "--reports", "whole", "--quiet"]) == 0
    one = capsys.readouterr().out
    assert main(["run", "--specs", "specs", "--reports", "split", "--shard", "1/2", "--quiet"]) == 0
    for name, value in {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "2", "SLURM_ARRAY_TASK_MIN": "0",
                        "FPEMU_SHARD": "slurm"}.items():
        monkeypatch.setenv(name, value)
    assert main(["run", "--specs", "specs", "--reports", "split", "--quiet"]) == 0
    for name in ("split/shards/1-of-2/shard.json", "split/shards/2-of-2/shard.json"):
        assert json.loads(pathlib.Path(name).read_text())["verdicts"]  # each shard ran jobs of its own
    assert not pathlib.Path("split/diff.json").exists()  # the whole run's files are the merge's
    capsys.readouterr()
    assert main(["merge", "--specs", "specs", "--reports", "split", "--quiet"]) == 0
    merged = capsys.readouterr().out
    whole, split = tree(tmp_path / "whole"), tree(tmp_path / "split")
    assert whole == split
    assert {"diff.json", "harness.md", "golden/seed_example_1.json"} <= set(whole)
    if "ranks_ddp_grad_scaler" in specs:
        assert {"ranks.md", "plots/ranks.png",
                "observed/ranks/ranks_ddp_grad_scaler.loss.2ranks.rank1.torch_ddp-cpu.json"} <= set(whole)
    assert one.splitlines()[:-1] == merged.splitlines()[:len(one.splitlines()) - 1]  # the same result lines


def _refused(capsys, argv, *words):
    assert main(argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err, err
    return err


def test_a_merge_of_shards_that_do_not_fit_is_refused_naming_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    spec_folder(tmp_path / "specs", ("static_scale", "model_fp16_mlp_unscaled", "seed_example_2"))
    run = ["run", "--specs", "specs", "--reports", "r", "--quiet", "--impl", "torch", "--allow-skips"]
    merge = ["merge", "--specs", "specs", "--reports", "r", "--quiet"]
    assert main(run + ["--shard", "1/2"]) in (0, 1)
    capsys.readouterr()
    _refused(capsys, merge, "shard 2/2 missing", "1/2 (r/shards/1-of-2/shard.json)", "`fpemu run --shard 2/2`")
    assert main(run + ["--shard", "2/2"]) in (0, 1)
    assert main(run + ["--shard", "1/3"]) in (0, 1)
    capsys.readouterr()
    _refused(capsys, merge, "r/shards/1-of-3/shard.json: shard 1/3 is of another split")
    shutil.rmtree("r/shards/1-of-3")
    assert main(merge) in (0, 1)  # 1/2 and 2/2 fit
    capsys.readouterr()
    manifest = pathlib.Path("r/shards/2-of-2/shard.json")
    body = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**body, "fpemu": "0.0.1"}))
    _refused(capsys, merge, f"{manifest}: written by fpemu 0.0.1, this is fpemu")
    manifest.write_text(json.dumps({**body, "options": {**body["options"], "impl": ["jmp"]}}))
    _refused(capsys, merge, f"{manifest}: shard 2/2 ran with other options than r/shards/1-of-2/shard.json (impl")
    manifest.write_text(json.dumps(body))
    spec = pathlib.Path("specs/static_scale.toml")
    spec.write_text(spec.read_text() + "\n# edited after the shards ran\n")
    _refused(capsys, merge, "r/shards/1-of-2/shard.json: shard 1/2 ran another spec set than the specs now",
             "changed: static_scale")
    _refused(capsys, ["merge", "nowhere", "--specs", "specs", "--reports", "r"], "nowhere: no shard's partial results")
    _refused(capsys, ["run", "--specs", "specs", "--shard", "3/2"], "--shard 3/2: expected I/N with 1 <= I <= N")


def _step_commands(job: dict, values: dict) -> list:
    """The job's `fpemu ...` run steps with the GitHub expressions of ``values`` filled in."""
    commands = []
    for step in job["steps"]:
        text = step.get("run", "")
        for expression, value in values.items():
            text = text.replace("${{ " + expression + " }}", str(value))
        if text.startswith("fpemu "):
            assert "${{" not in text, text
            commands.append([sys.executable, "-m", "fpemu", *shlex.split(text)[1:]])
    return commands


def _artifact_steps(job: dict, action: str) -> list:
    return [step["with"] for step in job["steps"] if step.get("uses", "").startswith(f"actions/{action}-artifact@")]


@pytest.mark.fpemu_torch
@pytest.mark.fpemu_jmp
@pytest.mark.stage2("21 s of fpemu processes; the shards' merge in "
                    "test_two_shards_merge_into_the_reports_of_one_run_byte_for_byte")
def test_the_example_ci_workflow_expanded_here_merges_into_one_runs_reports(tmp_path):
    """examples/ci/github-actions.yml as GitHub runs it: each matrix entry on a machine of its own (a folder),
    its artifact passed to the merge job as the upload and download steps say, then its fpemu steps."""
    yaml = pytest.importorskip("yaml")
    workflow = yaml.safe_load(WORKFLOW.read_text())
    shard_job, merge_job = workflow["jobs"]["shard"], workflow["jobs"]["merge"]
    assert merge_job["needs"] == "shard" and merge_job["if"] == "always()"
    entries = shard_job["strategy"]["matrix"]["shard"]
    names = ("seed_example_1", "floor_jmp", "static_scale", "floor_torch")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FPEMU_SHARD", None)
    artifacts = tmp_path / "artifacts"
    for entry in entries:
        machine = tmp_path / f"shard-{entry}"
        spec_folder(machine / "specs", names)  # actions/checkout
        values = {"matrix.shard": entry, "strategy.job-total": len(entries)}
        for command in _step_commands(shard_job, values):
            done = subprocess.run(command, cwd=machine, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stderr
        (upload,) = _artifact_steps(shard_job, "upload")
        name = upload["name"].replace("${{ matrix.shard }}", str(entry))
        shutil.copytree(machine / upload["path"], artifacts / name)
    merger = tmp_path / "merge"
    spec_folder(merger / "specs", names)
    (download,) = _artifact_steps(merge_job, "download")
    assert download["merge-multiple"] is True
    for artifact in sorted(artifacts.glob(download["pattern"])):
        shutil.copytree(artifact, merger / download["path"], dirs_exist_ok=True)
    for command in _step_commands(merge_job, {}):
        done = subprocess.run(command, cwd=merger, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr
    whole = tmp_path / "whole"
    spec_folder(whole / "specs", names)
    done = subprocess.run([sys.executable, "-m", "fpemu", "run", "--quiet"], cwd=whole, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert tree(merger / "reports" / "local") == tree(whole / "reports" / "local")
    assert len(list((merger / "reports" / "local" / "shards").iterdir())) == len(entries)


def test_the_example_slurm_script_runs_one_shard_per_array_task():
    text = SBATCH.read_text()
    assert "#SBATCH --array=1-4" in text and "\nfpemu run --shard slurm" in text
    task = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}
    assert shards.requested_shard("slurm", task) == shards.Shard(3, 4)


# --- a version matrix in shards, and --timeout on matrix and bisect ---------------------------------

@pytest.fixture
def here(tmp_path, monkeypatch):
    """An environment that is this interpreter (no pip): every set of the plans below runs in it."""
    from fpemu import environments
    monkeypatch.setenv("FPEMU_ENV_DIR", str(tmp_path / "envs"))
    monkeypatch.setitem(environments.ENVIRONMENTS, "here", ("numpy", "jax", "jaxlib", "jmp"))
    folder = environments.environment_dir("here")
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (folder / "bin" / "python").chmod(0o755)
    (folder / environments.MANIFEST).write_text(json.dumps({"packages": {"numpy": "2.4.6"}}))
    yield "here"
    environments.close_workers()


def _plan(tmp_path, labels) -> pathlib.Path:
    plan = tmp_path / "plan.toml"
    plan.write_text(f'name = "sharded"\nspecs = ["{SPECS / "floor_jmp.toml"}"]\nimpl = ["jmp"]\n'
                    + "".join(f'[[set]]\nlabel = "{label}"\nenvironment = "here"\n' for label in labels))
    return plan


@pytest.mark.fpemu_jmp
def test_a_matrix_in_two_shards_merges_into_the_report_of_one_matrix(here, tmp_path, capsys):
    plan = _plan(tmp_path, ("set a", "set b"))  # a set per shard: each cell is a process importing JAX (2 s)
    whole, split = tmp_path / "whole", tmp_path / "split"
    args = [str(plan), "--quiet", "--traces"]
    assert main(["matrix", *args, str(tmp_path / "t1"), "--reports", str(whole)]) == 0
    for shard in ("1/2", "2/2"):
        assert main(["matrix", *args, str(tmp_path / "t2"), "--shard", shard, "--reports", str(split)]) == 0
    assert not split.exists()  # a shard writes no report
    capsys.readouterr()
    _refused(capsys, ["matrix", *args, str(tmp_path / "t2"), "--merge", "--shard", "1/2"], "--merge merges every shard")
    assert main(["matrix", *args, str(tmp_path / "t2"), "--merge", "--reports", str(split)]) == 0
    assert tree(whole) == tree(split) and "upgrades/sharded.json" in tree(whole)
    second = tmp_path / "t2" / "shards" / "2-of-2"
    shutil.move(second, tmp_path / "kept")
    _refused(capsys, ["matrix", *args, str(tmp_path / "t2"), "--merge", "--reports", str(split)],
             "shard 2/2 of matrix 'sharded' missing")
    shutil.move(tmp_path / "kept", second)  # back, not rerun: each cell is a process importing JAX
    _plan(tmp_path, ("set a", "set d"))
    _refused(capsys, ["matrix", *args, str(tmp_path / "t2"), "--merge", "--reports", str(split)],
             "ran another plan than 'sharded' is now (its sets differ)")


@pytest.mark.fpemu_jmp
@pytest.mark.parametrize("output", ["text", pytest.param("json", marks=pytest.mark.stage2("the same run's text line"))])
def test_a_matrix_job_past_timeout_is_its_cell_and_one_line(here, tmp_path, capsys, output):
    plan = _plan(tmp_path, ("set a",))
    assert main(["matrix", str(plan), "--quiet", "--traces", str(tmp_path / "t"), "--reports", str(tmp_path / "r"),
                 "--timeout", "0.001", *(["--json"] if output == "json" else [])]) == 1  # nothing recorded
    out = capsys.readouterr().out
    if output == "json":
        (cell,) = json.loads(out)["rows"][0]["cells"]
        assert cell["status"] == "cannot run" and cell["note"] == "timed out after 0.001 s (--timeout)"
    else:
        assert "  floor_jmp / jmp@cpu in set a: cannot run: timed out after 0.001 s (--timeout)" in out
    for command in (["matrix", str(plan)], ["bisect", "jax", "--specs", str(SPECS / "floor_jmp.toml"),
                                            "--versions", "0.4.31,0.4.33"]):
        _refused(capsys, [*command, "--timeout", "0"], "--timeout 0.0: expected seconds > 0")


def test_the_exhaustive_block_sweep_in_shards_merges_into_the_rows_of_one_sweep(tmp_path, monkeypatch):
    # each row's sweep (minutes) replaced by its key: what is checked is which shard takes which row, and the merge
    from benchmarks import exhaustive_blocks as sweep
    monkeypatch.setattr(sweep, "SHARD_DIR", tmp_path)
    monkeypatch.setattr(sweep, "sweep", lambda key: dict(zip(("sweep", "rule", "element"), key)))
    whole = [sweep.sweep(key) for key in sweep.rows_to_sweep()]
    sweep.run_shard(0, 3)
    with pytest.raises(SystemExit, match="blocks-1-of-3.json: missing; run --shard 1/3 first"):
        sweep.merged_rows(3)
    sweep.run_shard(1, 3)
    sweep.run_shard(2, 3)
    assert sweep.merged_rows(3) == whole and len(whole) == 35
