"""floor and ceil of log2 as torch computes them in float32, bf16, float16 or float64, exactly, from the bits.

torch's CPU ``log2`` (float32 on every ATen tier: AVX512, AVX2, default; bf16 and float16 through
float32, rounded back) gives the correctly rounded result at and around every power of two, so
``floor(log2(x))`` is x's exact exponent except for the few x just below a power of two 2**k whose
log2, k - d, rounds up to k (d under half the ulp of log2's type next to k), and ``ceil(log2(x))``
likewise for the few just above.  numpy's float32 log2 is no model of it: its SIMD tiers are
separate code.  Here the exponent comes from frexp (exact) and those neighbours from integer bit
patterns: how many there are is decided once per spacing and ulp in rational arithmetic
(:func:`_rounds_onto`), with no floating-point log2.  Checked against torch 2.13 (this CPU: AVX512)
on every positive finite float32 once (2,139,095,039 patterns, its AVX512 and AVX2 tiers) and in
tests/test_blocks.py on its three tiers: float32 next to every power of two and a sweep, every bf16
and float16, float64 next to every power of two.

Example:
  >>> x = np.float32(2.0**20) - np.float32(2.0**-4)        # 2**20 less one ulp: log2 rounds to 20
  >>> floor_log2(x).item(), ceil_log2(np.float32(2.0**20) + np.float32(2.0**-3)).item()
  (20.0, 20.0)
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

import ml_dtypes
import numpy as np

# ln 2 to 40 digits, and a bound on the error of that decimal.
_LN2 = Fraction("0.6931471805599453094172321214581765680755")
_LN2_ERROR = Fraction(1, 10**40)


@dataclasses.dataclass(frozen=True)
class _Type:
    """A binary float type: significant bits, the least and the first unrepresentable power of two."""

    precision: int
    lowest: int
    beyond: int
    bits: type


_TYPES = {np.dtype(np.float32): _Type(24, -149, 128, np.uint32),
          np.dtype(ml_dtypes.bfloat16): _Type(8, -133, 128, np.uint16),
          np.dtype(np.float16): _Type(11, -24, 16, np.uint16),
          np.dtype(np.float64): _Type(53, -1074, 1024, np.uint64)}


def _bounds(t: Fraction, above: bool, terms: int) -> tuple:
    """Rational bounds on ln(1 + t) (above) or -ln(1 - t) (below), 0 < t < 1, from their series' first terms."""
    if above:  # t - t**2/2 + t**3/3 ...: alternating, falling terms, so the next term bounds the rest
        total = sum((-1) ** (n + 1) * t**n / n for n in range(1, terms + 1))
        step = t ** (terms + 1) / (terms + 1)
        return (total, total + step) if terms % 2 == 0 else (total - step, total)
    total = sum(t**n / n for n in range(1, terms + 1))  # t + t**2/2 + ...: the rest is under a geometric tail
    return total, total + t ** (terms + 1) / ((terms + 1) * (1 - t))


def _less(t: Fraction, above: bool, half_ulp: Fraction) -> bool:
    """Whether |log2(1 +- t)| < half_ulp, decided in rationals: |ln(1 +- t)| against half_ulp * ln 2."""
    low, high = (half_ulp * (_LN2 - _LN2_ERROR), half_ulp * (_LN2 + _LN2_ERROR))
    terms = 4
    while True:
        below, over = _bounds(t, above, terms)
        if over < low:
            return True
        if below > high:
            return False
        terms *= 2


@functools.lru_cache(maxsize=None)
def _rounds_onto(spacing_bits: int, ulp_exponent: int, above: bool) -> int:
    """How many x = 2**k * (1 +- j * 2**-spacing_bits), j = 1, 2, ..., have a log2 within half of
    2**ulp_exponent of k (so it rounds onto k): log2 next to k is monotone, so the first that does not ends them."""
    half_ulp = Fraction(2) ** (ulp_exponent - 1)
    count = 0
    while _less(Fraction(count + 1, 2**spacing_bits), above, half_ulp):
        count += 1
    return count


