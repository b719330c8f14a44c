import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# fpemu commands run in-process and in subprocesses here run their jobs one after another (tests of
# --jobs set it themselves): on 2 cores, worker processes beside pytest's would only contend.
os.environ.setdefault("FPEMU_JOBS", "1")
# Some machines run Python with PYTHONDONTWRITEBYTECODE=1 (this project's do): then each of the suite's
# processes (both xdist workers, ~150 `fpemu` subprocesses) compiles fpemu from source (0.3-0.5 s a process idle,
# seconds under load) and pytest rewrites every test module's asserts afresh.  The suite writes bytecode, as Python does by default.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

import hypothesis_budget  # noqa: E402,F401  (registers and loads the hypothesis profiles)

STAGE2 = os.environ.get("FPEMU_TEST_ENVS") == "1"


def pytest_collection_modifyitems(config, items):
    """The default suite stays within minutes on 2 cores: a test marked ``stage2("what covers it")`` runs
    only in CI stage 2 (FPEMU_TEST_ENVS=1), and its skip line names the default test covering its path."""
    if STAGE2:
        return
    for item in items:
        marker = item.get_closest_marker("stage2")
        if marker is not None:
            covered_by = marker.args[0] if marker.args else marker.kwargs["covered_by"]
            item.add_marker(pytest.mark.skip(reason=f"CI stage 2 (FPEMU_TEST_ENVS=1); by default: {covered_by}"))


@pytest.fixture
def torch_one_thread():
    """torch's intra-op pool on a shared 2-core machine makes small ops many times slower; restored after."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
