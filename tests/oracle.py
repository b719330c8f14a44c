"""An exact rational-arithmetic rounding oracle, independent of fpemu's bit kernel.

Every value is an integer ratio: x as ``x.as_integer_ratio()``, fmt's quantum at x as a power of two,
so each comparison is one of Python integers (exact, and several times faster than Fractions)."""

import functools
import math
from fractions import Fraction
from typing import NamedTuple

NAN = float("nan")
INF = float("inf")


def round_exact(x: float, fmt, rounding: str = "nearest_even", overflow: str = "inf",
                subnormals: bool = True, u: Fraction = None, resolution: int = None) -> float:
    """Round the float ``x`` to ``fmt`` exactly.

    ``u`` in [0, 1) drives stochastic rounding: up when u is below the discarded fraction, that
    fraction truncated to ``resolution`` bits where given (fpemu compares 32 random bits with it).
    """
    fmt = _facts(fmt)
    if not (fmt.has_inf or fmt.has_nan):
        overflow = "saturate"  # nothing but max finite lies beyond it (ml_dtypes' float6/float4)
    if math.isnan(x):
        return NAN
    if (x < 0 and not fmt.signed) or (x == 0 and not fmt.has_zero):
        return NAN  # no code holds it (ml_dtypes' float8_e8m0fnu)
    if not fmt.signed:
        x = abs(x)  # -0 in an unsigned format with a zero
    if not fmt.has_zero and abs(x) < fmt.min_normal:
        return math.copysign(fmt.min_normal, x)  # the only value beyond it, in every mode
    if math.isinf(x):
        if overflow == "saturate":
            return math.copysign(fmt.max_finite, x)
        return x if fmt.has_inf else NAN
    if x == 0:
        return x if fmt.has_negative_zero else 0.0
    negative = x < 0
    # |x| / quantum = numerator / scale, the quantum 2**shift
    numerator, scale = abs(x).as_integer_ratio()
    shift = max(math.frexp(abs(x))[1] - 1, fmt.emin) - fmt.mantissa_bits
    if shift >= 0:
        scale <<= shift
    else:
        numerator <<= -shift
    low, rest = divmod(numerator, scale)  # the discarded fraction is rest / scale
    if rounding == "nearest_even":
        up = 2 * rest > scale or (2 * rest == scale and low % 2 == 1)
    elif rounding == "nearest_away":
        up = 2 * rest >= scale
    elif rounding == "toward_zero":
        up = False
    elif rounding == "up":
        up = rest != 0 and not negative
    elif rounding == "down":
        up = rest != 0 and negative
    elif rounding == "stochastic":
        if resolution is not None:
            rest, scale = (rest << resolution) // scale, 1 << resolution
        up = u.numerator * scale < rest * u.denominator
    else:
        raise ValueError(rounding)
    steps = low + up  # the result is steps * 2**shift
    if _compare(steps, shift, fmt.max_finite) > 0:
        saturate = (overflow == "saturate" or rounding == "toward_zero"
                    or (rounding == "up" and negative) or (rounding == "down" and not negative))
        if not saturate:
            return (-INF if negative else INF) if fmt.has_inf else NAN
        numerator, denominator = fmt.max_finite.as_integer_ratio()
        steps, shift = numerator, 1 - denominator.bit_length()  # (the denominator is a power of two)
    if not subnormals and _compare(steps, shift, fmt.min_normal) < 0:
        steps = 0
    if steps == 0 and not fmt.has_negative_zero:
        return 0.0
    value = math.ldexp(steps, shift)  # exact: at most max finite, at least fmt's quantum
    return -value if negative else value


def _compare(steps: int, shift: int, limit: float) -> int:
    """The sign of steps * 2**shift - limit, exactly."""
    numerator, denominator = limit.as_integer_ratio()
    left, right = steps * denominator, numerator
    if shift >= 0:
        left <<= shift
    else:
        right <<= -shift
    return (left > right) - (left < right)


class _Facts(NamedTuple):
    """What the oracle reads of a format, read once (Format's derived properties are computed per access)."""
    signed: bool
    has_zero: bool
    has_inf: bool
    has_nan: bool
    has_negative_zero: bool
    emin: int
    mantissa_bits: int
    min_normal: float
    max_finite: float


@functools.lru_cache(maxsize=None)
def _facts(fmt) -> _Facts:
    return _Facts(*(getattr(fmt, name) for name in _Facts._fields))
