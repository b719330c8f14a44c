"""A time limit on each job (``--timeout SECONDS``): a job past it is one result line, never a hang.

The CLI sets the limit for a command with :func:`job_timeout`; :func:`fpemu.harness.jobs.run_job` runs each
job under :func:`time_limit`, which raises :class:`JobTimedOut` in the job when the limit passes
(``SIGALRM`` in the main thread of a POSIX process; in another thread, a Dask worker's, a timer raises
it there).  It is handled between Python bytecodes, so a job stuck inside one C call (a framework kernel)
stops when that call returns (fpemu.harness.pool kills a worker process whose job is stuck so), and one inside an import stops once the import is done (a module left half-imported would break
every later job of the process); a [ranks] case runs in worker processes under its own limit (``--rank-timeout``).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import signal
import sys
import threading
from typing import Optional

from fpemu.errors import FpemuInputError

JOB_TIMEOUT = contextvars.ContextVar("fpemu_job_timeout", default=None)  # seconds, or None: no limit


class JobTimedOut(BaseException):
    """A job ran past its limit (a BaseException: a framework's ``except Exception`` must not swallow it)."""

    def __init__(self, seconds: float):
        super().__init__(f"timed out after {seconds:g} s (--timeout)")
        self.seconds = seconds


def checked_timeout(seconds, option: str = "--timeout") -> Optional[float]:
    """``seconds`` when it is a usable limit (None: none), else an FpemuInputError naming ``option``."""
    if seconds is not None and not (isinstance(seconds, (int, float)) and 0 < seconds < math.inf):
        raise FpemuInputError(f"{option} {seconds!r}: expected seconds > 0 (a finite number)")
    return seconds


@contextlib.contextmanager
def job_timeout(seconds: Optional[float]):
    """Every job run inside the block has at most ``seconds`` (checked: FpemuInputError naming --timeout)."""
    token = JOB_TIMEOUT.set(checked_timeout(seconds))
    try:
        yield
    finally:
        JOB_TIMEOUT.reset(token)


_IMPORT_RECHECK_S = 0.05


def _importing() -> bool:
    """Whether a module is being imported now (its spec marked initializing, as importlib does)."""
    return any(getattr(getattr(module, "__spec__", None), "_initializing", False)
               for module in list(sys.modules.values()))


def _can_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: Optional[float]):
    """Raise :class:`JobTimedOut` in the block once ``seconds`` pass (None: no limit).

    In a process's main thread the limit is ``SIGALRM`` (it also cuts short a sleep or a blocking
    system call); in any other thread (a Dask worker's task, fpemu.harness.pool) it is raised in that
    thread from a timer, between two bytecodes, so one C call runs to its end first.
    """
    if seconds is None:
        yield
        return
    raised, modes = [], _framework_modes()
    arm, disarm = _alarm(seconds, raised) if _can_alarm() else _thread_timer(seconds, raised)
    arm()
    try:
        yield
    except JobTimedOut:
        raise
    except BaseException as error:
        # Raised inside a C call's argument conversion, the limit comes out as that call's own error
        # (ctypes: ArgumentError naming JobTimedOut): it is still the limit, not a failure of the job.
        if raised:
            raise JobTimedOut(seconds) from error
        raise
    else:
        if raised:  # swallowed by the job's code (a fallback after a caught error): its result is not to be trusted
            raise JobTimedOut(seconds)
    finally:
        disarm()
        if raised:
            _restore_framework_modes(modes)


# torch's thread-local modes as a job finds them outside any context: grad on, autocast off on every device type
_TORCH_DEFAULTS = {"grad": True, "autocast": {"cpu": (False, "bfloat16"), "cuda": (False, "float16")}}


def _framework_modes() -> dict:
    """torch's thread-local modes now (its defaults where torch is not imported, or half-imported): what a job
    cut off by its limit restores."""
    torch = sys.modules.get("torch")
    if not hasattr(torch, "get_autocast_dtype"):
        return _TORCH_DEFAULTS
    autocast = {device: (torch.is_autocast_enabled(device), str(torch.get_autocast_dtype(device)).split(".")[-1])
                for device in _TORCH_DEFAULTS["autocast"]}
    return {"grad": torch.is_grad_enabled(), "autocast": autocast}


def _restore_framework_modes(modes: dict) -> None:
    """Put torch's thread-local modes back as ``modes`` holds them.  A limit cuts a job off between two bytecodes:
    inside ``torch.no_grad().__enter__`` after its switch (before the ``with`` block that would switch back), or in
    a loop's own ``torch.set_grad_enabled(False)`` stretch, it left gradients off for every later job of the process
    (a suite's later torch tests failed so: "element 0 of tensors does not require grad")."""
    torch = sys.modules.get("torch")
    if not hasattr(torch, "set_autocast_dtype"):
        return
    torch.set_grad_enabled(modes["grad"])
    for device, (enabled, dtype) in modes["autocast"].items():
        torch.set_autocast_enabled(device, enabled)
        torch.set_autocast_dtype(device, getattr(torch, dtype))


def _alarm(seconds: float, raised: list) -> tuple:
    previous = []

    def expired(signum, frame):
        if _importing():  # raised inside an import, it would leave a half-initialized module in sys.modules
            signal.setitimer(signal.ITIMER_REAL, _IMPORT_RECHECK_S)  # for every later job: stop once it is done
            return
        raised.append(True)
        raise JobTimedOut(seconds)

    def arm():
        previous.append(signal.signal(signal.SIGALRM, expired))
        signal.setitimer(signal.ITIMER_REAL, seconds)

    def disarm():
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous[0])
    return arm, disarm


def _thread_timer(seconds: float, raised: list) -> tuple:
    """The limit of a block in a thread other than the main one: a timer thread raises it there
    (``PyThreadState_SetAsyncExc``, which takes an exception class and calls it with no arguments)."""
    import ctypes
    target, lock, timers, ended = threading.get_ident(), threading.Lock(), [], []
    timed_out = type("JobTimedOut", (JobTimedOut,), {"__init__": lambda self: JobTimedOut.__init__(self, seconds)})

    def expired():
        with lock:
            if ended:
                return
            if _importing():
                timers.append(threading.Timer(_IMPORT_RECHECK_S, expired))
                timers[-1].daemon = True
                timers[-1].start()
                return
            raised.append(True)
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), ctypes.py_object(timed_out))

    def arm():
        timers.append(threading.Timer(seconds, expired))
        timers[-1].daemon = True
        timers[-1].start()

    def disarm():
        with lock:
            ended.append(True)
            for timer in timers:
                timer.cancel()
            if raised:  # not delivered yet (the block ended first): withdrawn, or it would hit the caller
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(target), None)
    return arm, disarm
