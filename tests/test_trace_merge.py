"""fpemu merge-traces as git's merge driver, in a real repository: two branches' changes to one golden
merge and are sealed; the same lines changed on both are a conflict; a plain merge conflicts on the
checksum line."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from fpemu.cli import main
from fpemu.traces import read_trace, write_trace
from fpemu.traces.format import Trace

ROOT = pathlib.Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "reports" / "golden" / "bernoulli_torch.json"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args, check=True):
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PYTHONPATH": str(ROOT)}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=check)


def _edited(trace: Trace, **metadata) -> Trace:
    return Trace({**trace.metadata, **metadata}, trace.steps, trace.summary)


def _branches(tmp_path, ours: dict, theirs: dict, driver: bool):
    """A repository whose golden g.json branch 'ours' and branch 'theirs' each changed; 'theirs' merged into
    'ours' with the driver set up (or without)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q", "-b", "ours")
    if driver:
        _git(repo, "config", "merge.fpemu-trace.driver", f"{sys.executable} -m fpemu merge-traces %O %A %B")
        (repo / ".gitattributes").write_text("*.json merge=fpemu-trace\n")
    golden = read_trace(GOLDEN)
    write_trace(golden, repo / "g.json")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "golden")
    _git(repo, "branch", "theirs")
    for branch, change in (("ours", ours), ("theirs", theirs)):
        _git(repo, "checkout", "-q", branch)
        write_trace(_edited(golden, **change), repo / "g.json")
        _git(repo, "commit", "-qam", branch)
    _git(repo, "checkout", "-q", "ours")
    return repo, _git(repo, "merge", "-q", "theirs", "-m", "merge", check=False)


def test_two_branches_changes_to_one_golden_merge_and_are_sealed(tmp_path):
    golden = read_trace(GOLDEN)
    theirs = {"packages": {**golden.metadata["packages"], "numpy": "9.9.9"}}
    repo, merged = _branches(tmp_path, {"fpemu_version": "9.0.0"}, theirs, driver=True)
    assert merged.returncode == 0, merged.stdout + merged.stderr
    result = read_trace(repo / "g.json")  # its checksum holds and every field is checked
    assert result.metadata["fpemu_version"] == "9.0.0" and result.metadata["packages"]["numpy"] == "9.9.9"
    assert result.steps == golden.steps


def test_without_the_driver_the_same_merge_conflicts_on_the_checksum_line(tmp_path):
    golden = read_trace(GOLDEN)
    theirs = {"packages": {**golden.metadata["packages"], "numpy": "9.9.9"}}
    repo, merged = _branches(tmp_path, {"fpemu_version": "9.0.0"}, theirs, driver=False)
    assert merged.returncode == 1 and '"checksum"' in (repo / "g.json").read_text().split("=======")[0]


def test_the_same_lines_changed_on_both_sides_are_a_conflict_without_a_checksum(tmp_path):
    repo, merged = _branches(tmp_path, {"fpemu_version": "9.0.0"}, {"fpemu_version": "8.0.0"}, driver=True)
    text = (repo / "g.json").read_text()
    assert merged.returncode == 1 and "<<<<<<< ours" in text and '"checksum"' not in text, text[:300]


def test_a_clean_text_merge_that_is_no_trace_is_left_unsealed(tmp_path, capsys):
    """A text merge without conflicts is sealed only once it reads back as a valid trace."""
    base, ours, theirs = (tmp_path / f"{n}.json" for n in ("base", "ours", "theirs"))
    golden = read_trace(GOLDEN)
    for path in (base, ours):
        write_trace(golden, path)
    body = json.loads(GOLDEN.read_text())
    body["metadata"]["device"] = 7  # a writer bug on the other branch: valid JSON, no valid trace
    theirs.write_text(json.dumps(body, sort_keys=True, indent=1) + "\n")
    code = main(["merge-traces", str(base), str(ours), str(theirs)])
    out = capsys.readouterr().out
    assert code == 1 and "merged without conflicts but left unsealed" in out and "device" in out, out
    assert '"checksum"' not in ours.read_text()


def test_a_missing_version_is_named(tmp_path, capsys):
    assert main(["merge-traces", str(tmp_path / "b.json"), str(GOLDEN), str(GOLDEN)]) == 2
    assert "base " in capsys.readouterr().err
