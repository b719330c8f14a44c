"""Loss-scale advice: is there a power-of-two loss scale under which a format holds a model's gradients?

From the float32 gradients of a few steps: the smallest power-of-two scale that keeps the share of
all gradient elements that underflow at or below a threshold, and the largest one with no
overflow (both found with :func:`fpemu.range_stats`).  A power-of-two scale shifts every float32
exponent exactly, so underflow only falls and overflow only rises as the scale grows, and a binary
search over the exponents finds both ends.

The verdict counts elements over the whole model, so it does not depend on how the gradients are
grouped (per module or per parameter give the same advice); the groups only explain it: each
group's own range, and the groups that lose more than the threshold at the advised scale.

A gradient that is mathematically zero (an attention key bias under softmax: adding a constant to
every key's score changes nothing) is computed as rounding noise, about 2^-24 of its neighbours'
size, and needs an absurd scale to survive fp16.  Elements below 2^-24 of their own group's
largest magnitude in the same step are marked noise-level and named in the summary; since they
are a small share of all elements, they do not decide the advice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Callable, Optional

import numpy as np

from fpemu.formats import get_format, quantize, range_stats

# Candidate scales 2^k: every power of two that is a normal float32.
_MIN_EXPONENT, _MAX_EXPONENT = -126, 127
# Below this fraction of its group's largest magnitude (in the same step) a gradient element is at
# float32's rounding-noise level: 2^-24 is float32's unit roundoff.
NOISE_LEVEL = 2.0 ** -24


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
      noise: elements at rounding-noise level (below ``NOISE_LEVEL`` times the group's largest
        magnitude in their step).
      noise_underflow: noise-level elements that underflow at the reference scale.
    """

    name: str
    elements: int
    max_abs: float
    min_scale: Optional[float]
    max_scale: Optional[float]
    underflow_share: float
    overflow: int
    noise: int = 0
    noise_underflow: int = 0

    @property
    def fits_alone(self) -> bool:
        """Whether some scale fits this layer by itself."""
        return self.min_scale is not None and self.max_scale is not None and self.min_scale <= self.max_scale


@dataclasses.dataclass(frozen=True)
class LossScaleAdvice:
    """Which loss scales let a format hold the gradients, and where to start.

    Attributes:
      format: the target format's name.
      max_underflow_share: the threshold: the largest share of all gradient elements that may
        underflow to zero.
      scale: the scale to start from, the power of two in the middle of the fitting range (in
        binades), which leaves equal headroom against overflow and underflow; None when none fits.
      lowest, highest: the smallest and largest fitting power of two (None when none fits).
      reference_scale: the scale the layers' shares are measured at: ``scale``, or where none fits,
        the largest scale with no overflow in any layer.
      layers: one :class:`LayerFit` per layer, in input order.
      misfits: the layers that overflow or lose more than the threshold of their own elements at the
        reference scale (the verdict is on all elements together; these explain it).
      underflow_share: the share of all elements that underflow at the reference scale.
    """

    format: str
    max_underflow_share: float
    scale: Optional[float]
    lowest: Optional[float]
    highest: Optional[float]
    reference_scale: float
    layers: tuple
    misfits: tuple
    underflow_share: float = 0.0

    @property
    def fits(self) -> bool:
        return self.scale is not None

    def summary(self) -> str:
        """A plain statement of the advice, then the layers that do not fit and the noise-level ones."""
        limit = f"underflow at most {self.max_underflow_share:.3g} of the gradient elements"
        if self.fits:
            lines = [f"{self.format} holds these gradients at loss scales {_pow2(self.lowest)} to "
                     f"{_pow2(self.highest)}; start at {_pow2(self.scale)}.\n(No overflow, and {limit}.)"]
            if self.misfits:
                lines.append(f"At {_pow2(self.scale)} these lose more than {self.max_underflow_share:.3g} of "
                             "their own elements:")
        else:
            lines = [f"No power-of-two loss scale fits {self.format}: none avoids overflow and keeps {limit}."]
            ceiling = [layer for layer in self.layers if layer.max_scale == self.reference_scale]
            if ceiling:
                names = ", ".join(layer.name for layer in ceiling)
                lines.append(f"The largest scale with no overflow is {_pow2(self.reference_scale)}, set by {names} "
                             f"(max |g| {ceiling[0].max_abs:.3g}); there {self.underflow_share:.2%} of all "
                             "elements underflow:")
        lines += [self._misfit_line(layer) for layer in self.layers if layer.name in self.misfits]
        noisy = [layer for layer in self.layers if layer.noise]
        if noisy:
            lines.append(f"Noise-level gradients (below {_pow2(NOISE_LEVEL)} of their group's largest, "
                         "float32 rounding noise: a mathematically zero gradient such as an attention key "
                         "bias looks like this; they are too few to decide the advice):")
            lines += [f"  {layer.name}: {layer.noise} of {layer.elements} elements, {layer.noise_underflow} of "
                      f"them underflow at {_pow2(self.reference_scale)}" for layer in noisy]
        return "\n".join(lines)

    def _misfit_line(self, layer: LayerFit) -> str:
        needs = (f"needs at least {_pow2(layer.min_scale)}" if layer.min_scale is not None
                 else "underflows at every scale")
        alone = "" if layer.fits_alone else f"; its own range is wider than {self.format}'s"
        noise = f"; {layer.noise_underflow} of them noise-level" if layer.noise_underflow else ""
        return (f"  {layer.name}: {layer.underflow_share:.2%} underflow, {layer.overflow} overflow "
                f"({needs}{alone}{noise})")


