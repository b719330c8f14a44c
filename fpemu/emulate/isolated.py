"""A user's model file run in a child process, each phase under a time limit.

A model file is the user's code: at import, in ``build`` or in a step it may loop forever, sleep, raise
KeyboardInterrupt or end the process (``sys.exit``, ``os._exit``).  :func:`emulate_isolated` runs
:func:`fpemu.emulate.run.emulate_file` in a spawned child that reports each phase (``import``, ``build``,
step ``i``) as it starts; the parent waits for each report at most ``step_timeout`` seconds (and the whole
run at most ``timeout``), so every such file ends in an FpemuInputError naming the file and the phase
(exit 2), and the child is killed.  The child runs in a session (and process group) of its own, and when the run
ends, however it ends, the whole group is killed: a process the file started (``os.fork``, ``subprocess``) does not
outlive fpemu holding its stdout and stderr.  Whatever the file raises, ``BaseException`` included, is one line naming
the phase, never a traceback.  The trace comes back pickled (its dicts in their order: the report
page lists the metadata as built), so the outputs are byte for byte those of an in-process run.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import signal
import time
import traceback
from typing import Optional

from fpemu.emulate._model_file import model_file_text
from fpemu.errors import FpemuInputError, raised
from fpemu.framework_logs import quiet_framework_logs

DEFAULT_STEP_TIMEOUT = 600.0  # seconds: the import, build() and each step (a large model's first step compiles)
STARTUP_TIMEOUT = 120.0  # seconds the child may take to start (Python and fpemu's imports) before the file runs


class ModelFileCrash(RuntimeError):
    """fpemu itself failed in the child (not the model file's contract): an internal error, exit 3."""


def _phase_name(phase) -> str:
    if phase == "start":
        return "starting fpemu's child process"
    if phase == "import":
        return "importing it"
    if phase == "build":
        return "build()"
    return f"step {phase}"


def _child(sender, path: str, threads: Optional[int], options: dict) -> None:
    """The child's whole run: phases, then the trace, an input error's message or fpemu's traceback."""
    try:
        os.setsid()  # a session of its own: the parent kills it and whatever the file starts as one group
    except (OSError, AttributeError):  # (already a group leader: not under multiprocessing's spawn)
        pass
    quiet_framework_logs()  # a spawned interpreter: the CLI's filters are not here
    phase = "start"

    def send(message) -> None:
        try:
            sender.send(message)
        except OSError:  # the parent stopped reading (a limit passed, it was interrupted): nothing to report to
            os._exit(1)

    def report(next_phase) -> None:
        nonlocal phase
        phase = next_phase
        send(("phase", next_phase))

    try:
        if threads is not None:
            import torch
            torch.set_num_threads(threads)
        from fpemu.emulate.run import emulate_file  # fpemu's start-up, before the file's time starts
        report("import")
        send(("trace", emulate_file(path, on_step=report, **options)))
    except FpemuInputError as error:
        send(("input_error", str(error)))
    except Exception:  # noqa: BLE001 -- fpemu's own failure: the parent reports it as internal
        send(("internal", traceback.format_exc()))
    except BaseException as error:  # raised by the file (KeyboardInterrupt, SystemExit, BaseException itself)
        send(("input_error", f"{path}: {_phase_name(phase)} raised {raised(error)}"))
    finally:
        sender.close()


def _checked_limit(value, option: str) -> Optional[float]:
    if value is not None and not (isinstance(value, (int, float)) and 0 < value < math.inf):
        raise FpemuInputError(f"{option} {value!r}: expected seconds > 0 (a finite number)")
    return value


def emulate_isolated(path, *, step_timeout: float = DEFAULT_STEP_TIMEOUT, timeout: Optional[float] = None,
                     threads: Optional[int] = None, progress=None, **options):
    """:func:`fpemu.emulate.run.emulate_file` of ``path`` (with ``options``) in a child process.

    Args:
      step_timeout: seconds the import, ``build`` and each step may take (``--step-timeout``).
      timeout: seconds the whole run may take (``--timeout``); None: no limit beyond the per-step one.
      threads: torch intra-op threads in the child (None: torch's default).
      progress: ``progress(done, total, label)`` as each step starts (None: silent).

    Raises:
      FpemuInputError: what the run raises, and a phase past its limit, a file that raised KeyboardInterrupt
        or SystemExit, or that ended the child process (``os._exit``), each naming the file and the phase.
      ModelFileCrash: fpemu itself failed in the child (its traceback is the message).
    """
    _checked_limit(step_timeout, "--step-timeout")
    _checked_limit(timeout, "--timeout")
    model_file_text(path)  # a missing or non-Python file is refused here, before a child imports torch
    context = multiprocessing.get_context("spawn")  # no fork: the parent's frameworks and threads stay its own
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(sender, str(path), threads, options), daemon=True)
    child.start()
    sender.close()
    grace = 0.0  # a child past its limit (or the parent interrupted) is killed at once
    try:
        steps = options.get("steps", 0)
        try:
            trace = _results(receiver, child, str(path), step_timeout, timeout,
                             lambda index: progress and progress(index, steps, f"step {index}"))
        except FpemuInputError as error:  # the child's own report of its end, or a limit it ran past
            grace = 0.0 if isinstance(error, _TimedOut) else 1.0
            raise
        grace = 1.0  # the child reported its end: it may exit by itself
        if progress:
            progress(steps, steps, "done")  # ends the bar's line
        return trace
    finally:
        _stop(child, grace)  # before the pipe closes: the child never writes to a closed pipe
        receiver.close()