def _ulp_exponent(side: int, kind: _Type) -> int:
    """The exponent of the type's ulp in the binade of the positive int ``side`` (0: |log2| just below 1)."""
    return side.bit_length() - 1 - (kind.precision - 1)


@functools.lru_cache(maxsize=None)
def _tables(dtype: np.dtype) -> tuple:
    """Per k from the type's least power of two to its first unrepresentable one: the bits of 2**k (that
    of inf for the last), and how many values just below / just above it have a log2 that rounds to k."""
    kind = _TYPES[dtype]
    powers, below, above = [], [], []
    for k in range(kind.lowest, kind.beyond + 1):
        power = np.ldexp(np.float64(1), k).astype(dtype) if k < kind.beyond else np.array(np.inf, dtype)
        powers.append(int(power.view(kind.bits)))
        if k == 0:  # log2 next to 1 is d itself, never rounded to 0
            below.append(0)
            above.append(0)
            continue
        # integers in the binade of |log2| just below and just above k (|k - d|, |k + d|): it sets log2's
        # ulp there; x's spacing next to 2**k is 2**k * 2**-precision below, half that above, 2**lowest
        # among the subnormals
        low_side, high_side = (k - 1, k) if k > 0 else (-k, -k - 1)
        below.append(_rounds_onto(min(kind.precision, k - kind.lowest), _ulp_exponent(low_side, kind), False)
                     if k > kind.lowest else 0)
        above.append(_rounds_onto(min(kind.precision - 1, k - kind.lowest), _ulp_exponent(high_side, kind), True)
                     if k < kind.beyond else 0)
    return kind, np.array(powers, kind.bits), np.array(below, kind.bits), np.array(above, kind.bits)


def _parts(x):
    """x, its type's tables, where x is positive and finite, and there: its bits, the exact floor of its log2
    less the least power of two, and whether it is a power of two (elsewhere: those of 1)."""
    x = np.asarray(x)
    if x.dtype not in _TYPES:
        raise TypeError(f"x: log2 is modelled for {', '.join(str(d) for d in _TYPES)}, got dtype {x.dtype}")
    tables = _tables(x.dtype)
    kind = tables[0]
    positive = np.isfinite(x) & (x > 0)
    every = positive.all()
    safe = x if every else np.where(positive, x, np.ones((), x.dtype))
    mantissa, exponent = np.frexp(safe.astype(np.float32) if x.dtype.itemsize < 4 else safe)
    exponent -= 1 + kind.lowest
    return x, (None if every else positive), safe.view(kind.bits), exponent, mantissa == 0.5, tables


def _specials(x, positive, finite_result) -> np.ndarray:
    """log2 then floor or ceil on the rest: -inf for 0, inf for inf, NaN for negatives and NaN."""
    result = finite_result.astype(x.dtype)
    if positive is None:
        return result
    special = np.where(x == 0, -np.inf, np.where(x == np.inf, np.inf, np.nan))
    return np.where(positive, result, special.astype(x.dtype))


def floor_log2(x) -> np.ndarray:
    """floor(log2(x)) as torch computes it in x's type (float32, bf16, float16 or float64; result in that type)."""
    x, positive, bits, at, _, (kind, powers, below, _) = _parts(x)
    rounds_up = bits >= powers[at + 1] - below[at + 1]
    return _specials(x, positive, (at + kind.lowest) + rounds_up)


def ceil_log2(x) -> np.ndarray:
    """ceil(log2(x)) as torch computes it in x's type (float32, bf16, float16 or float64; result in that type)."""
    x, positive, bits, at, power, (kind, powers, _, above) = _parts(x)
    stays = power | (bits <= powers[at] + above[at])
    return _specials(x, positive, (at + kind.lowest) + ~stays)