def _pow2(scale: float) -> str:
    """A power of two as 2^k (its exponent from frexp: exact, where log2 goes through a libm)."""
    return f"2^{math.frexp(scale)[1] - 1}"


def _first_true(predicate: Callable[[int], bool], lo: int, hi: int) -> Optional[int]:
    """Smallest k in [lo, hi] with ``predicate(k)``, for a predicate false up to some k and true after."""
    if not predicate(hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if predicate(mid) else (mid + 1, hi)
    return lo


def _layers(steps) -> tuple:
    """Validate ``steps``; join each layer's gradients over the steps, as float32, and mark the
    noise-level elements (relative to the layer's largest magnitude in the same step)."""
    if not isinstance(steps, (list, tuple)) or not steps:
        got = "an empty list" if isinstance(steps, (list, tuple)) else type(steps).__name__
        raise TypeError(f"steps must be a non-empty list of dicts of layer name -> float32 gradient array, "
                        f"got {got}")
    joined: dict = {}
    noise: dict = {}
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
            magnitude = np.abs(values.astype(np.float32).ravel())
            peak = magnitude.max(initial=0.0)
            joined.setdefault(name, []).append(values.astype(np.float32).ravel())
            noise.setdefault(name, []).append((magnitude != 0) & (magnitude < NOISE_LEVEL * peak))
    return ({name: np.concatenate(parts) for name, parts in joined.items()},
            {name: np.concatenate(parts) for name, parts in noise.items()})


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

    A scale fits when no scaled gradient overflows ``fmt`` and at most ``max_underflow_share`` of
    all the gradient elements underflow to zero (counted over every layer together, so the advice
    is the same however the gradients are grouped).

    Args:
      steps: the float32 gradients of a few steps: a list of dicts of layer name -> array.
      fmt: the target format (a Format or name): "fp16", "fp8_e4m3fn", "fp8_e5m2", ...
      max_underflow_share: the largest share of the elements allowed to underflow, in [0, 1).

    Returns:
      A :class:`LossScaleAdvice`; ``summary()`` says it in words.

    Example:
      >>> rng = np.random.default_rng(0)
      >>> healthy = [{"w": rng.standard_normal(1000).astype(np.float32) * 1e-4} for _ in range(2)]
      >>> print(advise_loss_scale(healthy, "fp16").summary())
      fp16 holds these gradients at loss scales 2^-2 to 2^27; start at 2^12.
      (No overflow, and underflow at most 0.001 of the gradient elements.)
      >>> wide = [{"w": np.logspace(-14, 2, 1000, dtype=np.float32)}]   # bf16-trained: 16 decades
      >>> advise_loss_scale(wide, "fp16").fits
      False
    """
    layers, noise = _layers(steps)
    fmt = get_format(fmt)
    if isinstance(max_underflow_share, bool) or not isinstance(max_underflow_share, (int, float, np.floating)):
        raise TypeError(f"max_underflow_share must be a number, got {max_underflow_share!r}")
    if not 0 <= max_underflow_share < 1:
        raise ValueError(f"max_underflow_share must be in [0, 1), got {max_underflow_share!r}")
    # The verdict is on every element at once: independent of how they were grouped.
    common_low, common_high = _exponent_range(np.concatenate(list(layers.values())), fmt, max_underflow_share)
    fits = common_low is not None and common_high is not None and common_low <= common_high
    if fits:
        reference = (common_low + common_high) // 2
    else:
        reference = _MIN_EXPONENT if common_high is None else common_high
    fitted, underflows = [], 0
    for name, grads in layers.items():
        low, high = _exponent_range(grads, fmt, max_underflow_share)
        at_reference = range_stats(grads, fmt, scale=2.0 ** reference)
        underflows += at_reference.underflow
        with np.errstate(over="ignore"):  # a float32 product past its range overflows: not lost
            lost = (grads != 0) & (quantize(grads * np.float32(2.0 ** reference), fmt) == 0)
        fitted.append(LayerFit(
            name=name, elements=int(grads.size), max_abs=float(np.max(np.abs(grads))) if grads.size else 0.0,
            min_scale=None if low is None else 2.0 ** low, max_scale=None if high is None else 2.0 ** high,
            underflow_share=at_reference.underflow_share, overflow=at_reference.overflow,
            noise=int(np.count_nonzero(noise[name])), noise_underflow=int(np.count_nonzero(lost & noise[name]))))
    misfits = tuple(layer.name for layer in fitted
                    if layer.overflow or layer.underflow_share > max_underflow_share)
    total = sum(layer.elements for layer in fitted)
    return LossScaleAdvice(
        format=fmt.name, max_underflow_share=float(max_underflow_share),
        scale=2.0 ** reference if fits else None,
        lowest=2.0 ** common_low if fits else None, highest=2.0 ** common_high if fits else None,
        reference_scale=2.0 ** reference, layers=tuple(fitted), misfits=misfits,
        underflow_share=underflows / total if total else 0.0)


__all__ = ["LayerFit", "LossScaleAdvice", "advise_loss_scale"]
