"""An exact rational-arithmetic rounding oracle, independent of fpemu's bit kernel."""

import math
from fractions import Fraction

NAN = float("nan")
INF = float("inf")


def round_exact(x: float, fmt, rounding: str = "nearest_even", overflow: str = "inf",
                subnormals: bool = True, u: Fraction = None) -> float:
    """Round the float ``x`` to ``fmt`` with Fractions. ``u`` in [0, 1) drives stochastic rounding."""
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
    a = abs(Fraction(x))
    exponent = math.frexp(abs(x))[1] - 1
    quantum = Fraction(2) ** (max(exponent, fmt.emin) - fmt.mantissa_bits)
    scaled = a / quantum
    low = math.floor(scaled)
    frac = scaled - low
    if rounding == "nearest_even":
        up = frac > Fraction(1, 2) or (frac == Fraction(1, 2) and low % 2 == 1)
    elif rounding == "nearest_away":
        up = frac >= Fraction(1, 2)
    elif rounding == "toward_zero":
        up = False
    elif rounding == "up":
        up = frac != 0 and not negative
    elif rounding == "down":
        up = frac != 0 and negative
    elif rounding == "stochastic":
        up = u < frac
    else:
        raise ValueError(rounding)
    result = (low + up) * quantum
    if result > Fraction(fmt.max_finite):
        saturate = (overflow == "saturate" or rounding == "toward_zero"
                    or (rounding == "up" and negative) or (rounding == "down" and not negative))
        if saturate:
            result = Fraction(fmt.max_finite)
        else:
            return (-INF if negative else INF) if fmt.has_inf else NAN
    if not subnormals and result < Fraction(fmt.min_normal):
        result = Fraction(0)
    if result == 0 and not fmt.has_negative_zero:
        return 0.0
    value = float(result)
    return -value if negative else value
