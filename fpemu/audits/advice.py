"""Loss-scale advice: is there a power-of-two loss scale under which a format holds a model's gradients?

From the float32 gradients of a few steps, per layer: the smallest power-of-two scale that keeps
the underflow share at or below a threshold, and the largest one with no overflow (both found with
:func:`fpemu.range_stats`).  A power-of-two scale shifts every float32 exponent exactly, so
underflow only falls and overflow only rises as the scale grows, and a binary search over the
exponents finds both ends.  The scales that fit every layer are where those ranges overlap.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Callable, Optional

import numpy as np

from fpemu.formats import get_format, range_stats

# Candidate scales 2^k: every power of two that is a normal float32.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 127


@dataclasses.dataclass(frozen=True)
class LayerFit:
    """Where one layer's gradients fit in the format.

    Attributes:
      name: the layer's name.
      elements: gradient elements over all steps.
      max_abs: the largest gradient magnitude.
      min_scale: smallest power-of-two scale with underflow share at most the threshold (None: none).
      max_scale: largest power-of-two scale with no overflow (None: none).
      underflow_share: underflow share at the advice's reference scale.
      overflow: elements that overflow at the reference scale.
    """

    name: str
    elements: int
    max_abs: float
    min_scale: Optional[float]
    max_scale: Optional[float]
    underflow_share: float
    overflow: int

    @property
    def fits_alone(self) -> bool:
        """Whether some scale fits this layer by itself."""
        return self.min_scale is not None and self.max_scale is not None and self.min_scale <= self.max_scale


@dataclasses.dataclass(frozen=True)
class LossScaleAdvice:
    """Which loss scales let a format hold the gradients, and where to start.

    Attributes:
      format: the target format's name.
      max_underflow_share: the threshold: the largest share of a layer's gradient elements that may
        underflow to zero.
      scale: the scale to start from, the power of two in the middle of the fitting range (in
        binades), which leaves equal headroom against overflow and underflow; None when none fits.
      lowest, highest: the smallest and largest fitting power of two (None when none fits).
      reference_scale: the scale the layers' shares are measured at: ``scale``, or where none fits,
        the largest scale with no overflow in any layer.
      layers: one :class:`LayerFit` per layer, in input order.
      misfits: the layers that overflow or lose more than the threshold at the reference scale.
    """

    format: str
    max_underflow_share: float
    scale: Optional[float]
    lowest: Optional[float]
    highest: Optional[float]
    reference_scale: float
    layers: tuple
    misfits: tuple

    @property
    def fits(self) -> bool:
        return self.scale is not None

    def summary(self) -> str:
        """A plain statement of the advice, then the layers that do not fit."""
        limit = f"underflow at most {self.max_underflow_share:.3g} of each layer's gradient elements"
        if self.fits:
            return (f"{self.format} holds these gradients at loss scales {_pow2(self.lowest)} to "
                    f"{_pow2(self.highest)}; start at {_pow2(self.scale)}.\n(No overflow, and {limit}.)")
        lines = [f"No power-of-two loss scale fits {self.format}: none avoids overflow and keeps {limit}."]
        ceiling = [layer for layer in self.layers if layer.max_scale == self.reference_scale]
        if ceiling:
            names = ", ".join(layer.name for layer in ceiling)
            lines.append(f"The largest scale with no overflow is {_pow2(self.reference_scale)}, set by {names} "
                         f"(max |g| {ceiling[0].max_abs:.3g}); there:")
        for layer in self.layers:
            if layer.name in self.misfits:
                needs = (f"needs at least {_pow2(layer.min_scale)}" if layer.min_scale is not None
                         else "underflows at every scale")
                alone = "" if layer.fits_alone else f"; its own range is wider than {self.format}'s"
                lines.append(f"  {layer.name}: {layer.underflow_share:.2%} underflow, {layer.overflow} "
                             f"overflow ({needs}{alone})")
        return "\n".join(lines)


def _pow2(scale: float) -> str:
    return f"2^{int(np.log2(scale))}"


def _first_true(predicate: Callable[[int], bool], lo: int, hi: int) -> Optional[int]:
    """Smallest k in [lo, hi] with ``predicate(k)``, for a predicate false up to some k and true after."""
    if not predicate(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if predicate(mid) else (mid + 1, hi)
    return lo


def _layers(steps) -> dict:
    """Validate ``steps`` and join each layer's gradients over the steps, as float32."""
    if not isinstance(steps, (list, tuple)) or not steps:
        got = "an empty list" if isinstance(steps, (list, tuple)) else type(steps).__name__
        raise TypeError(f"steps must be a non-empty list of dicts of layer name -> float32 gradient array, "
                        f"got {got}")
    joined: dict = {}
    for index, step in enumerate(steps):
        if not isinstance(step, Mapping):
            raise TypeError(f"steps[{index}] must be a dict of layer name -> gradient array, "
                            f"got {type(step).__name__}")
        for name, grads in step.items():
            values = np.asarray(grads)
            if values.dtype.kind not in "fiu":
                raise TypeError(f"steps[{index}][{name!r}] must be a real array, got dtype {values.dtype}")
            if not np.all(np.isfinite(values)):
                raise ValueError(f"steps[{index}][{name!r}] has non-finite values; loss-scale advice needs "
                                 "the finite float32 gradients of a healthy step")
            joined.setdefault(name, []).append(values.astype(np.float32).ravel())
    return {name: np.concatenate(parts) for name, parts in joined.items()}


