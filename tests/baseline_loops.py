"""pytest plugin (``-p baseline_loops``): fpemu's compiled loops from the library that FPEMU_BASELINE_LOOPS
names, in place of the installed build, for tests/test_baseline_build.py."""

import os


def pytest_configure(config):
    import fpemu.blocks.quantize as quantize
    import fpemu.formats.kernels as compiled
    import fpemu.formats._shortcuts as shortcuts
    compiled.KERNELS = shortcuts.KERNELS = quantize.KERNELS = compiled.library(os.environ["FPEMU_BASELINE_LOOPS"])
