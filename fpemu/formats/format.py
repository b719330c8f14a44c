"""Binary floating-point formats as immutable values.

A :class:`Format` says how many exponent and mantissa bits a format has, its exponent bias, and,
in orthogonal fields, what its codes mean: whether it has a sign bit, infinities, how many NaN
codes sit at the top of each sign's magnitudes, whether the code of -0 is NaN, and whether the
exponent field 0 holds zero and subnormals or a normal binade.  Everything else (largest finite
value, smallest subnormal, epsilon, the numpy dtype that stores it) is derived from these fields,
so two formats with equal fields are the same format.  The same fields describe gfloat's
``FormatInfo`` (``is_signed``, ``domain``, ``num_high_nans``, ``has_nz``, ``has_subnormals``).

The usual combinations have names (``special=`` in :func:`make_format`):

* ``ieee``: the all-ones exponent holds +-inf and NaN (fp16, bf16, fp8_e5m2).
* ``fn``: no infinities; the only NaN codes are all-ones exponent *and*
  all-ones mantissa (float8_e4m3fn), so the top binade holds finite values.
* ``fnuz``: no infinities and no negative zero; the single NaN is the code of
  -0 (0x80 for 8-bit formats), so the top binade is fully finite.
* ``finite``: no infinities and no NaN, every code is a number (the OCP MX fp6 and
  fp4 formats, ml_dtypes' float6_e2m3fn, float6_e3m2fn, float4_e2m1fn).  Overflow
  saturates to max finite; a NaN input stays NaN in :func:`quantize`'s float result
  (ml_dtypes turns it into -0) and cannot be encoded.
* ``fnu``: unsigned, no zero, one NaN (the all-ones code): the OCP MX scale format e8m0
  (ml_dtypes' and torch's float8_e8m0fnu), whose codes 0..254 are 2**-127 .. 2**127.

Formats without a sign bit (``signed=False``) round negative inputs to NaN; formats without a
zero (``has_zero=False``, whose exponent field 0 is a normal binade) round 0 to NaN and positive
values below the smallest one up to it, as ml_dtypes' float8_e8m0fnu does.  (torch's e8m0 cast
maps 0 to code 0x00 and a negative x to the code of |x| instead.)
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import ml_dtypes
import numpy as np

# Named combinations of the special-value fields: (signed, has_inf, NaN codes (None: all of the
# all-ones exponent but inf), nan_at_negative_zero, has_zero).
_CONVENTIONS = {
    "ieee": (True, True, None, False, True),
    "fn": (True, False, 1, False, True),
    "fnuz": (True, False, 0, True, True),
    "finite": (True, False, 0, False, True),
    "fnu": (False, False, 1, False, False),
}
SPECIAL_CONVENTIONS = ("ieee", "fn", "fnuz", "finite")  # the signed ones, which the rational oracle covers

# float64 is the widest type the emulation computes in, so every format must
# fit inside it: at most 11 exponent bits, fewer mantissa bits than float64,
# and an exponent range inside float64's.
_MAX_EXPONENT_BITS = 11
_MAX_MANTISSA_BITS = 51


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format.

    Args:
      name: short name used in reports and traces.
      exponent_bits: width of the exponent field, 1 to 11.
      mantissa_bits: width of the stored fraction field (no implicit bit).
      bias: exponent bias.
      signed: whether the format has a sign bit.
      has_inf: whether the code above max finite (below any NaN codes) is infinity.
      nan_codes: how many codes at the top of each sign's magnitudes are NaN; None: every
        all-ones-exponent code but infinity's (IEEE: ``2**mantissa_bits - 1``).
      nan_at_negative_zero: the code of -0 is NaN (fnuz), so there is one zero.
      has_zero: False when the exponent field 0 is a normal binade (e8m0): no zero, no subnormals.

    Example:
      >>> fp16 = Format("fp16", exponent_bits=5, mantissa_bits=10, bias=15)
      >>> fp16.max_finite, fp16.min_subnormal
      (65504.0, 5.960464477539063e-08)
      >>> e8m0 = Format("e8m0", 8, 0, 127, signed=False, has_inf=False, nan_codes=1, has_zero=False)
      >>> e8m0.min_normal == 2.0**-127, e8m0.max_finite == 2.0**127, e8m0.bits
      (True, True, 8)
    """

    name: str = dataclasses.field(compare=False)  # equal fields, equal formats, whatever the name
    exponent_bits: int
    mantissa_bits: int
    bias: int
    signed: bool = True
    has_inf: bool = True
    nan_codes: Optional[int] = None
    nan_at_negative_zero: bool = False
    has_zero: bool = True

    def __post_init__(self):
        for field in ("exponent_bits", "mantissa_bits", "bias"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{field} must be an int, got {value!r}")
        for field in ("signed", "has_inf", "nan_at_negative_zero", "has_zero"):
            if not isinstance(getattr(self, field), (bool, np.bool_)):
                raise TypeError(f"{field} must be True or False, got {getattr(self, field)!r}")
        if not 1 <= self.exponent_bits <= _MAX_EXPONENT_BITS:
            raise ValueError(
                f"exponent_bits must be in 1..{_MAX_EXPONENT_BITS}, got {self.exponent_bits}")
        if not 0 <= self.mantissa_bits <= _MAX_MANTISSA_BITS:
            raise ValueError(f"mantissa_bits must be in 0..{_MAX_MANTISSA_BITS}, got {self.mantissa_bits}")
        if self.nan_codes is None:
            object.__setattr__(self, "nan_codes", (1 << self.mantissa_bits) - 1)  # IEEE's count
        if self.nan_codes is not None and (not isinstance(self.nan_codes, (int, np.integer))
                                           or isinstance(self.nan_codes, bool) or self.nan_codes < 0):
            raise TypeError(f"nan_codes must be a non-negative int or None, got {self.nan_codes!r}")
        if self.nan_at_negative_zero and not (self.signed and self.has_zero):
            raise ValueError("nan_at_negative_zero needs a sign bit and a zero")
        if self.max_finite_code < (1 << self.mantissa_bits):
            raise ValueError(f"nan_codes={self.nan_codes} with has_inf={self.has_inf} leaves no normal "
                             f"binade for exponent_bits={self.exponent_bits}, mantissa_bits="
                             f"{self.mantissa_bits}; use more exponent bits or fewer special codes")
        if self.emin < -1022 or self.emax > 1023:
            raise ValueError(
                f"bias={self.bias} puts the exponent range [{self.emin}, {self.emax}] "
                "outside float64's [-1022, 1023]")

    @property
    def special(self) -> str:
        """The name of this combination of special-value fields, or a description of it."""
        fields = (self.signed, self.has_inf, self.nan_codes, self.nan_at_negative_zero, self.has_zero)
        for name, convention in _CONVENTIONS.items():
            if _convention_fields(convention, self.mantissa_bits) == fields:
                return name
        words = [("" if self.signed else "unsigned"), ("inf" if self.has_inf else ""),
                 f"{self.nan_codes} NaN codes" if self.nan_codes else "",
                 "NaN at -0" if self.nan_at_negative_zero else "", "" if self.has_zero else "no zero"]
        return ", ".join(word for word in words if word)

    @property
    def bits(self) -> int:
        """Total width in bits, sign included."""
        return int(self.signed) + self.exponent_bits + self.mantissa_bits

    @property
    def has_nan(self) -> bool:
        return self.nan_codes > 0 or self.nan_at_negative_zero

    @property
    def has_negative_zero(self) -> bool:
        return self.signed and self.has_zero and not self.nan_at_negative_zero

    @property
    def max_finite_code(self) -> int:
        """The largest magnitude code (sign bit clear) that is a finite number."""
        return (1 << (self.exponent_bits + self.mantissa_bits)) - 1 - self.nan_codes - int(self.has_inf)

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number."""
        return (1 if self.has_zero else 0) - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite number."""
        return (self.max_finite_code >> self.mantissa_bits) - self.bias

    @property
    def max_finite(self) -> float:
        fraction = self.max_finite_code & ((1 << self.mantissa_bits) - 1)
        return float(np.ldexp(1.0 + fraction / (1 << self.mantissa_bits), self.emax))

    @property
    def min_normal(self) -> float:
        return float(np.ldexp(1.0, self.emin))

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value (min normal itself where there are no subnormals)."""
        return float(np.ldexp(1.0, self.emin - (self.mantissa_bits if self.has_zero else 0)))

    @property
    def epsilon(self) -> float:
        """Distance from 1.0 to the next larger value."""
        return float(np.ldexp(1.0, -self.mantissa_bits))

    @property
    def dtype(self) -> Optional[np.dtype]:
        """The numpy / ml_dtypes dtype with exactly these semantics, or None."""
        return _NATIVE_DTYPES.get(self._layout)

    @property
    def _layout(self):
        return (self.exponent_bits, self.mantissa_bits, self.bias, self.signed, self.has_inf,
                self.nan_codes, self.nan_at_negative_zero, self.has_zero)

    def __str__(self) -> str:
        return self.name


def past_max(fmt: Format) -> float:
    """The least magnitude on fmt's grid above max finite, with the exponent range unbounded (the
    value the code after max finite's would have): rounding overflows where the result reaches it.
    2**(emax + 1) where max finite ends its binade (:func:`max_ends_binade`), else max finite plus
    its ulp."""
    return fmt.max_finite + math.ldexp(1.0, fmt.emax - fmt.mantissa_bits)


def max_ends_binade(fmt: Format) -> bool:
    """Whether max finite is the last value of its binade, so that overflow starts at 2**(emax + 1):
    true of IEEE, fn, fnuz and finite layouts, false where an infinity or NaN codes take the top of
    the binade (P3109's layouts: inf on the top code, no NaN code above it)."""
    return (fmt.max_finite_code + 1) % (1 << fmt.mantissa_bits) == 0


def _convention_fields(convention: tuple, mantissa_bits: int) -> tuple:
    signed, has_inf, nan_codes, nan_at_negative_zero, has_zero = convention
    if nan_codes is None:
        nan_codes = (1 << mantissa_bits) - 1
    return signed, has_inf, nan_codes, nan_at_negative_zero, has_zero


def _format(name: str, exponent_bits: int, mantissa_bits: int, bias: int, special: str) -> Format:
    if special not in _CONVENTIONS:
        raise ValueError(f"special must be one of {tuple(_CONVENTIONS)}, got {special!r}")
    signed, has_inf, nan_codes, nan_at_negative_zero, has_zero = _convention_fields(
        _CONVENTIONS[special], mantissa_bits)
    return Format(name, exponent_bits, mantissa_bits, bias, signed=signed, has_inf=has_inf,
                  nan_codes=nan_codes, nan_at_negative_zero=nan_at_negative_zero, has_zero=has_zero)


# Adding a format is one line here: layout, special-value convention, and the numpy / ml_dtypes
# dtype with exactly its semantics (None where there is none).
_NAMED = {
    "fp32": (8, 23, 127, "ieee", "float32"),
    "tf32": (8, 10, 127, "ieee", None),
    "fp16": (5, 10, 15, "ieee", "float16"),
    "bf16": (8, 7, 127, "ieee", "bfloat16"),
    "fp8_e4m3fn": (4, 3, 7, "fn", "float8_e4m3fn"),
    "fp8_e5m2": (5, 2, 15, "ieee", "float8_e5m2"),
    "fp8_e4m3fnuz": (4, 3, 8, "fnuz", "float8_e4m3fnuz"),
    "fp8_e5m2fnuz": (5, 2, 16, "fnuz", "float8_e5m2fnuz"),
    "fp8_e4m3": (4, 3, 7, "ieee", "float8_e4m3"),
    "fp8_e3m4": (3, 4, 3, "ieee", "float8_e3m4"),
    "fp8_e4m3b11fnuz": (4, 3, 11, "fnuz", "float8_e4m3b11fnuz"),
    "fp6_e2m3fn": (2, 3, 1, "finite", "float6_e2m3fn"),
    "fp6_e3m2fn": (3, 2, 3, "finite", "float6_e3m2fn"),
    "fp4_e2m1fn": (2, 1, 1, "finite", "float4_e2m1fn"),
    "e8m0": (8, 0, 127, "fnu", "float8_e8m0fnu"),
}

_ALIASES = {
    "float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3fn", "float8_e5m2": "fp8_e5m2",
    "float8_e4m3fnuz": "fp8_e4m3fnuz", "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "float8_e4m3": "fp8_e4m3", "float8_e3m4": "fp8_e3m4",
    "float8_e4m3b11fnuz": "fp8_e4m3b11fnuz", "e4m3": "fp8_e4m3fn", "e5m2": "fp8_e5m2",
    "float6_e2m3fn": "fp6_e2m3fn", "float6_e3m2fn": "fp6_e3m2fn", "float4_e2m1fn": "fp4_e2m1fn",
    "float8_e8m0fnu": "e8m0", "e8m0fnu": "e8m0", "fp8_e8m0": "e8m0",
}


FORMATS = {name: _format(name, *layout[:4]) for name, layout in _NAMED.items()}


def _native_dtype(name: Optional[str]) -> Optional[np.dtype]:
    if name is None:
        return None
    kind = getattr(np, name, None) if name.startswith("float") and hasattr(np, name) else None
    kind = kind or getattr(ml_dtypes, name, None)
    return None if kind is None else np.dtype(kind)  # (an older ml_dtypes may lack one)


_NATIVE_DTYPES = {FORMATS[name]._layout: _native_dtype(layout[4]) for name, layout in _NAMED.items()
                  if _native_dtype(layout[4]) is not None}


def format_names() -> list:
    """Names accepted by :func:`get_format`, aliases excluded."""
    return list(FORMATS)


def get_format(fmt) -> Format:
    """Look up a format by name (``"bf16"``, ``"fp8_e4m3fn"``, ...) or pass one through.

    Raises:
      ValueError: unknown name; the message lists the known ones.
      TypeError: neither a name nor a Format.
    """
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, np.dtype) or (isinstance(fmt, type) and issubclass(fmt, np.generic)):
        dtype = np.dtype(fmt)
        for candidate in FORMATS.values():
            if candidate.dtype == dtype:
                return candidate
        raise ValueError(f"fmt: dtype {dtype} has no fpemu format; known: {format_names()}")
    if not isinstance(fmt, str):
        raise TypeError(f"fmt must be a Format or a format name, got {type(fmt).__name__}")
    key = fmt.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in FORMATS:
        raise ValueError(f"fmt: unknown format {fmt!r}; known formats: {', '.join(format_names())}")
    return FORMATS[key]


@functools.lru_cache(maxsize=None)
def make_format(*, exponent_bits: int, mantissa_bits: int, bias: Optional[int] = None,
                special: str = "ieee", name: Optional[str] = None) -> Format:
    """A custom format with one of the named special-value conventions.

    Formats outside these conventions are :class:`Format` values built from its fields.

    Args:
      exponent_bits: 1 to 11.
      mantissa_bits: 1 to 51 (0 allowed for ``special="fnuz"``, ``"finite"`` and ``"fnu"``).
      bias: defaults to ``2**(exponent_bits-1) - 1`` (``2**(exponent_bits-1)`` for fnuz,
        matching float8_e4m3fnuz and float8_e5m2fnuz).
      special: ``"ieee"``, ``"fn"``, ``"fnuz"``, ``"finite"`` or ``"fnu"`` (see the module docstring).
      name: defaults to ``e{E}m{M}`` plus the special suffix.

    Example:
      >>> make_format(exponent_bits=6, mantissa_bits=9).max_finite
      4290772992.0
      >>> make_format(exponent_bits=8, mantissa_bits=0, special="fnu") == get_format("e8m0")
      True
    """
    if not isinstance(exponent_bits, (int, np.integer)) or isinstance(exponent_bits, bool):
        raise TypeError(f"exponent_bits must be an int, got {exponent_bits!r}")
    if not 1 <= exponent_bits <= _MAX_EXPONENT_BITS:
        raise ValueError(f"exponent_bits must be in 1..{_MAX_EXPONENT_BITS}, got {exponent_bits}")
    if special not in _CONVENTIONS:
        raise ValueError(f"special must be one of {tuple(_CONVENTIONS)}, got {special!r}")
    # Without mantissa bits an IEEE or fn format would have no NaN code left.
    min_mantissa = 1 if special in ("ieee", "fn") else 0
    if not isinstance(mantissa_bits, (int, np.integer)) or not min_mantissa <= mantissa_bits <= _MAX_MANTISSA_BITS:
        raise ValueError(f"mantissa_bits must be in {min_mantissa}..{_MAX_MANTISSA_BITS} for "
                         f"special={special!r}, got {mantissa_bits}")
    if bias is None:
        bias = (1 << (exponent_bits - 1)) - (0 if special == "fnuz" else 1)
    if name is None:
        suffix = "" if special == "ieee" else special
        name = f"e{exponent_bits}m{mantissa_bits}{suffix}"
    return _format(name, exponent_bits, mantissa_bits, bias, special)
