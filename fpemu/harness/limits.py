"""A time limit on each job (``--timeout SECONDS``): a job past it is one result line, never a hang.

The CLI sets the limit for a command with :func:`job_timeout`; :func:`fpemu.harness.jobs.run_job` runs each
job under :func:`time_limit`, which raises :class:`JobTimedOut` in the job when the limit passes
(``SIGALRM``: the main thread of a POSIX process; elsewhere no limit is set).  The signal is handled
between Python bytecodes, so a job stuck inside one C call (a framework kernel) stops when that call
returns, and one inside an import stops once the import is done (a module left half-imported would break
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
    """Raise :class:`JobTimedOut` in the block once ``seconds`` pass (None, or no SIGALRM here: no limit)."""
    if seconds is None or not _can_alarm():
        yield
        return

    raised = []

    def expired(signum, frame):
        if _importing():  # raised inside an import, it would leave a half-initialized module in sys.modules
            signal.setitimer(signal.ITIMER_REAL, _IMPORT_RECHECK_S)  # for every later job: stop once it is done
            return
        raised.append(JobTimedOut(seconds))
        raise raised[0]

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except JobTimedOut:
        raise
    except BaseException as error:
        # Raised inside a C call's argument conversion, the limit comes out as that call's own error
        # (ctypes: ArgumentError naming JobTimedOut): it is still the limit, not a failure of the job.
        if raised:
            raise raised[0] from error
        raise
    else:
        if raised:  # swallowed by the job's code (a fallback after a caught error): its result is not to be trusted
            raise raised[0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
