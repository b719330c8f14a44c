"""One dynamic-loss-scale state machine; profiles configure it to match a real implementation.

The machine is pure: :meth:`ScalerRules.init` gives the first :class:`ScalerState`
and :meth:`ScalerRules.update` maps (state, overflow) to the next state, in the
style of ``jmp.DynamicLossScale.adjust``.  Every behaviour in which real
scalers differ is a field of :class:`ScalerRules`:

* ``growth_timing``: ``"N"`` grows on the N-th consecutive finite step (torch);
  ``"N+1"`` on the step after (flax); ``"window"`` grows whenever the number of
  steps since the last overflow is a multiple of N (DeepSpeed, fairseq);
  ``"window+1"`` is DeepSpeed FP16_Optimizer's ``stable_interval`` rule (the first
  growth after an overflow comes one step late, later ones every N).
* ``arithmetic``: ``"fp32"`` (float32 multiply), ``"fp64_to_fp32"`` (product in
  float64 rounded once to float32, torch's kernel), ``"python"`` (float64).
* ``backoff``: ``"multiply"`` by backoff_factor, ``"divide"`` by growth_factor,
  or ``"reciprocal"``: multiply by float32(1/growth_factor) (what XLA makes of
  jmp's division under jit).
* ``on_growth_overflow``: ``"keep"`` the old scale, ``"clamp"`` to float32 max,
  or ``"inf"``; ``max_scale`` is a hard cap (apex).
* ``floor`` / ``floor_action``: ``"clamp"`` at the floor, or ``"raise"`` when an
  overflow arrives at the floor (DeepSpeed); ``stop_at``: training stops on any
  overflow after which the scale is at this value or under, whether or not that
  overflow backed off (fairseq's min_loss_scale raises FloatingPointError even when
  ``tolerance`` holds the backoff back).
* ``hysteresis`` with ``hysteresis_style`` ``"megatron"`` (refill on growth) or
  ``"deepspeed"`` (refill on growth, or on every finite step when
  ``consecutive_hysteresis``); ``tolerance`` (fairseq); ``backoff_every``
  (Paddle's decr_every_n_nan_or_inf); ``flush_subnormals`` (XLA on the CPU: subnormal
  results become 0 and subnormal operands read as 0) with ``flush_initial_scale`` False
  where the initial scale is stored as given, subnormal too, and only the arithmetic
  flushes (TensorFlow);
  ``at_zero_scale``: what a step does once the scale has reached exactly 0:
  ``"continue"`` (torch: the inf check runs on the scaled gradients, all zero),
  ``"overflow"`` (a profile that checks the unscaled gradients sees 0/0 = NaN on
  every step: flax without a floor) or ``"raise"`` (apex divides ``1./scale`` in
  Python: ZeroDivisionError stops training).
* ``overflow_at_inf_raises``: an overflow while the scale is inf stops training
  (DeepSpeed's DynamicLossScaler formats ``int(scale)`` into its overflow log line:
  OverflowError; its Python-float scale grows past float32 to inf).

Every string field takes one of the values in :data:`RULE_CHOICES`; anything else is
refused when the rules are built, so a typo cannot silently run another profile's rule.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)

# The one vocabulary of the rules' string fields, checked when rules are built.
RULE_CHOICES = {
    "growth_timing": ("N", "N+1", "window", "window+1"),
    "arithmetic": ("fp32", "fp64_to_fp32", "python"),
    "backoff": ("multiply", "divide", "reciprocal"),
    "on_growth_overflow": ("keep", "clamp", "inf"),
    "floor_action": ("clamp", "raise"),
    "hysteresis_style": ("megatron", "deepspeed"),
    "at_zero_scale": ("continue", "overflow", "raise"),
}
_NUMBER_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "max_scale", "floor", "stop_at", "tolerance")
_COUNT_FIELDS = ("growth_interval", "hysteresis", "backoff_every", "pass_after_consecutive")
_FLAG_FIELDS = ("consecutive_hysteresis", "flush_subnormals", "flush_initial_scale", "dynamic", "skip_nonfinite",
                "overflow_at_inf_raises")


def _is_number(value) -> bool:
    return not isinstance(value, (bool, np.bool_)) and isinstance(value, (int, float, np.integer, np.floating))


@dataclasses.dataclass(frozen=True)
class ScalerState:
    """Where a scaler stands before a step.

    Attributes:
      scale: the loss scale the next step uses (an exact float32 value unless the
        profile computes in Python floats).
      growth_counter: consecutive finite steps counted towards growth (for window
        profiles: steps since the last overflow, modulo the window).
      hysteresis: overflows still tolerated before backing off (None without hysteresis).
      iteration: steps taken.
      last_overflow: iteration of the last overflow (-1 before any).
      last_rescale: iteration of the last scale change (fairseq's tolerance).
      overflows_since_rescale: overflows since then (fairseq).
      bad_streak: consecutive overflows (Paddle's decr counter, optax's notfinite_count).
      stopped: the implementation raised and training ended.
    """

    scale: float
    growth_counter: int = 0
    hysteresis: Optional[int] = None
    iteration: int = 0
    last_overflow: int = -1
    last_rescale: int = -1
    overflows_since_rescale: int = 0
    bad_streak: int = 0
    stopped: bool = False


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What one update did: the new state, whether the optimizer step ran, and any event."""
    state: ScalerState
    applied: bool
    event: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class ScalerRules:
    """The semantics of one dynamic loss scaler (see the module docstring)."""

    init_scale: float
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    growth_timing: str = "N"
    arithmetic: str = "fp32"
    backoff: str = "multiply"
    on_growth_overflow: str = "keep"
    max_scale: Optional[float] = None
    floor: Optional[float] = None
    floor_action: str = "clamp"
    stop_at: Optional[float] = None
    hysteresis: Optional[int] = None
    hysteresis_style: str = "megatron"
    consecutive_hysteresis: bool = False
    tolerance: Optional[float] = None
    backoff_every: int = 1
    flush_subnormals: bool = False
    flush_initial_scale: bool = True
    dynamic: bool = True
    skip_nonfinite: bool = True
    pass_after_consecutive: Optional[int] = None
    at_zero_scale: str = "continue"
    overflow_at_inf_raises: bool = False

    def __post_init__(self):
        for name, choices in RULE_CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"ScalerRules.{name} must be one of {', '.join(map(repr, choices))}, "
                                 f"got {getattr(self, name)!r}")
        for name in _NUMBER_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_number(value):
                raise TypeError(f"ScalerRules.{name} must be a number, got {value!r}")
        for name in _COUNT_FIELDS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer))):
                raise TypeError(f"ScalerRules.{name} must be an int, got {value!r}")
        for name in _FLAG_FIELDS:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"ScalerRules.{name} must be True or False, got {getattr(self, name)!r}")

    def init(self) -> ScalerState:
        scale = self._round(self.init_scale)
        if not self.flush_initial_scale and self.arithmetic != "python":
            with np.errstate(over="ignore"):
                scale = float(np.float32(self.init_scale))
        return ScalerState(scale=scale, hysteresis=self.hysteresis)

    # -- arithmetic -------------------------------------------------------
    def _round(self, value: float) -> float:
        if self.arithmetic == "python":
            return float(value)
        with np.errstate(over="ignore"):
            out = float(np.float32(value))
        if self.flush_subnormals and 0 < abs(out) < F32_TINY:
            return 0.0
        return out

    def _operand(self, scale: float) -> float:
        """The scale as flushing arithmetic reads it: a subnormal is 0 (denormals-are-zero)."""
        return 0.0 if self.flush_subnormals and 0 < abs(scale) < F32_TINY else scale

    def _multiply(self, scale: float, factor: float) -> float:
        scale = self._operand(scale)
        if self.arithmetic == "fp32":
            with np.errstate(over="ignore", under="ignore"):
                return self._round(np.float32(scale) * np.float32(factor))
        return self._round(scale * factor)  # float64 product, rounded once (or kept for python)

    def _divide(self, scale: float, factor: float) -> float:
        scale = self._operand(scale)
        if self.arithmetic == "fp32":
            with np.errstate(over="ignore", under="ignore"):
                return self._round(np.float32(scale) / np.float32(factor))
        return self._round(scale / factor)

    def _grown(self, scale: float) -> float:
        grown = self._multiply(scale, self.growth_factor)
        if not np.isfinite(grown):
            if self.on_growth_overflow == "keep":
                grown = scale
            elif self.on_growth_overflow == "clamp":
                grown = F32_MAX
        if self.max_scale is not None:
            grown = min(grown, self.max_scale)
        return grown

    def _backed_off(self, scale: float) -> float:
        if self.backoff == "multiply":
            smaller = self._multiply(scale, self.backoff_factor)
        elif self.backoff == "divide":
            smaller = self._divide(scale, self.growth_factor)
        else:
            reciprocal = float(np.float32(1.0) / np.float32(self.growth_factor))
            smaller = self._multiply(scale, reciprocal)
        return smaller

    def _backed_off_clamped(self, scale: float) -> float:
        smaller = self._backed_off(scale)
        return smaller if self.floor is None else max(smaller, self.floor)

    # -- the step ---------------------------------------------------------
    def update(self, state: ScalerState, overflow: bool) -> StepOutcome:
        """The state after a step whose gradients were (not) finite."""
        if not self.dynamic:
            return self._constant_scale(state, overflow)
        if state.scale == 0 and self.at_zero_scale == "raise":
            return StepOutcome(dataclasses.replace(state, stopped=True), False,
                               "raised: ZeroDivisionError, the scale reached 0 (1 / scale)")
        # Under flush-to-zero arithmetic a subnormal scale, kept as given at the start, reads as 0 too.
        if not overflow and self._operand(state.scale) == 0 and self.at_zero_scale == "overflow":
            outcome = self._on_overflow(state)
            return dataclasses.replace(outcome, event="scale is 0: unscaled gradients are 0/0 = NaN")
        if overflow:
            return self._on_overflow(state)
        return StepOutcome(self._on_finite(state), True)

    def _constant_scale(self, s: ScalerState, overflow: bool) -> StepOutcome:
        streak = s.bad_streak + 1 if overflow else 0
        passes = self.pass_after_consecutive is not None and streak > self.pass_after_consecutive
        applied = not overflow or not self.skip_nonfinite or passes
        event = f"non-finite update applied ({streak} consecutive)" if overflow and applied else None
        return StepOutcome(dataclasses.replace(s, iteration=s.iteration + 1, bad_streak=streak),
                           applied, event)

    def _on_finite(self, s: ScalerState) -> ScalerState:
        scale, hysteresis = s.scale, s.hysteresis
        if self.hysteresis_style == "deepspeed" and self.consecutive_hysteresis:
            hysteresis = self.hysteresis
        since_overflow = s.iteration - s.last_overflow
        if self.growth_timing == "N":
            counter = s.growth_counter + 1
            grow = counter == self.growth_interval
        elif self.growth_timing == "N+1":
            grow = s.growth_counter == self.growth_interval
            counter = s.growth_counter + 1
        elif self.growth_timing == "window":
            grow = since_overflow % self.growth_interval == 0
            counter = since_overflow % self.growth_interval
        else:  # window+1
            stable = since_overflow - 1
            grow = stable > 0 and stable % self.growth_interval == 0
            counter = max(stable, 0) % self.growth_interval
        last_rescale = s.last_rescale
        if grow:
            scale = self._grown(scale)
            counter = 0
            last_rescale = s.iteration
            if self.hysteresis is not None:
                hysteresis = self.hysteresis
        return dataclasses.replace(s, scale=scale, growth_counter=counter, hysteresis=hysteresis,
                                   iteration=s.iteration + 1, last_rescale=last_rescale, bad_streak=0)

    def _on_overflow(self, s: ScalerState) -> StepOutcome:
        if self.overflow_at_inf_raises and s.scale == math.inf:
            return StepOutcome(dataclasses.replace(s, stopped=True), False,
                               "raised: OverflowError, int(inf) in the overflow log line")
        hysteresis = s.hysteresis
        streak = s.bad_streak + 1
        back_off = streak % self.backoff_every == 0
        if self.hysteresis is not None:
            if self.hysteresis_style == "megatron":
                hysteresis -= 1
                back_off = hysteresis <= 0
            else:  # deepspeed: spend the budget first, back off once it is down to 1
                back_off = self.hysteresis == 1 or hysteresis == 1
                if not back_off:
                    hysteresis -= 1
        last_rescale, overflows_since = s.last_rescale, s.overflows_since_rescale + 1
        if self.tolerance is not None:
            # fairseq v0.12.2 divides as is; from init() the count is never 0 (a growth or a backoff
            # at step i leaves i + 1 - i).
            back_off = overflows_since / (s.iteration - s.last_rescale) >= self.tolerance
        scale, event = s.scale, None
        if back_off:
            if self.floor_action == "raise" and self.floor is not None and scale == self.floor:
                return StepOutcome(dataclasses.replace(s, stopped=True), False,
                                   "raised: overflow at the minimum scale")
            scale = self._backed_off_clamped(scale)
            last_rescale, overflows_since = s.iteration, 0
        if self.stop_at is not None and scale <= self.stop_at:
            # fairseq restores the scale it had before this overflow, then raises.
            return StepOutcome(dataclasses.replace(s, stopped=True), False,
                               "raised: overflow with the scale at or below the minimum")
        state = dataclasses.replace(
            s, scale=scale, growth_counter=0, hysteresis=hysteresis, iteration=s.iteration + 1,
            last_overflow=s.iteration, last_rescale=last_rescale,
            overflows_since_rescale=overflows_since, bad_streak=streak % self.backoff_every)
        if not back_off:
            event = "overflow did not back off (hysteresis, tolerance or backoff_every)"
        return StepOutcome(state, False, event)
