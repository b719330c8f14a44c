import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# fpemu commands run in-process and in subprocesses here run their jobs one after another (tests of
# --jobs set it themselves): on 2 cores, worker processes beside pytest's would only contend.
os.environ.setdefault("FPEMU_JOBS", "1")

import hypothesis_budget  # noqa: E402,F401  (registers and loads the hypothesis profiles)


@pytest.fixture
def torch_one_thread():
    """torch's intra-op pool on a shared 2-core machine makes small ops many times slower; restored after."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
