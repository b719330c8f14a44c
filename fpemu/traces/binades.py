"""Float32 magnitudes histogrammed by binade and mantissa run, so rounding into any format at any
power-of-two scale can be counted afterwards, exactly.

Rounding a float32 magnitude ``x`` to a format (nearest even) makes it zero exactly when
``x <= zero_at_most`` and subnormal exactly when, above that, ``x < normal_from``
(:func:`fpemu.traces.recorded.format_thresholds`).  For every fpemu format ``zero_at_most`` is a
power of two (half the smallest subnormal) and ``normal_from`` a tie point: the top of a binade
less half an ulp, a float32 whose fraction (the 23 bits below the leading one) is ``k`` ones and
then zeros.  At a scale ``2**s`` the edges move by ``2**-s`` and keep those fractions.  So per binade
it is enough to know how many values have a fraction that is 0 (exact powers of two) and how many
have a fraction starting with exactly ``k`` ones (``k`` = 0..23): from those, the count below any
power of two or tie point is exact, and the count below any other float32 lies between the counts
at the nearest such points (the bounds :func:`count_below` returns).

Each value gets one code (:func:`binade_codes`): ``(binade + 149) * SLOTS + slot``, slot ``k`` for a
fraction starting with exactly ``k`` ones (not zero), slot ``POWER`` for a zero fraction; float32
zeros and inf/NaN get the two last codes.  A float32 subnormal ``m * 2**-149`` is placed by
``float32(m)``, which is exact and normal: its exponent is the binade, its fraction the bits below
``m``'s leading one.  The codes are integer arithmetic and one int->float conversion, written for
numpy, torch and jax.numpy alike (``where`` and ``float_bits`` passed in), so every recorder counts
the same way, and XLA's flushing of float32 subnormals in float arithmetic never enters.
"""

from __future__ import annotations

import math

import numpy as np

LOWEST_BINADE, HIGHEST_BINADE = -149, 127  # float32's smallest subnormal .. its largest finite binade
FRACTION_BITS = 23
POWER = FRACTION_BITS + 1  # the slot of exact powers of two (a zero fraction)
SLOTS = POWER + 1
BINADES = HIGHEST_BINADE - LOWEST_BINADE + 1
ZERO_CODE = BINADES * SLOTS
NONFINITE_CODE = ZERO_CODE + 1
CODES = NONFINITE_CODE + 1  # bincount length
_FRACTION_MASK = (1 << FRACTION_BITS) - 1


def binade_codes(bits, float_bits, where):
    """The histogram code of each float32 magnitude.

    Args:
      bits: int32 bit patterns of the magnitudes (sign bit clear), any array type.
      float_bits: ``f(ints) -> int32 bit patterns of float32(ints)`` for ints below 2**23, in that
        array library (numpy: ``lambda a: a.astype(np.float32).view(np.int32)``).
      where: the library's ``where``.

    Returns:
      An int32 array of codes in ``range(CODES)``.
    """
    exponent = bits >> FRACTION_BITS
    mantissa = bits & _FRACTION_MASK
    subnormal = exponent == 0
    normalized = float_bits(mantissa)  # a float32 subnormal's m, as a normal float32: exact
    binade = where(subnormal, (normalized >> FRACTION_BITS) - (127 - LOWEST_BINADE), exponent - 127)
    fraction = where(subnormal, normalized & _FRACTION_MASK, mantissa)
    inverse = _FRACTION_MASK - fraction  # the fraction's leading ones are this one's leading zeros
    ones = where(inverse == 0, FRACTION_BITS, (FRACTION_BITS - 1) - ((float_bits(inverse) >> FRACTION_BITS) - 127))
    slot = where(fraction == 0, POWER, ones)
    code = (binade - LOWEST_BINADE) * SLOTS + slot
    return where(bits == 0, ZERO_CODE, where(exponent == 255, NONFINITE_CODE, code))


def numpy_codes(values) -> np.ndarray:
    """:func:`binade_codes` of float32 values (their magnitudes), in numpy."""
    bits = np.asarray(values, np.float32).reshape(-1).view(np.int32) & 0x7FFFFFFF
    return binade_codes(bits, lambda a: a.astype(np.float32).view(np.int32), np.where)


