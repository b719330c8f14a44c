"""--executor dask:ADDRESS on a local Dask cluster of worker processes (CI stage 2: FPEMU_TEST_ENVS=1, the
dask extra): `fpemu run` writes what it writes with its jobs here; a job whose worker dies, or that runs past
--timeout in a task thread, is its result line; a scheduler that does not answer is bad input."""

import os
import sys
import time

import pytest

from fpemu.errors import FpemuInputError
from fpemu.harness import pool
from fpemu.harness.limits import JOB_TIMEOUT, JobTimedOut, job_timeout, time_limit

distributed = pytest.importorskip("distributed", reason="Dask's distributed is not installed (the dask extra)")
pytestmark = pytest.mark.stage2("a local Dask cluster; the pool's executors in test_pool.py")


@pytest.fixture(scope="module")
def scheduler():
    import cloudpickle
    import dask
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # its workers need not import this file
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):  # a job that kills a worker: no retry
        with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None,
                                      silence_logs=40) as cluster:
            yield cluster.scheduler_address


def _died(*job):
    return ("died", job[-1])


def _on_cluster(address, work, jobs, timeout=None):
    with pool.job_workers(1, address), job_timeout(timeout):
        return list(pool.in_order(work, jobs, died=_died))


def _exit_on(value):
    if value == 2:
        os._exit(3)
    return value, os.getpid()


def test_results_come_back_in_job_order_from_the_clusters_workers(scheduler):
    results = _on_cluster(scheduler, _exit_on, [(1,), (3,), (4,)])
    assert [value for value, _ in results] == [1, 3, 4] and os.getpid() not in {pid for _, pid in results}


def test_a_job_whose_worker_dies_is_its_result_line(scheduler):
    # alone: a dying worker fails every task it holds (with no retries here, queued ones too), which is Dask's
    (result,) = _on_cluster(scheduler, _exit_on, [(2,)])
    assert result[0] == "died" and result[1].startswith("its Dask workers died in it"), result
    assert [value for value, _ in _on_cluster(scheduler, _exit_on, [(1,), (3,)])] == [1, 3]  # its nanny restarted it


def _busy_under_the_limit(seconds):
    try:
        with time_limit(JOB_TIMEOUT.get()):
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
    except JobTimedOut as late:
        return str(late)
    return "finished"


def test_timeout_stops_a_job_in_a_dask_task_thread(scheduler):
    started = time.monotonic()
    assert _on_cluster(scheduler, _busy_under_the_limit, [(30,), (0.01,)], timeout=0.5) == [
        "timed out after 0.5 s (--timeout)", "finished"]
    assert time.monotonic() - started < 20


def test_fpemu_run_on_the_cluster_writes_what_it_writes_here(scheduler, tmp_path, monkeypatch):
    from test_pool import assert_runs_write_the_same
    assert_runs_write_the_same(tmp_path, monkeypatch, ("1",), ("1", "--executor", f"dask:{scheduler}"))


def test_a_scheduler_that_does_not_answer_is_bad_input(monkeypatch):
    monkeypatch.setattr(pool, "CONNECT_S", 1)
    with pytest.raises(FpemuInputError, match=r"--executor dask:tcp://127.0.0.1:9: no Dask scheduler answers"):
        _on_cluster("tcp://127.0.0.1:9", _exit_on, [(1,)])
