"""NVIDIA's own float32 -> fp4 e2m1 and -> e4m3 (satfinite) conversions, run on the CPU.

The CUDA toolkit's headers ``cuda_fp4.hpp`` and ``cuda_fp8.hpp`` define ``__nv_cvt_float_to_fp4``
and ``__nv_cvt_float_to_fp8`` for host and device: on a device with the instruction they issue
``cvt.rn.satfinite.e2m1x2.f32`` (and the e4m3 cvt), elsewhere, host code included, NVIDIA's
emulation of it in C.  Transformer Engine's NVFP4 kernel converts its block scales with the fp8 one
(``static_cast<fp8e4m3>``, satfinite) and its elements with the instruction, which TE cannot run
here (no Blackwell GPU): so the emulation, NVIDIA's statement of what the instruction does, is what
:func:`cuda_cast_codes` runs, compiled with the host C++ compiler against the toolkit's headers
(``CUDA_HOME``, default ``/usr/local/cuda``).  It says, for instance, what neither TE nor the PTX
text here does: NaN converts to +6 in fp4 (code 0x7) and to 0x7F in fp8, its sign dropped.
"""

from __future__ import annotations

import atexit
import functools
import os
import pathlib
import shutil
import subprocess
import tempfile

import numpy as np

CUDA_HOME_ENV = "CUDA_HOME"
# fpemu's format -> NVIDIA's conversion of a float x to it (round to nearest; fp8 satfinite, as TE's casts).
_CASTS = {"fp4_e2m1fn": "__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)",
          "fp8_e4m3fn": "__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)",
          "fp8_e5m2": "__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E5M2)",
          # (cvt.rp.satfinite.ue8m0x2.f32: TE's float_to_e8m0 on Blackwell)
          "e8m0": "__nv_cvt_float_to_e8m0(x, __NV_SATFINITE, cudaRoundPosInf)"}
_PROGRAM = """#include <cstdio>
#include <cstdlib>
#include <cuda_fp4.h>
#include <cuda_fp8.h>
// float32 values on stdin, one code byte per value on stdout; argv[1] is the index of the conversion.
static unsigned char convert(int which, float x) {
%s  return 0;
}
int main(int argc, char **argv) {
  const int which = argc > 1 ? std::atoi(argv[1]) : 0;
  float x;
  while (std::fread(&x, sizeof x, 1, stdin) == 1) std::fputc(convert(which, x), stdout);
  return 0;
}
""" % "".join(f"  if (which == {i}) return (unsigned char)({cast});\n" for i, cast in enumerate(_CASTS.values()))


def _include_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get(CUDA_HOME_ENV) or "/usr/local/cuda") / "include"


def cuda_casts_unavailable():
    """Why NVIDIA's conversions cannot be compiled here (None when they can)."""
    if not (_include_dir() / "cuda_fp4.hpp").is_file():
        return f"no CUDA toolkit headers (cuda_fp4.hpp) in {_include_dir()} (set {CUDA_HOME_ENV})"
    if shutil.which("c++") is None:
        return "no host C++ compiler (c++) to build NVIDIA's conversions with"
    return None


@functools.lru_cache(maxsize=None)
def _program() -> str:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="fpemu-cuda-casts-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    source, binary = folder / "casts.cpp", folder / "casts"
    source.write_text(_PROGRAM, encoding="utf-8")
    subprocess.run(["c++", "-O1", "-std=c++17", f"-I{_include_dir()}", str(source), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    return str(binary)


def cuda_cast_codes(x, element_format: str) -> np.ndarray:
    """The codes NVIDIA's conversion gives float32 ``x`` (any shape, a uint8 per value): ``"fp4_e2m1fn"``
    (``__nv_cvt_float_to_fp4``, round to nearest), ``"fp8_e4m3fn"`` or ``"fp8_e5m2"``
    (``__nv_cvt_float_to_fp8``, satfinite), or ``"e8m0"`` (``__nv_cvt_float_to_e8m0``, rounded up,
    satfinite).

    Example:
      >>> cuda_cast_codes([float("nan"), -0.0, 5.5], "fp4_e2m1fn").tolist()  # doctest: +SKIP
      [7, 8, 7]
    """
    if element_format not in _CASTS:
        raise ValueError(f"element_format must be one of {sorted(_CASTS)}, got {element_format!r}")
    data = np.ascontiguousarray(x, dtype=np.float32)
    which = str(list(_CASTS).index(element_format))
    out = subprocess.run([_program(), which], input=data.tobytes(), capture_output=True, check=True).stdout
    return np.frombuffer(out, np.uint8).reshape(data.shape)
