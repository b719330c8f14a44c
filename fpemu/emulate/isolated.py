"""A user's model file run in a child process, each phase under a time limit.

A model file is the user's code: at import, in ``build`` or in a step it may loop forever, sleep, raise
KeyboardInterrupt or end the process (``sys.exit``, ``os._exit``).  :func:`emulate_isolated` runs
:func:`fpemu.emulate.run.emulate_file` in a spawned child that reports each phase (``import``, ``build``,
step ``i``) as it starts; the parent waits for each report at most ``step_timeout`` seconds (and the whole
run at most ``timeout``), so every such file ends in an FpemuInputError naming the file and the phase
(exit 2), and the child is killed.  The trace comes back pickled (its dicts in their order: the report
page lists the metadata as built), so the outputs are byte for byte those of an in-process run.
"""

from __future__ import annotations

import math
import multiprocessing
import time
import traceback
from typing import Optional

from fpemu.emulate._model_file import model_file_text
from fpemu.errors import FpemuInputError

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
    phase = "start"

    def report(next_phase) -> None:
        nonlocal phase
        phase = next_phase
        sender.send(("phase", next_phase))

    try:
        if threads is not None:
            import torch
            torch.set_num_threads(threads)
        from fpemu.emulate.run import emulate_file  # fpemu's start-up, before the file's time starts
        report("import")
        sender.send(("trace", emulate_file(path, on_step=report, **options)))
    except FpemuInputError as error:
        sender.send(("input_error", str(error)))
    except (KeyboardInterrupt, SystemExit, GeneratorExit) as error:  # raised by the file: no reason to stop fpemu
        sender.send(("input_error", f"{path}: {_phase_name(phase)} raised {type(error).__name__}"
                                    f"{': ' + str(error) if str(error) else ''}"))
    except Exception:  # noqa: BLE001 -- fpemu's own failure: the parent reports it as internal
        sender.send(("internal", traceback.format_exc()))
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
    try:
        steps = options.get("steps", 0)
        trace = _results(receiver, child, str(path), step_timeout, timeout,
                         lambda index: progress and progress(index, steps, f"step {index}"))
        if progress:
            progress(steps, steps, "done")  # ends the bar's line
        return trace
    finally:
        receiver.close()
        _stop(child)


def _results(receiver, child, path: str, step_timeout: float, timeout: Optional[float], on_step):
    deadline = math.inf if timeout is None else time.monotonic() + timeout
    phase = "start"
    while True:
        wait = min(max(step_timeout, STARTUP_TIMEOUT) if phase == "start" else step_timeout, deadline - time.monotonic())
        if wait <= 0 or not receiver.poll(wait):
            limit = (f"the --timeout of {timeout:g} s" if time.monotonic() >= deadline
                     else f"the per-step limit of {step_timeout:g} s (--step-timeout)")
            raise FpemuInputError(f"{path}: {_phase_name(phase)} timed out: it ran past {limit}")
        try:
            kind, value = receiver.recv()
        except EOFError:
            child.join(5)
            raise FpemuInputError(f"{path}: the model file ended its process (exit code {child.exitcode}) during "
                                  f"{_phase_name(phase)}: a model file returns from build() and step(), it does not "
                                  "exit (sys.exit, os._exit)") from None
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


def _stop(child) -> None:
    """The child ended: joined when it has, terminated (then killed) when it has not."""
    child.join(1)
    if child.is_alive():
        child.terminate()
        child.join(5)
    if child.is_alive():
        child.kill()
        child.join()
