"""fpemu's compiled quantize loops (``_ckernels.c``), loaded with ctypes when they were built.

The extension is optional: an install without a C compiler has none, and ``FPEMU_COMPILED=0``
turns it off; then :data:`KERNELS` is None and quantize takes the numpy short paths, which stay the
reference the compiled loops are checked against (tests/test_shortcuts.py runs every path).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
from typing import Optional

import numpy as np

DISABLE_ENV = "FPEMU_COMPILED"


def _load() -> Optional[ctypes.CDLL]:
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    spec = importlib.util.find_spec("fpemu.formats._ckernels")
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return None
    try:
        return library(spec.origin)
    except OSError:  # (a build for another platform or Python left in the tree)
        return None


def library(path: str) -> ctypes.CDLL:
    """The compiled loops of the shared object at ``path``, their signatures declared (also for another
    build of _ckernels.c: tests/test_baseline_build.py loads the baseline-only one)."""
    library = ctypes.CDLL(path)
    words = np.ctypeslib.ndpointer(np.uint32, flags="C_CONTIGUOUS")
    library.fpemu_nearest_even.argtypes = [words, words, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                           ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int]
    library.fpemu_leading_bits.argtypes = [words, words, ctypes.c_long, ctypes.c_int, ctypes.c_uint32]
    floats, halves, octets, indices = (np.ctypeslib.ndpointer(dtype, flags="C_CONTIGUOUS")
                                       for dtype in (np.float32, np.uint16, np.uint8, np.int64))
    library.fpemu_mx_elements.argtypes = [floats, halves, floats, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                          ctypes.c_int, ctypes.c_int, ctypes.c_uint16, ctypes.c_uint16, ctypes.c_uint8,
                                          ctypes.c_float, floats, octets]
    library.fpemu_mx_blocks.argtypes = [floats, ctypes.c_long, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint32, ctypes.c_uint16,
                                        ctypes.c_uint16, ctypes.c_uint8, ctypes.c_float, octets, floats, floats, octets,
                                        indices]
    library.fpemu_block_peak.argtypes = [floats, ctypes.c_long, ctypes.c_long, words]
    library.fpemu_e8m0.argtypes = [words, words, ctypes.c_long, ctypes.c_int]
    for function in (library.fpemu_nearest_even, library.fpemu_leading_bits, library.fpemu_mx_elements,
                     library.fpemu_block_peak, library.fpemu_e8m0):
        function.restype = None
    library.fpemu_mx_blocks.restype = ctypes.c_long
    return library


KERNELS = _load()
