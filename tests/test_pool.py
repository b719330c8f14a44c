"""fpemu.harness.pool: jobs on worker processes give the results of one job after another, in job order; a
worker that dies or hangs is its job's result; bad input still reaches the caller."""

import os
import signal
import time

import pytest

from fpemu.errors import FpemuInputError
from fpemu.harness import pool
from fpemu.harness.limits import job_timeout


def _square_later(value, delay):
    time.sleep(delay)
    return value * value, os.getpid()


def _died(*job):
    return ("died", job[-1])


def _results(work, jobs, workers=2):
    with pool.job_workers(workers):
        return list(pool.in_order(work, jobs, died=_died))


def test_results_come_in_job_order_whichever_worker_ends_first():
    # the first job is the slowest: the others end first, on the other worker
    jobs = [(1, 1.0), (2, 0.0), (3, 0.0), (4, 0.0)]
    results = _results(_square_later, jobs)
    assert [value for value, _ in results] == [1, 4, 9, 16]
    pids = {pid for _, pid in results}
    assert len(pids) == 2 and os.getpid() not in pids  # two workers, neither this process


def _noise_filtered(_):
    import logging
    from fpemu.framework_logs import NOISE_FILTERS
    return all(keep in logging.getLogger(name).filters for name, keep in NOISE_FILTERS.items()), os.getpid()


def test_each_worker_drops_the_frameworks_import_noise():
    """A worker is a fresh interpreter: without the CLI's logging filters installed there, each worker importing
    torchao printed its "Failed to load ..._C_mxfp8...so" lines (the stage-2 torchao run below shows it end to
    end; tests/test_cli.py the filters' own cases)."""
    results = _results(_noise_filtered, [(0,), (1,)])
    assert [installed for installed, _ in results] == [True, True] and len({pid for _, pid in results}) == 2


def test_one_worker_runs_the_jobs_here():
    assert {pid for _, pid in _results(_square_later, [(1, 0), (2, 0)], workers=1)} == {os.getpid()}


def _crash_on(value):
    if value == 2:
        os.kill(os.getpid(), signal.SIGSEGV)
    if value == 3:
        os._exit(7)
    return value


def test_a_worker_that_dies_is_its_jobs_result_and_the_other_jobs_still_run():
    results = _results(_crash_on, [(1,), (2,), (3,), (4,), (5,)])
    assert results[0] == 1 and results[3:] == [4, 5]
    assert results[1] == ("died", "its worker process died of signal SIGSEGV")
    assert results[2] == ("died", "its worker process exited with code 7 in the job")


def _refuse(value):
    if value == 2:
        raise FpemuInputError(f"spec {value}: expected something else")
    return value


def test_bad_input_in_a_job_reaches_the_caller_at_its_turn():
    seen = []
    with pool.job_workers(2), pytest.raises(FpemuInputError, match="spec 2: expected"):
        for result in pool.in_order(_refuse, [(1,), (2,), (3,)], died=_died):
            seen.append(result)
    assert seen == [1]


def _stuck_where_no_signal_reaches(value):
    if value == 1:  # SIGALRM blocked: the in-job --timeout cannot stop it, as inside one long C call
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return value


def test_a_job_stuck_past_its_timeout_is_killed(monkeypatch):
    monkeypatch.setattr(pool, "GRACE_S", 0.5)
    began = time.monotonic()
    with job_timeout(0.5):
        results = _results(_stuck_where_no_signal_reaches, [(1,), (2,)])
    assert results[1] == 2 and results[0][0] == "died"
    assert results[0][1].startswith("its worker process was killed") and "past --timeout" in results[0][1]
    assert time.monotonic() - began < 30


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5", ""])
def test_jobs_must_be_a_whole_number_of_workers(value):
    with pytest.raises(FpemuInputError, match=f"--jobs {value!r}: expected a whole number"):
        pool.checked_jobs(value)


def test_the_default_is_fpemu_jobs_else_the_usable_cores(monkeypatch):
    monkeypatch.setenv(pool.JOBS_ENV, "3")
    assert pool.default_jobs() == 3
    monkeypatch.setenv(pool.JOBS_ENV, "many")
    with pytest.raises(FpemuInputError, match=r"\$FPEMU_JOBS 'many'"):
        pool.default_jobs()
    monkeypatch.delenv(pool.JOBS_ENV)
    assert pool.default_jobs() == len(os.sched_getaffinity(0))