def _exponent_range(grads: np.ndarray, fmt, max_underflow_share: float) -> tuple:
    """(low, high): the smallest k whose scale 2^k keeps underflow within the threshold, and the
    largest k with no overflow; either is None where no k qualifies."""
    cache: dict = {}

    def stats(k):
        if k not in cache:
            with np.errstate(over="ignore"):  # float32 overflow of grads * 2^k is an overflow counted
                cache[k] = range_stats(grads, fmt, scale=2.0 ** k)
        return cache[k]

    low = _first_true(lambda k: stats(k).underflow_share <= max_underflow_share, _MIN_EXPONENT, _MAX_EXPONENT)
    first_overflow = _first_true(lambda k: stats(k).overflow > 0, _MIN_EXPONENT, _MAX_EXPONENT)
    if first_overflow is None:
        return low, _MAX_EXPONENT
    return low, None if first_overflow == _MIN_EXPONENT else first_overflow - 1


def advise_loss_scale(steps, fmt="fp16", *, max_underflow_share: float = 0.001) -> LossScaleAdvice:
    """Find the power-of-two loss scales under which ``fmt`` holds a model's gradients.

    A scale fits when no layer's scaled gradients overflow ``fmt`` and in every layer at most
    ``max_underflow_share`` of the elements underflow to zero.

    Args:
      steps: the float32 gradients of a few steps: a list of dicts of layer name -> array.
      fmt: the target format (a Format or name): "fp16", "fp8_e4m3fn", "fp8_e5m2", ...
      max_underflow_share: the largest share of a layer's elements allowed to underflow, in [0, 1).

    Returns:
      A :class:`LossScaleAdvice`; ``summary()`` says it in words.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> healthy = [{"w": rng.standard_normal(1000).astype(np.float32) * 1e-4} for _ in range(2)]
      >>> print(advise_loss_scale(healthy, "fp16").summary())
      fp16 holds these gradients at loss scales 2^-2 to 2^27; start at 2^12.
      (No overflow, and underflow at most 0.001 of each layer's gradient elements.)
      >>> wide = [{"w": np.logspace(-14, 2, 1000, dtype=np.float32)}]   # bf16-trained: 16 decades
      >>> advise_loss_scale(wide, "fp16").fits
      False
    """
    layers = _layers(steps)
    fmt = get_format(fmt)
    if isinstance(max_underflow_share, bool) or not isinstance(max_underflow_share, (int, float, np.floating)):
        raise TypeError(f"max_underflow_share must be a number, got {max_underflow_share!r}")
    if not 0 <= max_underflow_share < 1:
        raise ValueError(f"max_underflow_share must be in [0, 1), got {max_underflow_share!r}")
    ranges = {name: _exponent_range(grads, fmt, max_underflow_share) for name, grads in layers.items()}
    lows, highs = [low for low, _ in ranges.values()], [high for _, high in ranges.values()]
    common_low = None if None in lows else max(lows)
    common_high = None if None in highs else min(highs)
    fits = common_low is not None and common_high is not None and common_low <= common_high
    if fits:
        reference = (common_low + common_high) // 2
    else:
        reference = _MIN_EXPONENT if common_high is None else common_high
    fitted = []
    for name, grads in layers.items():
        low, high = ranges[name]
        at_reference = range_stats(grads, fmt, scale=2.0 ** reference)
        fitted.append(LayerFit(
            name=name, elements=int(grads.size), max_abs=float(np.max(np.abs(grads))) if grads.size else 0.0,
            min_scale=None if low is None else 2.0 ** low, max_scale=None if high is None else 2.0 ** high,
            underflow_share=at_reference.underflow_share, overflow=at_reference.overflow))
    misfits = tuple(layer.name for layer in fitted
                    if layer.overflow or layer.underflow_share > max_underflow_share)
    return LossScaleAdvice(
        format=fmt.name, max_underflow_share=float(max_underflow_share),
        scale=2.0 ** reference if fits else None,
        lowest=2.0 ** common_low if fits else None, highest=2.0 ** common_high if fits else None,
        reference_scale=2.0 ** reference, layers=tuple(fitted), misfits=misfits)


__all__ = ["LayerFit", "LossScaleAdvice", "advise_loss_scale"]
