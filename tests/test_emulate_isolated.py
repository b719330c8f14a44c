"""fpemu emulate runs the model file in a child process: a hang, an exit or a KeyboardInterrupt in it is a named
error (exit 2, naming the file and the phase), never a hang of fpemu, a traceback or fpemu ending with the file's code."""

import os
import time
import textwrap

import pytest

from fpemu.cli import main
from fpemu.emulate.run import emulate_file
from fpemu.errors import FpemuInputError


def _run(tmp_path, text, *extra, name="model.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    code = main(["emulate", str(path), "--steps", "2", "--no-plot", "--out", str(tmp_path / "out"), *extra])
    return code, path


# Each case spawns a child that imports torch (5-20 s on 2 cores): a hang and an os._exit in the default suite,
# the other endings in stage 2 (FPEMU_TEST_ENVS=1).
STAGE2 = pytest.mark.stage2("another child process; the hang and the os._exit cases of these tests")


# The outside fuzzer's model files (issue 24): each hung, escaped as a traceback, or ended fpemu with its own code.
@pytest.mark.parametrize("text, words", [
    ("while True:\n    pass\n", "importing it timed out: it ran past the per-step limit of 1 s (--step-timeout)"),
    pytest.param("import os\nos._exit(7)\n", "the model file ended its process (exit code 7) during importing it",
                 marks=pytest.mark.stage2("os._exit(3) during a step, in test_a_step_that_hangs_or_exits_is_a_named_error")),
    pytest.param("import sys\nsys.exit(5)\n", "importing it raised SystemExit: 5", marks=STAGE2),
    pytest.param("raise KeyboardInterrupt\n", "importing it raised KeyboardInterrupt", marks=STAGE2),
    pytest.param("FRAMEWORK = ['jax']\n", "FRAMEWORK = ['jax']; fpemu emulate runs 'torch', 'jax'", marks=STAGE2),
])
def test_a_model_file_that_hangs_or_exits_at_import_is_a_named_error(tmp_path, capsys, text, words):
    code, path = _run(tmp_path, text, "--step-timeout", "1")  # the file's time starts after fpemu's start-up
    err = capsys.readouterr().err
    assert code == 2 and f"{path}: " in err and words in err, err


@STAGE2
def test_the_whole_run_honours_timeout(tmp_path, capsys):
    code, path = _run(tmp_path, "import time\ntime.sleep(600)\n", "--timeout", "8")
    err = capsys.readouterr().err  # the limit counts from the start: the child's own start-up is inside it
    assert code == 2 and f"{path}: " in err and "timed out: it ran past the --timeout of 8 s" in err, err


SLOW_STEP = '''
import torch

def build(seed):
    model = torch.nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)

def step(model, optimizer, scaler, index):
    if index == 1:
        {hang}
    loss = model(torch.ones(1, 2)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return loss
'''


@pytest.mark.parametrize("hang, limit, words", [
    # build() imports torch: a limit that leaves it time on a loaded machine, so the case waits 30 s; the
    # default suite's import hang (3 s) runs the same per-phase limit
    pytest.param("import time; time.sleep(600)", "30", "step 1 timed out: it ran past the per-step limit of 30 s",
                 marks=STAGE2),
    ("import os; os._exit(3)", "600", "ended its process (exit code 3) during step 1"),
    pytest.param("raise KeyboardInterrupt", "600", "step 1 raised KeyboardInterrupt",
                 marks=pytest.mark.stage2("test_a_file_raising_base_exception_is_one_line_without_a_traceback")),
])
def test_a_step_that_hangs_or_exits_is_a_named_error(tmp_path, capsys, hang, limit, words):
    pytest.importorskip("torch")
    code, path = _run(tmp_path, SLOW_STEP.replace("{hang}", hang), "--step-timeout", limit)
    err = capsys.readouterr().err
    assert code == 2 and f"{path}: " in err and words in err, err


def test_bad_limits_are_refused(tmp_path, capsys):
    code, _ = _run(tmp_path, "x = 1\n", "--step-timeout", "0")
    assert code == 2 and "--step-timeout 0.0: expected seconds > 0" in capsys.readouterr().err


def test_jax_grads_that_return_none_are_named(tmp_path):
    pytest.importorskip("jax")
    path = tmp_path / "none_grads.py"
    path.write_text(textwrap.dedent('''
        import jax.numpy as jnp
        FRAMEWORK = "jax"
        def build(seed):
            return {"w": jnp.ones(2)}
        def grads(state, scale, index):
            return None
        def update(state, g, index):
            return state
    '''))
    with pytest.raises(FpemuInputError, match=f"{path}: step 0: grads\\(\\) returned NoneType; it returns \\(loss, grads\\)"):
        emulate_file(path, steps=1)


# Bounds of the command line (issue: an outside fuzzer's emulate runs): checked before the child starts.
def test_steps_past_the_model_bound_are_refused_before_a_child_starts(tmp_path, capsys):
    from fpemu.kinds.bounds import bound_for
    code, _ = _run(tmp_path, "x = 1\n", "--steps", "100000000000000000000")
    err = capsys.readouterr().err
    assert code == 2 and "--steps 100000000000000000000" in err and f"{bound_for('steps').limit('model'):,}" in err, err


@pytest.mark.parametrize("seed", ["-1", "4294967296", "100000000000000000000"])
def test_a_seed_past_32_bits_is_refused_before_a_child_starts(tmp_path, capsys, seed):
    code, _ = _run(tmp_path, "x = 1\n", "--seed", seed)
    err = capsys.readouterr().err
    assert code == 2 and f"--seed {seed}: expected 0..4,294,967,295 (a 32-bit seed)" in err, err


def test_a_scaler_param_past_its_bound_is_refused_naming_it(tmp_path, capsys):
    from fpemu.kinds.bounds import bound_for
    code, _ = _run(tmp_path, "x = 1\n", "--param", "growth_interval=1" + "0" * 30)
    err = capsys.readouterr().err
    assert code == 2 and "--param growth_interval=1" in err, err
    assert f"{bound_for('scaler.params.growth_interval').maximum:,}" in err, err


def test_a_file_raising_base_exception_is_one_line_without_a_traceback(tmp_path, capfd):
    code, path = _run(tmp_path, "raise BaseException('boom')\n")
    err = capfd.readouterr().err
    assert code == 2 and f"{path}: importing it raised BaseException: boom" in err and "Traceback" not in err, err


def test_a_child_past_its_limit_prints_no_traceback(tmp_path, capfd):
    # the file's import outlasts --step-timeout, then the child goes on to report its next phase: it must
    # not print a BrokenPipeError traceback for the pipe fpemu has stopped reading
    code, path = _run(tmp_path, "import time\ntime.sleep(1.5)\n", "--step-timeout", "1")
    time.sleep(1.0)  # (the old code left the child running past the limit: it would have reported by now)
    err = capfd.readouterr().err
    assert code == 2 and "importing it timed out" in err and "Traceback" not in err, err


def _dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc") or not hasattr(os, "fork"), reason="reads /proc, forks")
def test_a_process_the_model_file_forks_ends_with_its_child(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    text = (f"import os, time\nif os.fork() == 0:\n    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "    time.sleep(600)\n    os._exit(0)\n")
    code, _ = _run(tmp_path, text)  # (it defines no build(): an input error, once the fork has run)
    assert code == 2
    for _ in range(50):
        if pid_file.exists() and pid_file.read_text():
            break
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 3
    while not _dead(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert _dead(pid), f"the model file's grandchild {pid} outlived fpemu emulate"
    finally:
        if not _dead(pid):
            os.kill(pid, 9)
