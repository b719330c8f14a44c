"""The compiled loops' baseline build (no AVX2 clone: what a CPU without AVX2 loads) through the tests of
the loops: every short path against the bit kernel, the block pass against each rule's own arithmetic,
the format digests.  Stage 2 of .ci/run (FPEMU_TEST_ENVS=1): it compiles _ckernels.c and runs a pytest."""

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

import fpemu.formats.kernels as compiled

SOURCE = pathlib.Path(compiled.__file__).with_name("_ckernels.c")
TESTS = ["tests/test_shortcuts.py", "tests/test_blocks.py", "tests/test_format_fields.py"]


@pytest.mark.stage2("compiles the loops and runs their tests; the installed build's loops in the same tests")
def test_the_baseline_build_passes_the_compiled_loops_tests(tmp_path):
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None or compiled.KERNELS is None:
        pytest.skip(f"no C compiler ({compiler}) or no installed build of the loops to compare with")
    built = tmp_path / "baseline.so"
    subprocess.run([compiler, "-O3", "-fwrapv", "-ffp-contract=off", "-fPIC", "-shared", "-DFPEMU_BASELINE",
                    f"-I{sysconfig.get_paths()['include']}", str(SOURCE), "-o", str(built)], check=True)
    assert b".avx2" not in built.read_bytes()  # (the clones' symbols: this build has none)
    root = pathlib.Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "baseline_loops", "-p", "no:cacheprovider",
                           # (torch's log2 on its CPU tiers: torch's kernels, not the loops; two are stage 2's)
                           "-k", "not test_floor_and_ceil_log2_are_torchs_on_every_tier", *TESTS], cwd=root, capture_output=True, text=True,
                          env={**os.environ, "FPEMU_BASELINE_LOOPS": str(built), "FPEMU_TEST_ENVS": "0",
                               "PYTHONPATH": str(root / "tests")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout.splitlines()[-1], done.stdout[-500:]
