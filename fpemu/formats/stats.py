"""What a tensor loses when it is scaled and rounded to a format."""

from __future__ import annotations

import dataclasses

import numpy as np

from fpemu.formats.format import Format, get_format
from fpemu.formats.rounding import as_float_array, round_to_format


@dataclasses.dataclass(frozen=True)
class RangeStats:
    """Counts of what rounding ``x * scale`` to ``format`` did to each element.

    Attributes:
      format: name of the format.
      scale: the scale applied (in float32) before rounding.
      total: number of elements.
      zeros: elements that were +-0 in the input.
      underflow: non-zero inputs that became +-0.
      subnormal: results that are non-zero and below the format's min normal.
      overflow: non-NaN elements whose result is inf or NaN, or was clamped to max
        finite, because they exceed the format's range (infinite inputs included).
      nan: NaN inputs.
      max_abs: largest finite magnitude of ``x * scale`` (0.0 if none).
      min_nonzero_abs: smallest non-zero finite magnitude of ``x * scale`` (inf if none).
    """

    format: str
    scale: float
    total: int
    zeros: int
    underflow: int
    subnormal: int
    overflow: int
    nan: int
    max_abs: float
    min_nonzero_abs: float

    def share(self, field: str) -> float:
        """``field``'s count as a share of ``total`` (0.0 for an empty tensor)."""
        return getattr(self, field) / self.total if self.total else 0.0

    @property
    def underflow_share(self) -> float:
        return self.share("underflow")

    @property
    def subnormal_share(self) -> float:
        return self.share("subnormal")

    @property
    def overflow_share(self) -> float:
        return self.share("overflow")

    @property
    def nan_share(self) -> float:
        return self.share("nan")

    @property
    def zeros_share(self) -> float:
        return self.share("zeros")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def range_stats(x, fmt, scale: float = 1.0, *, rounding: str = "nearest_even",
                overflow: str = "inf", subnormals: bool = True) -> RangeStats:
    """Measure underflow, subnormals, overflow and NaN of ``x * scale`` in ``fmt``.

    ``x`` is cast to float32 and multiplied by ``float32(scale)`` in float32, as a
    loss scale multiplies gradients; the product is then rounded to ``fmt``.

    Args:
      x: array of values (gradients, activations).
      fmt: a Format or a format name.
      scale: positive finite loss scale.
      rounding, overflow, subnormals: as in :func:`fpemu.quantize`.

    Example:
      >>> stats = range_stats([1e-9, 1e-3, 1e5], "fp16")
      >>> stats.underflow, stats.overflow
      (1, 1)
      >>> range_stats([1e-9, 1e-3, 1e5], "fp16", scale=1024).underflow
      0
    """
    fmt: Format = get_format(fmt)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a number, got {type(scale).__name__}")
    with np.errstate(over="ignore", under="ignore"):
        scale32 = np.float32(float(scale))
    if not np.isfinite(scale32) or scale32 <= 0:
        raise ValueError(f"scale must be positive and finite in float32 (it multiplies in float32), got {scale}")
    with np.errstate(over="ignore"):  # a product past float32's range is inf: counted as overflow
        scaled = as_float_array(x).astype(np.float32) * scale32
    rounded = round_to_format(scaled, fmt, rounding, overflow, subnormals)
    values = rounded.values
    is_nan = np.isnan(scaled)
    input_zero = as_float_array(x).astype(np.float32) == 0
    result_zero = values == 0
    magnitude = np.abs(values)
    finite_scaled = np.abs(scaled[np.isfinite(scaled)])
    nonzero = finite_scaled[finite_scaled != 0]
    return RangeStats(
        format=fmt.name,
        scale=float(scale),
        total=int(scaled.size),
        zeros=int(np.count_nonzero(input_zero)),
        underflow=int(np.count_nonzero(result_zero & ~input_zero & ~is_nan)),
        subnormal=int(np.count_nonzero((magnitude < fmt.min_normal) & ~result_zero & ~is_nan)),
        overflow=int(np.count_nonzero(rounded.overflowed & ~is_nan)),
        nan=int(np.count_nonzero(np.isnan(as_float_array(x)))),
        max_abs=float(finite_scaled.max()) if finite_scaled.size else 0.0,
        min_nonzero_abs=float(nonzero.min()) if nonzero.size else float("inf"),
    )
