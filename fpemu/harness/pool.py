"""Jobs on several processes (``--jobs N``): the same results, in the same order, as one after another.

:func:`in_order` runs ``work(*job)`` for each job on :data:`JOB_WORKERS` worker processes and yields the
results in job order, each as soon as it and every job before it are done, so a command handles (writes,
compares, reports) results exactly as a run of one job after another would, whichever worker finished
first: its files and output are byte-identical at any ``--jobs``.

A worker is a fresh interpreter (spawned, not forked: a forked JAX or torch runtime can deadlock) that runs
one job at a time under the command's ``--timeout``.  A worker that dies in a job (a segfault in a framework
kernel, ``os._exit``, the out-of-memory killer) is that job's result line, made by the caller's ``died``,
and a new worker takes the jobs left; so is a job still running :data:`GRACE_S` past its limit (stuck in one
C call, which the in-job limit cannot interrupt), whose worker is killed.  With one worker, or one job, the
jobs run in this process as before.

With :data:`JOB_EXECUTOR` set (``--executor dask:ADDRESS``) the jobs go to a running Dask cluster instead:
each is one task, its result comes back to this process, which writes everything, in job order as above.
Dask runs tasks in its workers' threads, where the job's limit is raised from a timer (fpemu.harness.limits);
a worker process that dies is restarted by its nanny and the task retried on another, up to the cluster's
``allowed-failures``, then it is the job's result line.
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
from typing import Callable, Iterable, Iterator, Optional

from fpemu.errors import FpemuInputError
from fpemu.framework_logs import quiet_framework_logs
from fpemu.harness.limits import JOB_TIMEOUT, job_timeout

JOB_WORKERS = contextvars.ContextVar("fpemu_job_workers", default=1)  # processes; the CLI sets --jobs
JOB_EXECUTOR = contextvars.ContextVar("fpemu_job_executor", default=None)  # a Dask scheduler's address, or None
LOCAL, DASK = "local", "dask"  # --executor's choices
CONNECT_S = 30  # a Dask scheduler that does not answer in this time is bad input
_POOLS = contextvars.ContextVar("fpemu_job_pools", default=None)  # a job_workers block's [pool], once started
JOBS_ENV = "FPEMU_JOBS"  # the default of --jobs where set (the test suite sets 1); else the usable cores
GRACE_S = 10.0  # past --timeout, a job's worker is killed: the in-job limit could not stop it
_STOP = None  # sent to a worker: no more jobs


def checked_jobs(value, option: str = "--jobs") -> int:
    """``value`` as a number of worker processes (a whole number >= 1), else an FpemuInputError naming
    ``option``."""
    try:
        count = int(value)
    except (TypeError, ValueError):
        count = 0
    if count < 1 or str(count) != str(value).strip():
        raise FpemuInputError(f"{option} {value!r}: expected a whole number of worker processes, at least 1")
    return count


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as taskset or a container's cpuset sets it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_jobs() -> int:
    """--jobs when not given: $FPEMU_JOBS where set, else the usable cores."""
    value = os.environ.get(JOBS_ENV)
    return checked_jobs(value, f"${JOBS_ENV}") if value is not None else usable_cores()


def checked_executor(value: Optional[str], option: str = "--executor") -> Optional[str]:
    """None for ``local`` (worker processes here), else the Dask scheduler address of ``dask:ADDRESS``
    (plain ``dask``: ``$DASK_SCHEDULER_ADDRESS``); anything else is an FpemuInputError naming ``option``."""
    if value is None or value == LOCAL:
        return None
    name, _, address = value.partition(":")
    if name != DASK:
        raise FpemuInputError(f"{option} {value!r}: expected {LOCAL!r} or 'dask:ADDRESS' (a running Dask scheduler, "
                              "e.g. dask:tcp://10.0.0.5:8786)")
    address = address or os.environ.get("DASK_SCHEDULER_ADDRESS", "")
    if not address:
        raise FpemuInputError(f"{option} {value!r}: no scheduler address: give dask:tcp://HOST:PORT or set "
                              "$DASK_SCHEDULER_ADDRESS")
    return address


@contextlib.contextmanager
def job_workers(count: int, executor: Optional[str] = None):
    """Every :func:`in_order` inside the block runs on at most ``count`` worker processes here, or, with
    ``executor`` (a Dask scheduler's address), on that cluster."""
    started = []  # one pool for the whole block: a command's phases (goldens, then jobs) share its workers
    tokens = JOB_WORKERS.set(checked_jobs(count)), JOB_EXECUTOR.set(executor), _POOLS.set(started)
    try:
        yield
    finally:
        for var, token in zip((JOB_WORKERS, JOB_EXECUTOR, _POOLS), tokens):
            var.reset(token)
        for started_pool in started:
            started_pool.close()


def in_order(work: Callable, jobs: Iterable[tuple], died: Callable[..., object],
             imports: Callable[..., frozenset] = lambda *job: frozenset()) -> Iterator:
    """``work(*job)`` for each of ``jobs``, in job order, on :data:`JOB_WORKERS` processes.

    Args:
      work: a module-level function (it is sent to the workers by name); its arguments and result are
        pickled.  What it raises reaches the caller at that job's turn (an FpemuInputError stays one).
      jobs: tuples of ``work``'s arguments.
      died: ``died(*job, why)`` is the result of a job whose worker died or was killed (``why`` says how).
      imports: ``imports(*job)``, the frameworks a job imports: a worker takes the next job it has
        imported every framework of, else one no other worker has, so each framework's import (seconds)
        is paid by as few workers as may be.

    Example::

        for trace, failure in in_order(run_job, [(scenario, impl), ...], died=...):
            ...  # the first job's result first, whichever worker ends first
    """
    jobs = list(jobs)
    if JOB_EXECUTOR.get() is not None and jobs:
        yield from _on_dask(JOB_EXECUTOR.get(), work, jobs, died)
        return
    if min(JOB_WORKERS.get(), len(jobs)) <= 1:
        for job in jobs:
            yield work(*job)
        return
    started = _POOLS.get()
    if started is None:  # outside a job_workers block: a pool for these jobs alone
        pool = _Pool(JOB_WORKERS.get())
        try:
            yield from pool.run(work, jobs, died, imports, JOB_TIMEOUT.get())
        finally:
            pool.close()
        return
    if not started:
        started.append(_Pool(JOB_WORKERS.get()))
    yield from started[0].run(work, jobs, died, imports, JOB_TIMEOUT.get())


def _run(work, job, timeout) -> tuple:
    """One job where it runs (a worker process, a Dask task): ("value", its result) or ("raised", the error),
    for the caller to raise at this job's turn."""
    try:
        with job_timeout(timeout):
            return "value", work(*job)
    except BaseException as error:  # noqa: BLE001 -- the caller raises it at this job's turn
        return "raised", error


def _serve(conn) -> None:
    """A worker process's loop: run each job it is sent and send back what :func:`_run` gives."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    quiet_framework_logs()  # a spawned interpreter: the CLI's filters are not here
    while True:
        try:
            task = conn.recv()
        except EOFError:  # the parent is gone
            return
        if task is _STOP:
            return
        work, job, timeout = task
        conn.send(("began", None))  # the job's time starts now, not when a new worker was still starting
        reply = _run(work, job, timeout)
        try:
            conn.send(reply)
        except Exception as unsendable:  # noqa: BLE001 -- an unpicklable result or error still comes back
            conn.send(("raised", RuntimeError(f"{work.__name__} {reply[0]} something that cannot be sent back "
                                              f"from its worker process: {unsendable}")))


class _Worker:
    """One worker process, its pipe, and the job it runs (None: idle)."""

    def __init__(self, context):
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_serve, args=(theirs,), daemon=True, name="fpemu-job")
        self.process.start()
        theirs.close()
        self.job: Optional[int] = None
        self.started: Optional[float] = None  # when the job began in the worker
        self.imported: frozenset = frozenset()  # the frameworks its jobs imported

    def give(self, index: int, task) -> None:
        self.job, self.started = index, None
        self.conn.send(task)

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send(_STOP)
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _death(process, killed_after: Optional[float]) -> str:
    if killed_after is not None:
        return (f"its worker process was killed {killed_after:.1f} s after the job began: still running "
                f"{GRACE_S:g} s past --timeout, stuck where the limit cannot stop it")
    code = process.exitcode
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"its worker process died of signal {signal.Signals(-code).name}"
    return f"its worker process exited with code {code} in the job"


class _Pool:
    def __init__(self, count: int):
        self._context = multiprocessing.get_context("spawn")
        self._timeout: Optional[float] = None
        self._workers: list = [None] * count  # started as jobs need them; None: none in that place

    def run(self, work, jobs: list, died, imports, timeout: Optional[float]) -> Iterator:
        self._timeout = timeout
        waiting = list(range(len(jobs)))
        needs = [frozenset(imports(*job)) for job in jobs]
        finished = {}  # job index -> ("value" | "raised", object)
        try:
            for index in range(len(jobs)):
                while index not in finished:
                    self._hand_out(work, jobs, needs, waiting)
                    self._collect(jobs, died, finished)
                kind, result = finished.pop(index)
                if kind == "raised":
                    raise result
                yield result
        finally:  # ended early (an error, Ctrl-C): the jobs still running are not waited for
            for place, worker in enumerate(self._workers):
                if worker is not None and worker.job is not None:
                    worker.process.kill()
                    worker.stop()
                    self._workers[place] = None

    def _hand_out(self, work, jobs, needs, waiting: list) -> None:
        for place, worker in enumerate(self._workers):
            if waiting and (worker is None or worker.job is None):
                if worker is None:
                    worker = self._workers[place] = _Worker(self._context)
                index = self._next_for(worker, needs, waiting)
                waiting.remove(index)
                worker.imported |= needs[index]
                worker.give(index, (work, jobs[index], self._timeout))

    def _next_for(self, worker, needs, waiting: list) -> int:
        """The first waiting job ``worker`` has imported everything for; else the first that shares no
        framework with what the other workers imported (a family of its own: torch's, JAX's); else the
        one that needs the fewest new imports."""
        others = frozenset().union(*(w.imported for w in self._workers if w is not None and w is not worker))
        apart = None
        for index in waiting:
            if needs[index] <= worker.imported:
                return index
            if apart is None and not needs[index] & others:
                apart = index
        if apart is not None:
            return apart
        return min(waiting, key=lambda index: len(needs[index] - worker.imported))

    def _collect(self, jobs, died, finished) -> None:
        busy = [w for w in self._workers if w is not None and w.job is not None]
        ready = multiprocessing.connection.wait([w.conn for w in busy] + [w.process.sentinel for w in busy],
                                                timeout=self._time_to_kill(busy))
        for worker in busy:
            if worker.conn in ready:
                try:
                    kind, result = worker.conn.recv()
                except EOFError:  # died in the job: below
                    pass
                else:
                    if kind == "began":
                        worker.started = time.monotonic()
                    else:
                        finished[worker.job], worker.job = (kind, result), None
                    continue
            overdue = self._overdue(worker)
            if worker.conn in ready or worker.process.sentinel in ready or overdue is not None:
                self._replace(worker, jobs, died, finished, overdue)

    def _time_to_kill(self, busy) -> Optional[float]:
        began = [w.started for w in busy if w.started is not None]
        if self._timeout is None or not began:
            return None
        return max(0.0, min(began) + self._timeout + GRACE_S - time.monotonic())

    def _overdue(self, worker) -> Optional[float]:
        if self._timeout is None or worker.started is None:
            return None
        ran = time.monotonic() - worker.started
        return ran if ran >= self._timeout + GRACE_S else None

    def _replace(self, worker, jobs, died, finished, killed_after) -> None:
        """The job of a worker that died (or is killed now) gets its ``died`` result; a new worker takes its
        place when a job needs it."""
        if killed_after is not None:
            worker.process.kill()
        worker.process.join()
        why = _death(worker.process, killed_after)
        finished[worker.job] = ("value", died(*jobs[worker.job], why))
        worker.conn.close()
        self._workers[self._workers.index(worker)] = None

    def close(self) -> None:
        for worker in filter(None, self._workers):
            if worker.job is not None:  # an error or Ctrl-C ends the run: jobs still running are not waited for
                worker.process.kill()
            worker.stop()


# --- a Dask cluster (--executor dask:ADDRESS) -------------------------------------

def _fpemu_version() -> str:
    from fpemu.version import __version__
    return __version__


def _dask_client(address: str):
    where = f"--executor dask:{address}"
    try:
        import distributed
    except ImportError:
        raise FpemuInputError(f"{where}: needs Dask's distributed package (pip install 'fpemu[dask]')") from None
    try:
        client = distributed.Client(address, timeout=CONNECT_S, set_as_default=False)
    except (OSError, TimeoutError, ValueError) as refused:
        raise FpemuInputError(f"{where}: no Dask scheduler answers there ({refused})") from None
    versions = client.run(_fpemu_version)  # {worker address: its fpemu version}
    other = {worker: version for worker, version in versions.items() if version != _fpemu_version()}
    if not versions or other:
        client.close()
        raise FpemuInputError(f"{where}: " + ("the cluster has no workers" if not versions else
                              f"worker {next(iter(other))} runs fpemu {next(iter(other.values()))}, this command "
                              f"{_fpemu_version()}: every worker needs this fpemu (its traces say which made them)"))
    return client, distributed


def _on_dask(address: str, work, jobs: list, died) -> Iterator:
    client, distributed = _dask_client(address)
    try:
        timeout = JOB_TIMEOUT.get()
        futures = client.map(_run, [work] * len(jobs), jobs, [timeout] * len(jobs), pure=False)
        for job, future in zip(jobs, futures):
            try:
                kind, result = future.result()
            except distributed.KilledWorker as killed:
                kind, result = "value", died(*job, f"its Dask workers died in it ({killed})")
            if kind == "raised":
                raise result
            yield result
    finally:
        client.close()  # releases the tasks not yet run: the scheduler drops them
