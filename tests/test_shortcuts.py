"""quantize's short paths (fpemu/formats/_shortcuts.py) give the bit kernel's results.

The all-inputs proof is benchmarks/exhaustive_shortcuts.py (every float32 pattern, or with --edges
every pattern of the binades around each format's range); here every case meets a sample dense in
edges: every float32 binade with its end and tie mantissas and random ones, both signs.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

import fpemu
from fpemu.formats.kernels import DISABLE_ENV, KERNELS
from fpemu.formats._shortcuts import _SHORTCUTS, paths
from fpemu.formats.rounding import _round_array
from test_formats import same_bits

# every path that takes a format (the compiled loops where they were built, and the numpy paths
# after them, which quantize takes without them), each run directly
CASES = [(path.run.__name__, name, overflow, subnormals) for name in fpemu.format_names()
         for path in _SHORTCUTS if path.admits(fpemu.get_format(name))
         for overflow in fpemu.OVERFLOW_MODES for subnormals in path.subnormals]
_RUNS = {path.run.__name__: path.run for path in _SHORTCUTS}


def _edge_sample() -> np.ndarray:
    """Every sign and exponent field with mantissas 0, 1, all ones, every single set bit, every
    'half' pattern (one bit set and all below it clear or set), each of the 64 leading 6-bit
    patterns followed by a tie (10...0), just below it and just above it (the ties of every
    format with up to 5 mantissa bits), the same after 64 random leading 11-bit patterns (fp16's
    ties), and 64 random mantissas."""
    rng = np.random.default_rng(3)
    singles = [1 << b for b in range(23)]
    halves = [(1 << b) - 1 for b in range(1, 24)] + [(1 << b) | ((1 << b) - 1) for b in range(23)]
    ties = []
    for kept, heads in ((6, range(64)), (11, rng.integers(0, 1 << 11, 64))):
        for head in heads:
            for tail in range(kept, 24 - 1):  # the tie one bit below any of the kept bits
                tie = (int(head) >> (kept - min(kept, 23 - tail)) << tail) | (1 << (tail - 1))
                ties += [tie - 1, tie, tie + 1]
    mantissas = np.unique(np.array([0, 1, (1 << 23) - 1, *singles, *halves, *ties,
                                    *((1 << b) + 1 for b in range(23)), *((1 << b) - 2 for b in range(2, 24)),
                                    *rng.integers(0, 1 << 23, 64)], np.uint64) & np.uint64((1 << 23) - 1))
    heads = np.arange(512, dtype=np.uint64) << np.uint64(23)
    return (heads[:, None] | mantissas[None, :]).astype(np.uint32).reshape(-1).view(np.float32)


SAMPLE = _edge_sample()


@pytest.mark.parametrize("path, name, overflow, subnormals", CASES)
def test_short_path_gives_the_kernels_result(path, name, overflow, subnormals):
    fmt = fpemu.get_format(name)
    with np.errstate(all="ignore"):
        short = _RUNS[path](SAMPLE, fmt, overflow, subnormals)
        kernel = _round_array(SAMPLE, fmt, "nearest_even", overflow, subnormals, None, flags=False).values
    assert short is not None
    assert same_bits(short, kernel), SAMPLE[(short.view(np.uint32) != kernel.view(np.uint32))
                                            & ~(np.isnan(short) & np.isnan(kernel))][:5]


@pytest.mark.parametrize("name", sorted({case[1] for case in CASES}))
def test_short_paths_keep_shapes_and_take_any_layout(name):
    x = SAMPLE[:6000].reshape(30, 200)
    with np.errstate(all="ignore"):
        for arr in (x, x.T, x[::3, 1::7], np.float32(1.375), np.empty((0, 4), np.float32)):
            ours = fpemu.quantize(arr, name)
            kernel = _round_array(np.array(arr), fpemu.get_format(name), "nearest_even", "inf", True,
                                  None, flags=False).values
            assert ours.shape == np.shape(arr) and ours.dtype == np.float32
            assert same_bits(ours, kernel)


def test_short_paths_cover_every_named_format_but_bf16():
    """(bf16 in the default mode is ml_dtypes' cast, ahead of the short paths; its saturating mode
    takes the leading-bits path.)"""
    assert {case[1] for case in CASES} == set(fpemu.format_names())


def test_the_compiled_loops_take_the_narrow_formats_where_they_were_built():
    if KERNELS is None:
        pytest.skip("fpemu's compiled loops (fpemu/formats/_ckernels.c) were not built here or FPEMU_COMPILED=0")
    compiled = {name for name in fpemu.format_names()
                if any(p.compiled for p in paths(fpemu.get_format(name), "nearest_even", True)[:1])}
    assert compiled == {"tf32", "fp16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz", "fp8_e4m3",
                        "fp8_e3m4", "fp8_e4m3b11fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn", "bf16", "e8m0"}


def test_without_the_compiled_loops_quantize_takes_the_numpy_paths():
    code = ("import numpy as np, fpemu; from fpemu.formats.kernels import KERNELS; "
            "from fpemu.formats._shortcuts import paths; assert KERNELS is None; "
            "assert not any(p.compiled for p in paths(fpemu.get_format('fp8_e4m3fn'), 'nearest_even', True)); "
            "print(fpemu.quantize(np.float32([465.0, -1e-30, 3.0]), 'fp8_e4m3fn').tolist())")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, DISABLE_ENV: "0"},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[nan, -0.0, 3.0]"
