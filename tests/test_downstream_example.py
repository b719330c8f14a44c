"""examples/downstream, as its team runs it: a copy in a fresh git repository (a clean clone), fpemu installed
non-editable into a virtual environment from a wheel of this tree, its ci.sh; then each break fails with a
short message, and the matrix refuses an idle set from the installed fpemu.

Opt-in (FPEMU_TEST_EXAMPLES=1; about 3 minutes: a wheel build, a venv, the loops trained several times).
FPEMU_TEST_ENVS=1 also runs MATRIX=1: the JAX loop under two jax releases (pip, network).
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(os.environ.get("FPEMU_TEST_EXAMPLES") != "1",
                                reason="minutes (a wheel, a venv, the loops): set FPEMU_TEST_EXAMPLES=1")
ROOT = pathlib.Path(__file__).resolve().parent.parent
_MESSAGE_LINES = 12  # a failure's message is short: its first line and a small table


def _run(command, cwd, **env):
    """The command's result, with a clean environment: nothing of this checkout on the path."""
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**clean, **env}, timeout=900)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """(the copied project, its venv's Python with fpemu installed from a wheel)."""
    base = tmp_path_factory.mktemp("downstream")
    dist = base / "dist"
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist),
                  str(ROOT)], base)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = dist.glob("fpemu-*.whl")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    installed = _run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(wheel)], base)
    assert installed.returncode == 0, installed.stderr[-2000:]
    repo = base / "repo"
    shutil.copytree(ROOT / "examples" / "downstream", repo, ignore=shutil.ignore_patterns("__pycache__", "reports"))
    for command in (["git", "init", "-q"], ["git", "add", "-A"],
                    ["git", "-c", "user.name=ci", "-c", "user.email=ci@example.com", "commit", "-qm", "clone"]):
        subprocess.run(command, cwd=repo, check=True)
    where = _run([str(python), "-c", "import fpemu; print(fpemu.__file__)"], repo).stdout.strip()
    assert pathlib.Path(where).is_relative_to(venv) and not pathlib.Path(where).is_relative_to(ROOT)  # not editable
    return repo, python


def _pytest(repo, python, *args):
    return _run([str(python), "-m", "pytest", "-q", *args], repo)