class _TimedOut(FpemuInputError):
    """A phase (or the whole run) ran past its limit."""


def _results(receiver, child, path: str, step_timeout: float, timeout: Optional[float], on_step):
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    phase = "start"
    while True:
        wait = min(max(step_timeout, STARTUP_TIMEOUT) if phase == "start" else step_timeout, deadline - time.monotonic())
        if wait <= 0 or not receiver.poll(wait):
            limit = (f"the --timeout of {timeout:g} s" if time.monotonic() >= deadline
                     else f"the per-step limit of {step_timeout:g} s (--step-timeout)")
            raise _TimedOut(f"{path}: {_phase_name(phase)} timed out: it ran past {limit}")
        try:
            kind, value = receiver.recv()
        except EOFError:
            raise FpemuInputError(f"{path}: the model file ended its process (exit code {_exit_code(child, 5)}) "
                                  f"during {_phase_name(phase)}: a model file returns from build() and step(), it "
                                  "does not exit (sys.exit, os._exit)") from None
        if kind == "phase":
            phase = value
            if isinstance(phase, int):
                on_step(phase)
        elif kind == "trace":
            return value
        elif kind == "input_error":
            raise FpemuInputError(value)
        else:
            raise ModelFileCrash(f"fpemu failed while running {path} ({_phase_name(phase)}):\n{value}")


def _exit_code(child, wait: float) -> Optional[int]:
    """The child's exit code as multiprocessing gives it (-N: killed by signal N), waiting at most ``wait`` s;
    None while it runs.  The child is not reaped: its process group stays its own until :func:`_stop` kills it."""
    if not hasattr(os, "waitid"):  # (not POSIX: no process groups either)
        child.join(wait)
        return child.exitcode
    deadline = time.monotonic() + wait
    while True:
        if child.exitcode is not None:
            return child.exitcode
        try:
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped elsewhere
            return child.exitcode
        if info is not None:
            return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def _stop(child, grace: float) -> None:
    """The child and every process it started ended: after at most ``grace`` s for the child to end by itself,
    its process group (its session, made by :func:`_child`) is killed, the child itself where it had not made
    one yet; then the child is joined."""
    _exit_code(child, grace)
    try:
        os.killpg(child.pid, signal.SIGKILL)  # the child's pid is its group's (unreaped: not yet reused)
    except (ProcessLookupError, PermissionError, AttributeError):  # no group yet (or no longer): the child alone
        pass
    if child.is_alive():
        child.kill()
    child.join()