# five scaler adapters (keras among them: it set KERAS_BACKEND for every later job of its process), a step,
# a skipped job; .ci/run's stage 2 compares the whole `fpemu run` at --jobs 1 and 2
RUN_SPECS = ["flax_vs_torch_timing.toml", "step_bf16_torch.toml", "floor_paddle.toml"]


def _run_files(tmp_path, jobs: str, *more) -> tuple:
    """What `fpemu run --jobs N [MORE...]` prints and writes (path -> bytes), from the same folders each time,
    as a fresh process (as its workers are: this one holds the state of the tests before, JAX's config
    among it)."""
    import shutil
    import subprocess
    import sys
    reports = tmp_path / "reports"
    shutil.rmtree(reports, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "fpemu", "run", "--specs", str(tmp_path / "specs"), "--reports",
                           str(reports), "--jobs", jobs, "--quiet", *more], capture_output=True, text=True, timeout=600)
    assert done.returncode in (0, 1), done.stderr[-3000:]
    # torchao's "Failed to load ..._C_mxfp8...so" (a CPU torch) and torch's Enum-registration warning, printed by
    # each worker importing torchao until the workers installed the CLI's filters (fpemu.framework_logs)
    assert "Failed to load" not in done.stderr and "is an Enum subclass" not in done.stderr, done.stderr
    files = {str(p.relative_to(reports)): p.read_bytes() for p in sorted(reports.rglob("*")) if p.is_file()}
    return done.returncode, done.stdout, files


def assert_runs_write_the_same(tmp_path, monkeypatch, first: tuple, second: tuple, specs=RUN_SPECS) -> None:
    """`fpemu run` of ``specs`` with the options ``first`` and with ``second`` print, exit and write the same."""
    import pathlib
    import shutil
    root = pathlib.Path(__file__).resolve().parent.parent
    (tmp_path / "specs").mkdir()
    for name in specs:
        shutil.copy(root / "specs" / name, tmp_path / "specs" / name)
    monkeypatch.chdir(root)
    one, two = _run_files(tmp_path, *first), _run_files(tmp_path, *second)
    assert one[0] == two[0] and one[1] == two[1]
    assert sorted(one[2]) == sorted(two[2]) and len(one[2]) > len(specs)
    assert [name for name in one[2] if one[2][name] != two[2][name]] == []


@pytest.mark.parametrize("specs", [
    pytest.param(["floor_jmp.toml", "optax_consecutive.toml"], id="jmp-and-optax"),  # 4 jobs on 2 workers
    pytest.param(["recipe_torchao_tensorwise.toml", "recipe_torchao_rowwise.toml"], id="torchao",
                 marks=pytest.mark.stage2("the jmp-and-optax run; test_each_worker_drops_the_frameworks_import_noise "
                                          "(torchao's import: 5 s a process)")),
    pytest.param(RUN_SPECS, id="five-scalers-and-paddle", marks=pytest.mark.stage2(
        "the jmp-and-optax run (torch, Keras, flax and Paddle add 15 s of imports)"))])
def test_fpemu_run_on_two_workers_prints_and_writes_what_one_after_another_does(specs, tmp_path, monkeypatch):
    assert_runs_write_the_same(tmp_path, monkeypatch, ("1",), ("2",), specs)


@pytest.mark.parametrize("value, expected", [("local", None), (None, None), ("dask:tcp://10.0.0.5:8786", "tcp://10.0.0.5:8786")])
def test_executor_names_where_the_jobs_run(value, expected):
    assert pool.checked_executor(value) == expected


def test_executor_dask_reads_the_scheduler_address_from_dasks_variable(monkeypatch):
    monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", "tcp://10.0.0.5:8786")
    assert pool.checked_executor("dask") == "tcp://10.0.0.5:8786"
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS")
    with pytest.raises(FpemuInputError, match="--executor 'dask': no scheduler address"):
        pool.checked_executor("dask")


def test_executor_other_than_local_or_dask_is_bad_input():
    with pytest.raises(FpemuInputError, match="--executor 'ray': expected 'local' or 'dask:ADDRESS'"):
        pool.checked_executor("ray")