def _failure_message(output: str, test: str) -> list:
    """The lines of one failing test's message (between its ____ header and the next header)."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("_") and test in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(("_", "=")))
    return lines[start + 1:end]


def test_ci_passes_from_a_clean_clone_against_the_installed_fpemu(project):
    repo, python = project
    done = _run(["bash", "ci.sh"], repo, PYTHON=str(python), SKIP_INSTALL="1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "4 passed" in done.stdout


def test_a_changed_trajectory_fails_in_a_few_lines_naming_the_parameter(project):
    repo, python = project
    loop = repo / "loops" / "jax_loop.py"
    source = loop.read_text()
    try:
        loop.write_text(source.replace("period: int = 3", "period: int = 4"))
        done = _pytest(repo, python, "-k", "jax_loop")
        assert done.returncode == 1
        message = _failure_message(done.stdout, "test_jax_loop")
        assert message[0].startswith("jax@cpu differs from jax_loop.json at level trajectory (the trajectory changed)")
        assert "[parameters differ: period 3 -> 4]" in message[0] and len(message) <= _MESSAGE_LINES
    finally:
        loop.write_text(source)
        for stale in (repo / "tests" / "golden").glob("*.obtained.json"):
            stale.unlink()


def test_a_corrupted_golden_and_an_orphan(project):
    repo, python = project
    golden = repo / "tests" / "golden" / "torch_loop.json"
    text = golden.read_text()
    orphan = repo / "tests" / "golden" / "retired_loop.json"
    try:
        golden.write_text(text.replace('"step": 3', '"step": 30', 1))
        done = _pytest(repo, python, "-k", "test_torch_loop and not harmless")
        message = _failure_message(done.stdout, "test_torch_loop")
        assert done.returncode == 1 and "Traceback" not in done.stdout
        assert message[0].endswith("; rerun with --fpemu-force-regen to rewrite the golden") and "torch_loop.json" in message[0]
        golden.write_text(text)
        orphan.write_text(text)
        done = _pytest(repo, python)  # every test passes; the orphan fails the run, as syrupy's unused snapshots
        assert done.returncode == 1 and " failed" not in done.stdout
        assert "fpemu: 1 golden files no test used: tests/golden/retired_loop.json: the run fails" in done.stdout
        assert _pytest(repo, python, "--fpemu-warn-orphans").returncode == 0
    finally:
        golden.write_text(text)
        orphan.unlink(missing_ok=True)
        for stale in (repo / "tests" / "golden").glob("*.obtained.json"):
            stale.unlink()


def test_the_installed_fpemu_matrix_refuses_an_idle_set_before_installing(project, tmp_path):
    repo, python = project
    done = _run([str(python), "-m", "fpemu", "matrix", "--name", "x", "--specs", str(ROOT / "specs" / "floor_jmp.toml"),
                 "--jax", "0.4.31", "--impl", "jmp", "--reports", str(tmp_path / "reports")], repo,
                FPEMU_ENV_DIR=str(tmp_path / "envs"))
    assert done.returncode == 2 and "it does not install jmp" in done.stderr
    assert not (tmp_path / "envs").exists() and not (tmp_path / "reports").exists()


@pytest.mark.skipif(os.environ.get("FPEMU_TEST_ENVS") != "1", reason="pip installs two jax releases: FPEMU_TEST_ENVS=1")
def test_the_matrix_of_the_teams_own_loop_from_the_installed_fpemu(project, tmp_path):
    repo, python = project
    done = _run(["bash", "ci.sh"], repo, PYTHON=str(python), SKIP_INSTALL="1", MATRIX="1",
                FPEMU_ENV_DIR=str(tmp_path / "envs"), FPEMU_MATRIX_DIR=str(tmp_path / "traces"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "jax 0.4.31: 1 recorded" in done.stdout and "jax 0.4.33: 1 recorded" in done.stdout
    listed = _run([str(python), "-m", "fpemu", "env", "list"], repo, FPEMU_ENV_DIR=str(tmp_path / "envs"))
    assert listed.stdout.count("matrix-jax-0.4.3") == 2, listed.stdout  # the matrix's environments are listed
    # The golden (jax 0.10.2) holds the loop recorded under jax 0.4.31 and 0.4.33 at the trajectory level (scale
    # and skips identical, as measured: losses up to 572 ulp apart), and not at the bits level.
    upgrade = repo / "tests" / "test_upgrade.py"
    upgrade.write_text(UPGRADE_TESTS)
    try:
        traces = sorted((tmp_path / "traces").rglob("loop/jax_loop.json"))
        assert len(traces) == 2
        done = _run([str(python), "-m", "pytest", "-q", "tests/test_upgrade.py"], repo,
                    UPGRADED_TRACES=os.pathsep.join(map(str, traces)))
        assert "2 failed, 2 passed" in done.stdout, done.stdout[-3000:]
        assert "likely cause: jax 0.10.2 -> 0.4.31" in done.stdout  # the bits level names the upgrade
    finally:
        upgrade.unlink()
        for stale in (repo / "tests" / "golden").glob("*.obtained.json"):
            stale.unlink()


UPGRADE_TESTS = '''
import os

import pytest

from fpemu.traces import read_trace


@pytest.mark.parametrize("level", ["trajectory", "bits"])
@pytest.mark.parametrize("path", os.environ["UPGRADED_TRACES"].split(os.pathsep))
def test_upgraded(assert_trace_matches, path, level):
    assert_trace_matches(read_trace(path), "jax_loop", level=level)
'''
