"""Isolated environments: building, caching, calling into them, and their errors.

The fast tests register the project's own interpreter as an environment (a folder with
the build's marker and a ``bin/python`` that runs it), so the calls run in a real worker process
without a build.  The ``slow_env`` tests build a real venv with other numpy and ml_dtypes
versions; they run where FPEMU_TEST_ENVS=1.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import fpemu
from fpemu.cli import main
from fpemu.errors import FpemuInputError
from fpemu import environments
from fpemu.environments import (EnvironmentCallError, EnvironmentNotBuilt, EnvironmentTimeout,
                                        build_environment, call_in_environment, environment_python)

needs_env_builds = pytest.mark.stage2("builds a venv with pip (~30 s); the build's steps, cache and errors "
                                      "without pip in the tests above")
OTHER_CORE = ("numpy==2.3.5", "ml_dtypes==0.5.4")  # not the project's numpy 2.4 / ml_dtypes 0.6


@pytest.fixture
def env_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FPEMU_ENV_DIR", str(tmp_path / "envs"))
    yield tmp_path / "envs"
    environments.close_workers()


@pytest.fixture
def here(env_dir, monkeypatch):
    """An environment whose Python is this interpreter (its packages included)."""
    monkeypatch.setitem(environments.ENVIRONMENTS, "here", ("numpy",))
    folder = environments.environment_dir("here")
    (folder / "bin").mkdir(parents=True)
    # A script, not a link: a venv's python reached through a link elsewhere would lose its venv.
    (folder / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (folder / "bin" / "python").chmod(0o755)
    (folder / environments.MANIFEST).write_text("{}")
    return "here"


# --- errors, without a build ------------------------------------------------------

def test_unknown_environment_is_an_input_error(env_dir):
    for call in (lambda: build_environment("nope"), lambda: environment_python("nope"),
                 lambda: call_in_environment("nope", "math:sqrt", 4.0)):
        with pytest.raises(FpemuInputError, match="unknown environment 'nope'; known environments: paddle, tf_keras"):
            call()


def test_unbuilt_environment_says_how_to_build_it(env_dir):
    assert environment_python("paddle") is None
    with pytest.raises(EnvironmentNotBuilt, match=r"environment 'paddle' is not built in .*envs: "
                                                  r"run `fpemu env build paddle`"):
        call_in_environment("paddle", "math:sqrt", 4.0)


@pytest.mark.parametrize("entry", ["math.sqrt", ":sqrt", "math:", 3])
def test_entry_must_be_module_colon_function(here, entry):
    with pytest.raises(ValueError, match="entry must be 'module:function', got"):
        call_in_environment(here, entry, 4.0)


def test_call_returns_the_result(here):
    assert call_in_environment(here, "math:sqrt", 16.0) == 4.0
    value = call_in_environment(here, "fpemu:quantize", [1 + 2**-8 + 2**-30], "bf16")
    assert value.view(np.uint32).tolist() == fpemu.quantize([1 + 2**-8 + 2**-30], "bf16").view(np.uint32).tolist()


def test_entry_that_raises_names_environment_entry_and_last_line(here):
    with pytest.raises(EnvironmentCallError) as raised:
        call_in_environment(here, "json:loads", "{not json")
    message = str(raised.value)
    assert message.startswith("environment 'here', json:loads raised: json.decoder.JSONDecodeError: Expecting "
                              "property name enclosed in double quotes")
    assert "Traceback (most recent call last)" in raised.value.remote_traceback
    assert call_in_environment(here, "math:sqrt", 9.0) == 3.0  # the worker survives


def test_missing_module_or_function(here):
    with pytest.raises(EnvironmentCallError, match="no_such_module_xyz' raised: ModuleNotFoundError|"
                                                   "ModuleNotFoundError: No module named 'no_such_module_xyz'"):
        call_in_environment(here, "no_such_module_xyz:f")
    with pytest.raises(EnvironmentCallError, match="AttributeError: module 'math' has no attribute 'nope'"):
        call_in_environment(here, "math:nope")


def test_timeout_is_an_error_not_a_hang(here):
    started = time.monotonic()
    with pytest.raises(EnvironmentTimeout, match=r"environment 'here', time:sleep: no result within 0.5 s "
                                                 r"\(the worker was killed\)"):
        call_in_environment(here, "time:sleep", 60, timeout=0.5)
    assert time.monotonic() - started < 10
    assert call_in_environment(here, "math:sqrt", 4.0) == 2.0  # a fresh worker


def test_worker_that_dies_is_reported(here):
    with pytest.raises(EnvironmentCallError, match=r"environment 'here', os:_exit: the worker died \(exit 3\)"):
        call_in_environment(here, "os:_exit", 3)
    assert call_in_environment(here, "math:sqrt", 4.0) == 2.0  # a fresh worker


def test_results_and_arguments_that_do_not_pickle(here):
    with pytest.raises(EnvironmentCallError, match="the result cannot be pickled"):
        call_in_environment(here, "threading:Lock")
    with pytest.raises(TypeError, match="environment 'here', math:sqrt: the arguments cannot be pickled"):
        call_in_environment(here, "math:sqrt", lambda: 1)


def test_printing_in_the_worker_does_not_corrupt_replies(here):
    assert call_in_environment(here, "builtins:print", "noise on stdout") is None
    assert call_in_environment(here, "os:write", 1, b"raw bytes on fd 1\n") == 18


def test_timeout_must_be_positive(here):
    with pytest.raises(ValueError, match="timeout must be positive, got 0"):
        call_in_environment(here, "math:sqrt", 4.0, timeout=0)


def test_failed_build_leaves_nothing_and_exits_3(env_dir, monkeypatch, capsys):
    monkeypatch.setitem(environments.ENVIRONMENTS, "broken", ("this is not a requirement!!",))
    assert main(["env", "build", "broken", "--quiet"]) == 3
    assert "environment 'broken': pip install" in capsys.readouterr().err
    assert environment_python("broken") is None
    assert list(env_dir.iterdir()) == []


# --- the command line ------------------------------------------------------------------

def test_cli_env_list_and_build(here, capsys):
    assert main(["env", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {row["name"]: row["python"] for row in listed["environments"]} == {"here": str(environment_python("here"))}
    assert listed["unbuilt"] == ["paddle", "tf_keras"]
    assert main(["env", "build", "here", "--quiet"]) == 0  # already built: instant
    assert "here is built" in capsys.readouterr().out


def test_cli_unknown_environment_exits_2(env_dir, capsys):
    assert main(["env", "build", "nope"]) == 2
    assert "unknown environment 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # argparse's exit (the process's code: test_cli's console script test)
        main(["env"])
    assert usage.value.code == 2 and "required" in capsys.readouterr().err


# --- a real build -------------------------------------------------------------------------

def _use_other_core(patch, folder) -> None:
    patch.setenv("FPEMU_ENV_DIR", str(folder))
    patch.setitem(environments.ENVIRONMENTS, "other_core", OTHER_CORE)


@pytest.fixture(scope="session")
def other_core_root(tmp_path_factory):
    """Where a real environment with numpy 2.3.5 and ml_dtypes 0.5.4 is built, once per session."""
    root = tmp_path_factory.mktemp("envs")
    with pytest.MonkeyPatch.context() as patch:
        _use_other_core(patch, root)
        build_environment("other_core")
    return root


@pytest.fixture
def other_core(other_core_root, monkeypatch):
    _use_other_core(monkeypatch, other_core_root)
    yield environments.environment_dir("other_core")
    environments.close_workers()


@pytest.mark.slow_env
@needs_env_builds
def test_build_installs_the_requirements_and_fpemu(other_core):
    folder = other_core
    manifest = environments.environment_manifest("other_core")
    assert (manifest["packages"]["numpy"], manifest["packages"]["ml_dtypes"]) == ("2.3.5", "0.5.4")
    assert manifest["packages"]["fpemu"] == fpemu.__version__
    assert environment_python("other_core") == folder / "bin" / "python"
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    started = time.monotonic()
    assert build_environment("other_core") == folder
    assert time.monotonic() - started < 1.0  # cached


@pytest.mark.slow_env
@needs_env_builds
def test_fpemu_runs_there_on_the_other_numpy(other_core):
    assert call_in_environment("other_core", "importlib.metadata:version", "numpy") == "2.3.5"
    values = np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 1e4
    for name in ("bf16", "fp16", "fp8_e4m3fn"):
        there = call_in_environment("other_core", "fpemu:quantize", values, name)
        assert there.view(np.uint32).tolist() == fpemu.quantize(values, name).view(np.uint32).tolist()
    seq = [False, True, False, False, False]
    trace = call_in_environment("other_core", "fpemu:simulate_scaler", seq, "flax")
    assert trace.scales == fpemu.simulate_scaler(seq, "flax").scales


@pytest.mark.slow_env
@needs_env_builds
def test_a_killed_build_leaves_nothing_half_made(env_dir, monkeypatch):
    monkeypatch.setitem(environments.ENVIRONMENTS, "killed", OTHER_CORE)
    script = (f"from fpemu import environments as e; e.ENVIRONMENTS['killed'] = {OTHER_CORE!r}; "
              "e.build_environment('killed')")
    builder = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "FPEMU_ENV_DIR": str(env_dir)},
                               start_new_session=True)
    final = environments.environment_dir("killed")
    deadline = time.monotonic() + 60
    while not list(env_dir.glob(f".{final.name}.building-*")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(3)  # into the venv or pip install
    os.killpg(builder.pid, signal.SIGKILL)  # the build and its venv / pip children, as a job is killed
    builder.wait()
    assert not final.exists() and environment_python("killed") is None
    leftover = list(env_dir.glob(f".{final.name}.building-*"))
    assert leftover, "the killed build should have left its temporary folder"
    environments._sweep_abandoned(final)  # the next build starts with this
    assert not any(p.exists() for p in leftover)


def test_an_installed_fpemu_without_a_checkout_can_still_look_environments_up(monkeypatch):
    """Outside a source checkout (fpemu installed as a package) the adapters' skip check must say why
    an environment adapter cannot run, never raise; only building needs the checkout."""
    from fpemu.adapters import unavailable_reason
    from fpemu import environments

    def no_checkout():
        raise environments.EnvironmentBuildError("fpemu at /site-packages is not a source checkout")

    monkeypatch.setattr(environments, "_checkout_root", no_checkout)
    # the installed distribution's metadata, whose bounds are those of the last install (docs/versions.md)
    assert [r.split(">=")[0] for r in environments.core_requirements()[:2]] == ["numpy", "ml_dtypes"]
    reason = unavailable_reason("paddle_cpu")
    assert reason is None or "fpemu env build paddle" in reason


# --- the cache: list and prune --------------------------------------------------------

def _fake_environment(root, name, days_ago, size, requirements=("jax==0.4.31",), packages=None):
    """A cache folder as a build leaves it (its manifest and last-use stamp), aged ``days_ago``."""
    folder = root / f"{name}-0123456789ab"
    folder.mkdir(parents=True)
    manifest = {"name": name, "requirements": list(requirements) + ["numpy>=1.26"], "size_bytes": size,
                "packages": packages or {"jax": "0.4.31", "numpy": "2.4.6"}}
    (folder / environments.MANIFEST).write_text(json.dumps(manifest))
    stamp = folder / environments.LAST_USED
    stamp.touch()
    when = time.time() - days_ago * 86400
    os.utime(stamp, (when, when))
    return folder


def test_env_list_shows_every_cached_environment(env_dir, capsys):
    _fake_environment(env_dir, "matrix-jax-0.4.31-1a2b3c4d", 3, 300 * 2**20)
    _fake_environment(env_dir, "paddle", 0.5, 2**30, ("paddlepaddle==3.3.1",), {"paddlepaddle": "3.3.1"})
    assert main(["env", "list", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["versions"], r["size_bytes"]) for r in listed["environments"]] == [
        ("paddle", {"paddlepaddle": "3.3.1"}, 2**30), ("matrix-jax-0.4.31-1a2b3c4d", {"jax": "0.4.31"}, 300 * 2**20)]
    assert listed["unbuilt"] == ["paddle", "tf_keras"] and listed["root"] == str(env_dir)  # fake paddle: another hash
    assert main(["env", "list"]) == 0
    text = capsys.readouterr().out
    assert "matrix-jax-0.4.31-1a2b3c4d" in text and "3 d ago" in text and "300 MiB  jax 0.4.31" in text
    assert "2 environments, 1324 MiB in" in text


def test_env_prune_by_age_size_and_all(env_dir, capsys):
    old = _fake_environment(env_dir, "matrix-old", 40, 100)
    middle = _fake_environment(env_dir, "matrix-middle", 10, 100)
    recent = _fake_environment(env_dir, "matrix-recent", 0.0001, 100)  # 9 s ago: may be in use
    live = env_dir / f".paddle-0123456789ab.building-{os.getpid()}-x1"  # this process is alive: a build in progress
    live.mkdir()
    dead = env_dir / ".paddle-0123456789ab.building-999999999-x2"
    dead.mkdir()

    assert main(["env", "prune", "--older-than", "30", "--dry-run"]) == 0
    assert "would remove matrix-old" in capsys.readouterr().out and old.exists()
    assert main(["env", "prune", "--older-than", "30"]) == 0
    assert not old.exists() and middle.exists() and live.exists() and not dead.exists()
    assert main(["env", "prune", "--max-size", "100"]) == 0  # 200 bytes left: the least recently used goes
    assert not middle.exists() and recent.exists()
    assert main(["env", "prune", "--all"]) == 0
    assert recent.exists() and live.exists()  # used seconds ago, and a live build: never pruned
    capsys.readouterr()
    assert main(["env", "prune"]) == 2
    assert "give --older-than DAYS, --max-size SIZE or --all" in capsys.readouterr().err
    assert main(["env", "prune", "--max-size", "lots"]) == 2


def test_size_cap_prunes_after_a_build(here, env_dir, monkeypatch):
    """$FPEMU_ENV_MAX_SIZE: a finished build removes the least recently used until the cache fits."""
    stale = _fake_environment(env_dir, "matrix-stale", 5, 2**20)
    monkeypatch.setenv("FPEMU_ENV_MAX_SIZE", "1K")
    removed = environments.prune_environments(max_bytes=environments.size_cap(),
                                              keep=(environments.environment_dir("here"),))
    assert [e.name for e in removed] == ["matrix-stale"] and not stale.exists()
    monkeypatch.setenv("FPEMU_ENV_MAX_SIZE", "huge")
    with pytest.raises(FpemuInputError, match=r"\$FPEMU_ENV_MAX_SIZE: expected a size such as 20G"):
        environments.size_cap()


def test_env_help_states_the_cache_place(capsys):
    with pytest.raises(SystemExit):
        main(["env", "list", "--help"])
    assert "$FPEMU_ENV_DIR" in capsys.readouterr().out