def sparse_binades(counts) -> dict:
    """The nonzero binades of a dense histogram (``CODES`` counts): binade -> ``[powers, n_0, n_1, ...]``
    (``n_k``: values whose fraction starts with exactly ``k`` ones, not zero; trailing zeros dropped)."""
    counts = np.asarray(counts, np.int64)
    table = counts[:ZERO_CODE].reshape(BINADES, SLOTS)
    out = {}
    for index in np.flatnonzero(table.sum(1)):
        runs = table[index, :POWER]
        last = int(np.flatnonzero(runs)[-1]) + 1 if runs.any() else 0
        out[int(index) + LOWEST_BINADE] = [int(table[index, POWER])] + [int(n) for n in runs[:last]]
    return out


def _point(value: float) -> tuple:
    """(binade, fraction) of a positive finite float32 value (a float32 subnormal normalized)."""
    bits = int(np.array([value], np.float32).view(np.int32)[0])
    exponent, mantissa = bits >> FRACTION_BITS, bits & _FRACTION_MASK
    if exponent:
        return exponent - 127, mantissa
    lead = mantissa.bit_length() - 1
    return lead + LOWEST_BINADE, (mantissa - (1 << lead)) << (FRACTION_BITS - lead)


def _ties() -> tuple:
    """The fractions with k leading ones then zeros, k = 1..23."""
    return tuple(_FRACTION_MASK ^ ((1 << (FRACTION_BITS - k)) - 1) for k in range(1, FRACTION_BITS + 1))


_TIES = _ties()


def _below_in_binade(row, fraction: int, step: int) -> tuple:
    """(lower, upper) bound of the values in one binade (``[powers, n_0, n_1, ...]``) whose fraction is
    below ``fraction`` (0 .. 2**23; ``step``: the binade's spacing of fractions, 1 but in float32's
    subnormal range): exact at 0, ``step``, a tie point and 2**23."""
    powers, runs = row[0], list(row[1:]) + [0] * (POWER - len(row) + 1)
    # the fractions below which the count is known: nothing below 0; below the first nonzero fraction only
    # the powers; below the tie with k leading ones the values with fewer ones; below 2**23 all
    points = [(0, 0), (step, powers)] + [(tie, powers + sum(runs[:k])) for k, tie in enumerate(_TIES, 1)]
    points.append((1 << FRACTION_BITS, powers + sum(runs)))
    lower = max(count for point, count in points if point <= fraction)
    upper = min(count for point, count in points if point >= fraction)
    return lower, upper


def count_below(binades: dict, value: float, inclusive: bool = False) -> tuple:
    """(lower, upper) bound of the nonzero finite values ``< value`` (``<= value`` where ``inclusive``).

    Args:
      binades: binade -> ``[powers, n_0, n_1, ...]`` (:func:`sparse_binades`).
      value: any float >= 0 (a threshold divided by a scale).
      inclusive: count values equal to ``value`` too.

    Returns:
      Two ints, equal where the count is exact: ``value`` a power of two or a tie point (a float32
      whose fraction is ones then zeros) when not ``inclusive``, a power of two when ``inclusive``,
      or a value no float32 equals (the count is then that of the float32 just below it).
    """
    limit = np.float32(value)
    if not math.isinf(value) and float(limit) > value:
        limit = np.nextafter(limit, np.float32(0))
    exact = float(limit) == value
    if math.isinf(limit):
        total = sum(sum(row) for row in binades.values())
        return total, total
    if limit == 0:
        return 0, 0
    binade, fraction = _point(float(limit))
    step = 1 << max(0, FRACTION_BITS - (binade - LOWEST_BINADE))  # float32 subnormal binades hold fewer bits
    if inclusive or not exact:  # at most a float32: below the binade's next fraction
        fraction += step
    under = sum(sum(row) for other, row in binades.items() if other < binade)
    lower, upper = _below_in_binade(binades[binade], fraction, step) if binade in binades else (0, 0)
    return under + lower, under + upper


__all__ = ["CODES", "ZERO_CODE", "NONFINITE_CODE", "binade_codes", "numpy_codes", "sparse_binades", "count_below"]
