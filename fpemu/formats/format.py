"""Binary floating-point formats as immutable values.

A :class:`Format` says how many exponent and mantissa bits a format has, its
exponent bias and which codes are special.  Everything else (largest finite
value, smallest subnormal, epsilon, the numpy dtype that stores it) is derived
from those four fields, so two formats with equal fields are the same format.

Special-value conventions:

* ``ieee``: the all-ones exponent holds +-inf and NaN (fp16, bf16, fp8_e5m2).
* ``fn``: no infinities; the only NaN codes are all-ones exponent *and*
  all-ones mantissa (float8_e4m3fn), so the top binade holds finite values.
* ``fnuz``: no infinities and no negative zero; the single NaN is the code of
  -0 (0x80 for 8-bit formats), so the top binade is fully finite.
* ``finite``: no infinities and no NaN, every code is a number (the OCP MX fp6 and
  fp4 formats, ml_dtypes' float6_e2m3fn, float6_e3m2fn, float4_e2m1fn).  Overflow
  saturates to max finite; a NaN input stays NaN in :func:`quantize`'s float result
  (ml_dtypes turns it into -0) and cannot be encoded.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import ml_dtypes
import numpy as np

SPECIAL_CONVENTIONS = ("ieee", "fn", "fnuz", "finite")

# float64 is the widest type the emulation computes in, so every format must
# fit inside it: at most 11 exponent bits, fewer mantissa bits than float64,
# and an exponent range inside float64's.
_MAX_EXPONENT_BITS = 11
_MAX_MANTISSA_BITS = 51


@dataclasses.dataclass(frozen=True)
class Format:
    """A binary floating-point format with a sign bit.

    Args:
      name: short name used in reports and traces.
      exponent_bits: width of the exponent field, 1 to 11.
      mantissa_bits: width of the stored fraction field (no implicit bit).
      bias: exponent bias.
      special: ``"ieee"``, ``"fn"``, ``"fnuz"`` or ``"finite"`` (see the module docstring).

    Example:
      >>> fp16 = Format("fp16", exponent_bits=5, mantissa_bits=10, bias=15)
      >>> fp16.max_finite, fp16.min_subnormal
      (65504.0, 5.960464477539063e-08)
    """

    name: str = dataclasses.field(compare=False)  # equal fields, equal formats, whatever the name
    exponent_bits: int
    mantissa_bits: int
    bias: int
    special: str = "ieee"

    def __post_init__(self):
        for field in ("exponent_bits", "mantissa_bits", "bias"):
            value = getattr(self, field)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
                raise TypeError(f"{field} must be an int, got {value!r}")
        if not 1 <= self.exponent_bits <= _MAX_EXPONENT_BITS:
            raise ValueError(
                f"exponent_bits must be in 1..{_MAX_EXPONENT_BITS}, got {self.exponent_bits}")
        # Without mantissa bits only fnuz keeps a NaN code (the -0 code), and finite needs none.
        min_mantissa = 0 if self.special in ("fnuz", "finite") else 1
        if not min_mantissa <= self.mantissa_bits <= _MAX_MANTISSA_BITS:
            raise ValueError(
                f"mantissa_bits must be in {min_mantissa}..{_MAX_MANTISSA_BITS} for "
                f"special={self.special!r}, got {self.mantissa_bits}")
        if self.special not in SPECIAL_CONVENTIONS:
            raise ValueError(
                f"special must be one of {SPECIAL_CONVENTIONS}, got {self.special!r}")
        if self.emax < self.emin:
            raise ValueError(f"exponent_bits={self.exponent_bits} with special={self.special!r} leaves no "
                             "normal binade (emax < emin); use more exponent bits")
        if self.emin < -1022 or self.emax > 1023:
            raise ValueError(
                f"bias={self.bias} puts the exponent range [{self.emin}, {self.emax}] "
                "outside float64's [-1022, 1023]")

    @property
    def bits(self) -> int:
        """Total width in bits, sign included."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.special != "finite"

    @property
    def has_negative_zero(self) -> bool:
        return self.special != "fnuz"

    @property
    def emin(self) -> int:
        """Unbiased exponent of the smallest normal number."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """Unbiased exponent of the largest finite number."""
        top_field = (1 << self.exponent_bits) - 1
        return top_field - self.bias - (1 if self.special == "ieee" else 0)

    @property
    def max_finite(self) -> float:
        # fn loses the single code (all-ones mantissa) of the top binade to NaN.
        fraction_steps = (1 << self.mantissa_bits) - (2 if self.special == "fn" else 1)
        return float(np.ldexp(1.0 + fraction_steps / (1 << self.mantissa_bits), self.emax))

    @property
    def min_normal(self) -> float:
        return float(np.ldexp(1.0, self.emin))

    @property
    def min_subnormal(self) -> float:
        return float(np.ldexp(1.0, self.emin - self.mantissa_bits))

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
        return (self.exponent_bits, self.mantissa_bits, self.bias, self.special)

    def __str__(self) -> str:
        return self.name


def _native_dtypes() -> dict:
    candidates = [np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)]
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                 "float8_e5m2fnuz", "float8_e4m3", "float8_e3m4", "float8_e4m3b11fnuz",
                 "float6_e2m3fn", "float6_e3m2fn", "float4_e2m1fn"):
        if hasattr(ml_dtypes, name):
            candidates.append(np.dtype(getattr(ml_dtypes, name)))
    table = {}
    for dtype in candidates:
        info = ml_dtypes.finfo(dtype)
        name = dtype.name
        with np.errstate(invalid="ignore"):
            has_nan = bool(np.isnan(np.array(np.nan, np.float32).astype(dtype).astype(np.float32)))
        special = ("fnuz" if name.endswith("fnuz") else "finite" if not has_nan
                   else "fn" if name.endswith("fn") else "ieee")
        bias = 1 - int(np.log2(float(info.smallest_normal)))
        table[(int(info.nexp), int(info.nmant), bias, special)] = dtype
    return table


_NATIVE_DTYPES = _native_dtypes()

# Adding a format is one line here.
_NAMED = {
    "fp32": (8, 23, 127, "ieee"),
    "tf32": (8, 10, 127, "ieee"),
    "fp16": (5, 10, 15, "ieee"),
    "bf16": (8, 7, 127, "ieee"),
    "fp8_e4m3fn": (4, 3, 7, "fn"),
    "fp8_e5m2": (5, 2, 15, "ieee"),
    "fp8_e4m3fnuz": (4, 3, 8, "fnuz"),
    "fp8_e5m2fnuz": (5, 2, 16, "fnuz"),
    "fp8_e4m3": (4, 3, 7, "ieee"),
    "fp8_e3m4": (3, 4, 3, "ieee"),
    "fp8_e4m3b11fnuz": (4, 3, 11, "fnuz"),
    "fp6_e2m3fn": (2, 3, 1, "finite"),
    "fp6_e3m2fn": (3, 2, 3, "finite"),
    "fp4_e2m1fn": (2, 1, 1, "finite"),
}

_ALIASES = {
    "float32": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3fn", "float8_e5m2": "fp8_e5m2",
    "float8_e4m3fnuz": "fp8_e4m3fnuz", "float8_e5m2fnuz": "fp8_e5m2fnuz",
    "float8_e4m3": "fp8_e4m3", "float8_e3m4": "fp8_e3m4",
    "float8_e4m3b11fnuz": "fp8_e4m3b11fnuz", "e4m3": "fp8_e4m3fn", "e5m2": "fp8_e5m2",
    "float6_e2m3fn": "fp6_e2m3fn", "float6_e3m2fn": "fp6_e3m2fn", "float4_e2m1fn": "fp4_e2m1fn",
}


FORMATS = {name: Format(name, *layout) for name, layout in _NAMED.items()}


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
    """A custom IEEE-style format.

    Args:
      exponent_bits: 1 to 11.
      mantissa_bits: 1 to 51 (0 allowed for ``special="fnuz"`` and ``"finite"``).
      bias: defaults to ``2**(exponent_bits-1) - 1`` (``2**(exponent_bits-1)`` for fnuz,
        matching float8_e4m3fnuz and float8_e5m2fnuz).
      special: ``"ieee"``, ``"fn"``, ``"fnuz"`` or ``"finite"``.
      name: defaults to ``e{E}m{M}`` plus the special suffix.

    Example:
      >>> make_format(exponent_bits=6, mantissa_bits=9).max_finite
      4290772992.0
    """
    if not isinstance(exponent_bits, (int, np.integer)) or isinstance(exponent_bits, bool):
        raise TypeError(f"exponent_bits must be an int, got {exponent_bits!r}")
    if not 1 <= exponent_bits <= _MAX_EXPONENT_BITS:
        raise ValueError(f"exponent_bits must be in 1..{_MAX_EXPONENT_BITS}, got {exponent_bits}")
    if bias is None:
        bias = (1 << (exponent_bits - 1)) - (0 if special == "fnuz" else 1)
    if name is None:
        suffix = "" if special == "ieee" else special
        name = f"e{exponent_bits}m{mantissa_bits}{suffix}"
    return Format(name, exponent_bits, mantissa_bits, bias, special)
