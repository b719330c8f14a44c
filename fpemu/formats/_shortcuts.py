"""Short quantize paths for float32 inputs whose result needs only a few passes.

:func:`fpemu.quantize` asks :func:`shortcut` first; where it answers None the bit kernel runs.
Each path is bit-identical to the kernel for the cases its descriptor admits (the exhaustive
check ``benchmarks/exhaustive_shortcuts.py`` compares them on all 2**32 float32 inputs, and the
format digests cover every mode):

* ``fp32`` (float32's own layout): every rounding mode keeps a float32 input; only saturation
  (infinities to +-max) and flush-to-zero change values.  The kernel widened to float64 first.
* ``e8m0`` (unsigned, no zero, powers of two): nearest (ties up: every significand is 1, odd)
  is adding half the exponent's unit to the bit pattern and clearing the mantissa; negative
  inputs, zeros, NaN and what rounds past 2**127 are NaN (or 2**127 when saturating).

A NaN result is a NaN whose sign and payload are unspecified, as everywhere in fpemu (the fp32
path gives the kernel's 0x7FC00000, the e8m0 path all ones for negative inputs).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

from fpemu.formats.format import Format

_F32 = np.dtype(np.float32)
_U32, _I32 = np.uint32, np.int32
_NAN_BITS = _U32(0x7FC00000)
# Elements per pass: a block and its scratch stay in L2 between the passes.
_BLOCK = 1 << 16


class _Shortcut(NamedTuple):
    """A short path: the format fields it needs, the modes it takes, the function."""
    layout: tuple            # Format._layout (exponent, mantissa, bias, signed, inf, NaN codes, -0 NaN, zero)
    roundings: tuple
    run: Callable


def _fp32_identity(arr: np.ndarray, overflow: str, subnormals: bool) -> np.ndarray:
    """float32 onto float32's layout: the values stay; NaN becomes the canonical NaN."""
    out = arr.copy()
    with np.errstate(invalid="ignore"):
        if overflow == "saturate":
            np.clip(out, -np.finfo(np.float32).max, np.finfo(np.float32).max, out=out)
        if not subnormals:
            tiny = np.abs(out) < np.finfo(np.float32).tiny
            out[tiny] = np.copysign(np.float32(0), out[tiny])
        peak = out.max() if out.size else out.dtype.type(0)   # NaN if any element is NaN
    if peak != peak:
        out[np.isnan(out)] = np.float32(np.nan)
    return out


# e8m0 in float32 bits: its least value 2**-127 (a float32 subnormal), its greatest 2**127, and the
# least input that rounds past it, 1.5 * 2**127.
_E8M0_LEAST, _E8M0_GREATEST, _E8M0_PAST = _U32(0x00400000), _U32(0x7F000000), _U32(0x7F400000)
_HALF_UNIT, _EXPONENT_AND_SIGN = _U32(0x00400000), _U32(0xFF800000)
_NORMAL_LOW = _U32(0x00800000)


def _e8m0_nearest(arr: np.ndarray, overflow: str, subnormals: bool) -> np.ndarray:
    """float32 to e8m0, nearest with ties up, as the kernel rounds it.

    Positive normal inputs: bits + 2**22 carries into the exponent exactly when the significand
    is at least 1.5, and clearing the mantissa leaves the power of two.  Negative inputs: their
    sign bit, spread over the word by an arithmetic shift, ORed in, makes every bit set: a NaN.
    Blocks holding the rest (zeros, float32 subnormals, NaN, inf, past 1.5 * 2**127; found by one
    unsigned min and one signed max) are redone with np.where.
    """
    flat = arr.reshape(-1)
    bits = flat.view(_U32)
    out = np.empty_like(bits)
    sign = np.empty(min(_BLOCK, bits.size), _I32)
    for start in range(0, bits.size, _BLOCK):
        x = bits[start:start + _BLOCK]
        r, s = out[start:start + len(x)], sign[:len(x)]
        np.add(x, _HALF_UNIT, out=r)
        np.bitwise_and(r, _EXPONENT_AND_SIGN, out=r)
        np.right_shift(x.view(_I32), _I32(31), out=s)
        np.bitwise_or(r, s.view(_U32), out=r)
        if x.min() < _NORMAL_LOW or x.view(_I32).max() >= _I32(_E8M0_PAST):
            r[...] = _e8m0_edges(x, r, overflow)
    return out.view(np.float32).reshape(arr.shape)


def _e8m0_edges(x: np.ndarray, r: np.ndarray, overflow: str) -> np.ndarray:
    """Block r with the edge inputs' results: zeros and NaN to NaN, below 1.5 * 2**-127 to 2**-127,
    float32's other subnormals to 2**-126, and past 1.5 * 2**127 (inf included) to NaN or 2**127."""
    positive = x < _U32(0x80000000)
    r = np.where(positive & (x < _U32(0x00600000)), _E8M0_LEAST, r)
    r = np.where(positive & (x >= _U32(0x00600000)) & (x < _NORMAL_LOW), _NORMAL_LOW, r)
    past = positive & (x >= _E8M0_PAST)
    beyond = _E8M0_GREATEST if overflow == "saturate" else _NAN_BITS
    r = np.where(past & (x <= _U32(0x7F800000)), beyond, r)
    return np.where(((x > _U32(0x7F800000)) & positive) | (x == 0), _NAN_BITS, r)  # NaN, +0 (-0: its sign)


_SHORTCUTS = (
    _Shortcut((8, 23, 127, True, True, (1 << 23) - 1, False, True), (
        "nearest_even", "nearest_away", "toward_zero", "up", "down", "stochastic"), _fp32_identity),
    _Shortcut((8, 0, 127, False, False, 1, False, False), ("nearest_even",), _e8m0_nearest),
)


def shortcut(arr: np.ndarray, fmt: Format, rounding: str, overflow: str,
             subnormals: bool) -> Optional[np.ndarray]:
    """quantize's result by a short path, or None where none applies (then the kernel runs).

    Args:
      arr: the input array (only float32 inputs have short paths).
      fmt, rounding, overflow, subnormals: as :func:`fpemu.quantize` takes them, checked.

    Example:
      >>> from fpemu.formats import get_format
      >>> shortcut(np.array([3.0, -1.0], np.float32), get_format("e8m0"), "nearest_even", "inf", True)
      array([ 4., nan], dtype=float32)
    """
    if arr.dtype != _F32:
        return None
    for path in _SHORTCUTS:
        if fmt._layout == path.layout and rounding in path.roundings:
            return path.run(arr, overflow, subnormals)
    return None
