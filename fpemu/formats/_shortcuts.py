"""Short quantize paths for float32 inputs whose result needs only a few passes.

:func:`fpemu.quantize` asks :func:`shortcut` first; where it answers None the bit kernel runs.
Each path is bit-identical to the kernel for the cases its descriptor admits: the format digests
cover every mode, ``tests/test_shortcuts.py`` an edge-dense sample of every case,
``benchmarks/exhaustive_shortcuts.py`` all 2**32 float32 inputs (``--edges``: the binades around
each format's range; ``--compiled``: the compiled rows) and ``benchmarks/exhaustive_float32.py``
the default mode against the native casts.  Where fpemu/formats/_ckernels.c was built, a compiled
row (``compiled=True``: the same arithmetic in one C pass) stands before each numpy path below and
is taken first; the numpy path stays its fallback and reference:

* ``fp32`` (float32's own layout): every rounding mode keeps a float32 input; only saturation
  (infinities to +-max) and flush-to-zero change values.  The kernel widened to float64 first.
* ``e8m0`` (unsigned, no zero, powers of two): nearest (ties up: every significand is 1, odd)
  is adding half the exponent's unit to the bit pattern and clearing the mantissa; negative
  inputs, zeros, NaN and what rounds past 2**127 are NaN (or 2**127 when saturating).
* float32's leading bits (tf32: float32's exponent, fewer mantissa bits, IEEE specials): nearest
  even is rounding the bit pattern itself at the last kept bit, the carry crossing binades, into
  the subnormals and to inf; NaN inputs (whose payload could carry to inf) are put back.
* signed formats with a zero and a narrow range (fp16, the fp8, fp6 and fp4 formats), nearest
  even with subnormals: :func:`_nearest_even` in a dozen cache-resident passes, half of them
  in-place multiplies by constants (the kernel's abs, sign restore and overflow select cost more).

A NaN result is a NaN whose sign and payload are unspecified, as everywhere in fpemu (the fp32
path gives the kernel's 0x7FC00000, the e8m0 path all ones for negative inputs).
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Iterator, NamedTuple, Optional

import numpy as np

from fpemu.formats.kernels import KERNELS
from fpemu.formats.format import Format, max_ends_binade, past_max

_F32 = np.dtype(np.float32)
_U32, _I32 = np.uint32, np.int32
_NAN_BITS = _U32(0x7FC00000)
# Elements per pass: a block and its scratch stay in L2 between the passes.
_BLOCK = 1 << 16


class _Shortcut(NamedTuple):
    """A short path: the formats it takes (a predicate on the format's fields), its modes, the function."""
    admits: Callable         # fmt -> bool
    roundings: tuple
    subnormals: tuple        # the subnormals settings it takes
    run: Callable            # (arr, fmt, overflow, subnormals) -> array
    compiled: bool = False   # a _ckernels.c loop (the numpy path after it in the table is its reference)


def _layout_is(layout: tuple) -> Callable:
    return lambda fmt: fmt._layout == layout


def _blocks(source: np.ndarray, out: np.ndarray, scratch_dtype) -> Iterator:
    """``source`` and ``out`` (flat, of one length) in pieces of ``_BLOCK`` elements, each with a scratch
    array of its length: one scratch serves every piece, so each pass over a piece stays in cache."""
    scratch = np.empty(min(_BLOCK, source.size), scratch_dtype)
    for start in range(0, source.size, _BLOCK):
        x = source[start:start + _BLOCK]
        yield x, out[start:start + len(x)], scratch[:len(x)]


def _fp32_identity(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
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
_E8M0_LAYOUT = (8, 0, 127, False, False, 1, False, False)
_NORMAL_LOW = _U32(0x00800000)


def _e8m0_nearest(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
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
    for x, r, s in _blocks(bits, out, _I32):
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


def _leading_bits_admits(fmt: Format) -> bool:
    """Formats whose codes are float32's leading bit patterns (tf32; bf16 takes ml_dtypes' cast)."""
    return (fmt.exponent_bits, fmt.bias, fmt.special, fmt.signed) == (8, 127, "ieee", True) and 1 <= fmt.mantissa_bits < 23


def _leading_bits_nearest(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
    """Nearest even onto float32's leading bits: bits + (2**(drop - 1) - 1) + the last kept bit, the
    dropped bits cleared (the sign rides along: only a NaN's magnitude can carry into it)."""
    drop = _U32(23 - fmt.mantissa_bits)
    half_less_one, keep = _U32((1 << (23 - fmt.mantissa_bits - 1)) - 1), _U32((0xFFFFFFFF << (23 - fmt.mantissa_bits)) & 0xFFFFFFFF)
    flat = arr.reshape(-1)
    bits = flat.view(_U32)
    out = np.empty_like(bits)
    for x, r, u in _blocks(bits, out, _U32):
        np.right_shift(x, drop, out=u)
        np.bitwise_and(u, _U32(1), out=u)
        np.add(x, u, out=r)
        np.add(r, half_less_one, out=r)
        np.bitwise_and(r, keep, out=r)
        peak = x.view(np.float32).max()                         # NaN if the block holds one
        if peak != peak:
            r[np.isnan(x.view(np.float32))] = _NAN_BITS
    values = out.view(np.float32)
    if overflow == "saturate":  # (NaN stays NaN)
        np.clip(values, -fmt.max_finite, fmt.max_finite, out=values)
    return values.reshape(arr.shape)


class _Split(NamedTuple):
    """The constants of :func:`_nearest_even` for one format and overflow mode (cached)."""
    to_y: np.float32                 # 2**-k1: fmt's min normal to float32's
    field_mask: np.uint32            # sign and the low exponent-field bits of y
    to_t: tuple                      # factors taking y's masked value to the magic t
    chain: tuple                     # multipliers after the rounding (grid, overflow, back)
    finish: str                      # "none", "clip", "nan" (fn/fnuz overflow), "inf" (an inf code
                                     # below the binade's top), and "+0" (no -0)
    threshold: Optional[np.float32]  # "nan", "inf": |r| * threshold overflows exactly past max finite
    max_row: Optional[np.ndarray]    # "clip": a block of max finite, and of its negative
    min_row: Optional[np.ndarray]


def _field_bits(fmt: Format) -> int:
    """Exponent-field bits of y kept: enough for fmt's binades and the one above (y's field of
    2**(emax + 1) is emax - emin + 2)."""
    return (fmt.emax - fmt.emin + 2).bit_length()


def _split_admits(fmt: Format) -> bool:
    """Formats :func:`_nearest_even` rounds exactly: signed, with a zero, at least 2 bits narrower
    than float32, with subnormals float32 can hold, and the magic t finite for every kept field
    (its exponent below 2**bits - 1 + emin + 23 - m)."""
    if not (fmt.signed and fmt.has_zero and fmt.mantissa_bits <= 21 and fmt.emin >= -126
            and fmt.emin - fmt.mantissa_bits >= -149):
        return False
    if fmt.has_nan or (fmt.has_inf and not max_ends_binade(fmt)):  # step 5 needs its threshold
        if _overflow_threshold(fmt) is None:
            return False
    return (1 << _field_bits(fmt)) - 1 + fmt.emin + 23 - fmt.mantissa_bits <= 127


def _powers(exponent: int) -> tuple:
    """Power-of-two float32 factors whose product is 2**exponent, each a float32 (up: <= 2**127;
    down: >= 2**-149, a subnormal factor rounds the product once)."""
    factors = []
    while exponent > 127:
        factors.append(np.float32(math.ldexp(1.0, 127)))
        exponent -= 127
    while exponent < -149:
        factors.append(np.float32(math.ldexp(1.0, -149)))
        exponent += 149
    return tuple(factors) + ((np.float32(math.ldexp(1.0, exponent)),) if exponent else ())


def _saturates(fmt: Format, overflow: str) -> bool:
    """Whether values past max finite become it: asked for, or the format has neither inf nor NaN."""
    return overflow == "saturate" or not (fmt.has_inf or fmt.has_nan)


def _overflow_threshold(fmt: Format) -> Optional[np.float32]:
    """A float32 t with |r| * t finite for r up to max finite and infinite from the next value up
    (2**128 over their midpoint), for the formats whose overflow needs one (a NaN past max, or an inf
    code below the top of the binade); None where no float32 does it (max finite near float32's least
    values)."""
    above = past_max(fmt)
    with np.errstate(over="ignore"):
        threshold = np.float32(math.ldexp(1.0, 128) / ((fmt.max_finite + above) / 2))
        exact = (np.isfinite(threshold) and np.isfinite(np.float32(fmt.max_finite) * threshold)
                 and np.isinf(np.float32(above) * threshold))
    return threshold if exact else None


@functools.lru_cache(maxsize=64)
def _split_plan(fmt: Format, overflow: str) -> _Split:
    m, emin, emax = fmt.mantissa_bits, fmt.emin, fmt.emax
    k1 = 126 + emin                                        # y = x * 2**-k1: min normal -> 2**-126
    k2 = 149 + emin - m                                    # fmt's least subnormal -> 2**-149
    drop = 23 - m
    to_t = _powers(k1) + (np.float32(math.ldexp(1.0, drop + 1) - 2),)
    if len(to_t) == 2 and k1 + drop + 1 <= 127:            # one factor where it is a float32
        to_t = (np.float32(math.ldexp(math.ldexp(1.0, drop + 1) - 2, k1)),)
    saturate = _saturates(fmt, overflow)
    threshold = max_row = min_row = None
    if fmt.has_inf and not saturate and max_ends_binade(fmt):
        # up to 2**(127 - emax) times x: 2**(emax + 1), the least overflowing result, to 2**128
        chain, finish = _powers(-k2) + _powers(k2 + 127 - emax) + _powers(emax - 127), "none"
    else:
        chain = _powers(-k2) + _powers(k2)
        if saturate:
            finish = "clip"
            max_row = np.full(_BLOCK, fmt.max_finite, np.float32)
            min_row = -max_row
        else:
            finish, threshold = ("inf" if fmt.has_inf else "nan"), _overflow_threshold(fmt)
    if not fmt.has_negative_zero:
        finish += "+0"
    mask = np.uint32(0x80000000 | (((1 << _field_bits(fmt)) - 1) << 23))
    return _Split(np.float32(math.ldexp(1.0, -k1)), mask, to_t, chain, finish, threshold, max_row, min_row)


def _nearest_even(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
    """Nearest even onto fmt, block by block, in a dozen passes (k1 = 126 + emin, k2 = 149 + emin - m).

    1. y = x * 2**-k1 puts fmt's min normal at float32's: y's exponent field is 0 exactly below it
       (an input just below that y rounds up to min normal takes min normal's quantum, also right).
    2. Masking y to its sign and low exponent-field bits (5 for fp16 and fp8), then scaling by 2**k1 * (2**(24 - m) - 2),
       gives t = +-(2**(e + 24 - m) - 2**(e + 1)) for x in binade e: adding it to x lands in the
       binade whose ulp is fmt's quantum there, ties to even (t is an even multiple of the quantum),
       a crossing into the next binade included; below min normal t is +-0.  Fields past the kept
       bits (x far beyond max, inf, NaN) wrap to smaller finite t: x stays beyond max, inf and NaN stay.
    3. r = t - (t - x): x rounded to fmt's precision (exact subtractions); where t is +-0, x itself,
       signed zeros included.
    4. r * 2**-k2 rounds what is below min normal onto fmt's subnormals in float32's own subnormal
       arithmetic (fmt's quantum there is float32's 2**-149) and leaves the rest exact; then back,
       and for IEEE formats through 2**(127 - emax) times r, where 2**(emax + 1) and above overflow.
    5. The rest: a clip (saturation, finite formats), NaN past max finite (fn, fnuz: r - (p - p)
       with p = r * threshold, inf past max), or inf past max finite where an inf code sits below
       the top of max finite's binade (P3109's layouts: p where it is inf); +0 for -0 where -0 is
       no value (fnuz).

    Step 4 computes with float32 subnormals, which cost nothing extra on the AMD EPYC this was
    measured on; a CPU that takes a slow assist for them (many Intel cores, flush-to-zero off, as
    numpy leaves it) would make this path slower than measured.
    """
    plan = _split_plan(fmt, overflow)
    flat = arr.reshape(-1)
    out = np.empty_like(flat)
    with np.errstate(all="ignore"):
        for x, r, t in _blocks(flat, out, np.float32):
            np.multiply(x, plan.to_y, out=t)
            np.bitwise_and(t.view(_U32), plan.field_mask, out=t.view(_U32))
            for factor in plan.to_t:
                t *= factor
            np.subtract(t, x, out=r)
            np.subtract(t, r, out=r)
            for factor in plan.chain:
                r *= factor
            if plan.finish.startswith("clip"):
                np.minimum(r, plan.max_row[:len(x)], out=r)
                np.maximum(r, plan.min_row[:len(x)], out=r)
            elif plan.finish.startswith("inf"):
                np.multiply(r, plan.threshold, out=t)          # +-inf exactly past max finite
                np.copyto(r, t, where=np.isinf(t))
            elif plan.finish.startswith("nan"):
                np.multiply(r, plan.threshold, out=t)
                np.subtract(t, t, out=t)                       # 0, or NaN past max finite
                if plan.finish.endswith("+0"):
                    np.add(r, t, out=r)                        # (-0 + 0 = +0)
                    continue
                np.subtract(r, t, out=r)                       # (-0 - 0 = -0)
            if plan.finish.endswith("+0"):
                r += np.float32(0)
    return out.reshape(arr.shape)


def _compiled_nearest_even_admits(fmt: Format) -> bool:
    """Formats fpemu_nearest_even (_ckernels.c) rounds exactly: signed, with a zero, at least one bit
    narrower than float32, min normal and least subnormal float32 normals and subnormals, and its
    magic t = 2**(emax + 24 - m) for the binade above max a finite float32."""
    return (fmt.signed and fmt.has_zero and fmt.mantissa_bits <= 22 and fmt.emin >= -126
            and fmt.emin - fmt.mantissa_bits >= -149 and fmt.emax - fmt.mantissa_bits <= 103)


def _one_pass(arr: np.ndarray, loop, *arguments) -> np.ndarray:
    """A compiled loop (float32 bits in, float32 bits out) over ``arr``: the result in arr's shape."""
    bits = np.ascontiguousarray(arr).reshape(-1).view(_U32)
    out = np.empty_like(bits)
    loop(bits, out, bits.size, *arguments)
    return out.view(np.float32).reshape(arr.shape)


def _compiled_nearest_even(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
    """:func:`_nearest_even`'s result in one compiled pass (fpemu_nearest_even)."""
    max_bits = int(np.float32(fmt.max_finite).view(_U32))
    past_max = max_bits if _saturates(fmt, overflow) else (0x7F800000 if fmt.has_inf else int(_NAN_BITS))
    return _one_pass(arr, KERNELS.fpemu_nearest_even, fmt.mantissa_bits, fmt.emin, fmt.emax, max_bits, past_max,
                     int(not fmt.has_negative_zero))


def _compiled_e8m0(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
    """:func:`_e8m0_nearest`'s result (its bits too) in one compiled pass (fpemu_e8m0)."""
    return _one_pass(arr, KERNELS.fpemu_e8m0, int(overflow == "saturate"))


def _compiled_leading_bits(arr: np.ndarray, fmt: Format, overflow: str, subnormals: bool) -> np.ndarray:
    """:func:`_leading_bits_nearest`'s result in one compiled pass (fpemu_leading_bits)."""
    saturate_bits = int(np.float32(fmt.max_finite).view(_U32)) if overflow == "saturate" else 0
    return _one_pass(arr, KERNELS.fpemu_leading_bits, 23 - fmt.mantissa_bits, saturate_bits)


_PATHS = (
    _Shortcut(_layout_is((8, 23, 127, True, True, (1 << 23) - 1, False, True)), (
        "nearest_even", "nearest_away", "toward_zero", "up", "down", "stochastic"), (True, False),
        _fp32_identity),
    _Shortcut(_layout_is(_E8M0_LAYOUT), ("nearest_even",), (True, False), _compiled_e8m0, compiled=True),
    _Shortcut(_layout_is(_E8M0_LAYOUT), ("nearest_even",), (True, False), _e8m0_nearest),
    _Shortcut(_compiled_nearest_even_admits, ("nearest_even",), (True,), _compiled_nearest_even, compiled=True),
    _Shortcut(_split_admits, ("nearest_even",), (True,), _nearest_even),
    _Shortcut(_leading_bits_admits, ("nearest_even",), (True,), _compiled_leading_bits, compiled=True),
    _Shortcut(_leading_bits_admits, ("nearest_even",), (True,), _leading_bits_nearest),
)
# The paths this install has: the compiled rows only where _ckernels.c was built (and not turned off).
_SHORTCUTS = tuple(path for path in _PATHS if KERNELS is not None or not path.compiled)


def paths(fmt: Format, rounding: str, subnormals: bool) -> list:
    """The short paths that take ``fmt`` in this mode, in the order :func:`shortcut` tries them."""
    return [path for path in _SHORTCUTS
            if rounding in path.roundings and subnormals in path.subnormals and path.admits(fmt)]


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
    found = paths(fmt, rounding, subnormals)
    return found[0].run(arr, fmt, overflow, subnormals) if found else None
