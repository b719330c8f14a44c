"""Hypothesis strategies that generate values of a format and the inputs that probe it.

Requires the ``hypothesis`` package (the ``test`` extra).

Example:
  >>> from hypothesis import given
  >>> from fpemu import strategies as fst
  >>> @given(fst.format_values("fp8_e4m3fn"))
  ... def test_roundtrip(v): ...
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from fpemu.formats import decode, format_names, get_format, make_format
from fpemu.formats.format import SPECIAL_CONVENTIONS, Format


def formats() -> st.SearchStrategy:
    """Named formats, plus custom ones (every special convention)."""
    return st.one_of(st.sampled_from([get_format(name) for name in format_names()]),
                     custom_formats())


def custom_formats(max_exponent_bits: int = 8, max_mantissa_bits: int = 22) -> st.SearchStrategy:
    """Custom formats with 2..max_exponent_bits exponent bits and any special convention."""

    @st.composite
    def build(draw):
        special = draw(st.sampled_from(SPECIAL_CONVENTIONS))
        exponent_bits = draw(st.integers(2, max_exponent_bits))
        mantissa_bits = draw(st.integers(0 if special in ("fnuz", "finite") else 1, max_mantissa_bits))
        return make_format(exponent_bits=exponent_bits, mantissa_bits=mantissa_bits, special=special)

    return build()


def codes(fmt) -> st.SearchStrategy:
    """Any bit pattern of ``fmt``."""
    fmt = get_format(fmt)
    return st.integers(0, (1 << fmt.bits) - 1)


def format_values(fmt, *, allow_nan: bool = True, allow_infinity: bool = True) -> st.SearchStrategy:
    """Values exactly representable in ``fmt`` (as Python floats), edges weighted up.

    Infinities only where fmt has them, -0 only where fmt has it.
    """
    fmt = get_format(fmt)
    from_codes = codes(fmt).map(lambda code: float(decode(code, fmt)))
    values = st.one_of(st.sampled_from(_representable(edge_values(fmt), fmt)), from_codes)
    if not allow_nan:
        values = values.filter(lambda v: v == v)
    if not allow_infinity:
        values = values.filter(lambda v: abs(v) != float("inf"))
    return values


def edge_values(fmt) -> list:
    """The values where rounding to ``fmt`` changes behaviour.

    Zeros, min subnormal, the subnormal/normal boundary, max finite, the
    overflow threshold (halfway to the next binade step), ties around 1 and
    around the smallest subnormal, and their float64 neighbours.
    """
    fmt: Format = get_format(fmt)
    ulp_top = np.ldexp(1.0, fmt.emax - fmt.mantissa_bits)
    points = [0.0, fmt.min_subnormal, fmt.min_subnormal / 2, fmt.min_subnormal * 1.5,
              fmt.min_normal, fmt.min_normal - fmt.min_subnormal / 2, fmt.max_finite,
              fmt.max_finite + ulp_top / 2, fmt.max_finite + ulp_top,
              1.0, 1.0 + fmt.epsilon / 2, 1.0 + fmt.epsilon * 1.5, 1.0 - fmt.epsilon / 4]
    neighbours = [np.nextafter(p, side) for p in points for side in (-np.inf, np.inf)]
    finite = [float(v) for v in points + neighbours if v >= 0]
    return sorted(set(finite + [-v for v in finite])) + [float("inf"), float("-inf"), float("nan")]


def _representable(candidates, fmt: Format) -> list:
    """The candidates that are values of fmt, by the format's definition (not by rounding): zero
    where fmt has one (-0 where fmt has it), negative values only in signed formats, NaN and infinities where fmt has them, and finite magnitudes up to max
    finite that are whole multiples of fmt's quantum at their binade."""
    kept = []
    for value in candidates:
        if math.isnan(value):
            keep = fmt.has_nan
        elif math.isinf(value):
            keep = fmt.has_inf
        elif value == 0:
            keep = fmt.has_zero and (fmt.has_negative_zero or math.copysign(1.0, value) > 0)
        elif (value < 0 and not fmt.signed) or abs(value) < fmt.min_normal and not fmt.has_zero:
            keep = False
        else:
            magnitude = abs(value)
            binade = max(math.frexp(magnitude)[1] - 1, fmt.emin)
            keep = magnitude <= fmt.max_finite and math.ldexp(magnitude, fmt.mantissa_bits - binade).is_integer()
        if keep:
            kept.append(value)
    return kept


def probe_floats(fmt, dtype=np.float64) -> st.SearchStrategy:
    """Inputs of ``dtype`` (float32 or float64) clustered around ``fmt``'s grid.

    A mix of the format's edges (:func:`edge_values`), its values nudged by a few ulps of
    ``dtype``, exact midpoints between neighbours, and arbitrary floats of ``dtype``.
    """
    fmt = get_format(fmt)
    width = 32 if np.dtype(dtype) == np.float32 else 64
    cast = np.dtype(dtype).type

    def narrowed(value):
        with np.errstate(over="ignore"):  # a format wider than dtype: its large values become inf
            return cast(value)

    def nudge(args):
        value, steps = args
        out = narrowed(value)
        for _ in range(abs(steps)):
            out = np.nextafter(out, cast(np.inf) if steps > 0 else cast(-np.inf))
        return float(out)

    def midpoint(code):
        low, high = decode([code, code + 1], fmt)
        return float(narrowed((low + high) / 2)) if np.isfinite(low) and np.isfinite(high) else float(low)

    grid = format_values(fmt, allow_nan=False)
    return st.one_of(
        st.sampled_from(edge_values(fmt)).map(lambda v: float(narrowed(v))),
        grid.map(lambda v: float(narrowed(v))),
        st.tuples(grid, st.integers(-3, 3)).map(nudge),
        st.integers(0, (1 << (fmt.bits - 1)) - 2).map(midpoint),
        st.floats(width=width, allow_nan=True, allow_infinity=True),
    )
