"""Run a scaler profile over a sequence of overflow flags, and unscale as each implementation does."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import ml_dtypes
import numpy as np

from fpemu.scalers.model import F32_TINY, ScalerRules
from fpemu.scalers.profiles import Profile, get_profile


@dataclasses.dataclass(frozen=True)
class ScalerTrace:
    """Step-by-step record of a simulated (or recorded) loss scaler.

    Attributes:
      profile: the profile's name.
      params: every parameter, defaults included.
      scales: the scale used at each step (before that step's update), Python floats.
      skipped: indices of steps whose optimizer update did not run.
      final_scale: the scale after the last step.
      overflow: per step, whether the gradients were non-finite.
      applied: per step, whether the optimizer update ran.
      growth_counter: per step, the growth counter after the update (for profiles
        without a scale: the count of consecutive non-finite steps); None where a real
        implementation does not expose it.
      hysteresis: per step, the hysteresis budget after the update (None without hysteresis).
      events: (step, text) for notable events, such as a raise at the minimum scale.
      stopped_at: the step at which the implementation raised and training ended, or None.
      update_ratio: per step, the optimizer update a real training engine applied divided by
        the update its step's own scale implies (0 for a skipped step); None where not measured,
        and for the model, whose updates are right by construction (1 when applied).
    """

    profile: str
    params: dict
    scales: list
    skipped: list
    final_scale: float
    overflow: np.ndarray
    applied: np.ndarray
    growth_counter: np.ndarray
    hysteresis: Optional[list]
    events: list
    stopped_at: Optional[int] = None
    update_ratio: Optional[list] = None

    @property
    def attempts(self) -> int:
        """Steps attempted (batches processed)."""
        return len(self.scales)

    @property
    def completed_updates(self) -> int:
        return int(np.count_nonzero(self.applied))

    @property
    def skipped_updates(self) -> int:
        return self.attempts - self.completed_updates

    def update_ratios(self) -> list:
        """update_ratio, or the model's: 1.0 where the update ran, 0.0 where it was skipped."""
        if self.update_ratio is not None:
            return list(self.update_ratio)
        return [1.0 if applied else 0.0 for applied in self.applied.tolist()]

    def as_dict(self) -> dict:
        """The seed API's dict: scales, skipped and final_scale."""
        return {"scales": list(self.scales), "skipped": list(self.skipped), "final_scale": self.final_scale}


def _check_overflows(overflows) -> np.ndarray:
    """overflows as a 1-d bool array; anything but a sequence of bools is a TypeError.

    A bool array passes through as it is; a list or tuple of Python bools is
    checked and converted in C (bytes of its 0/1 values); anything else goes
    through np.asarray, whose dtype must come out bool.
    """
    if isinstance(overflows, (str, bytes)) or not hasattr(overflows, "__iter__"):
        raise TypeError(f"overflows must be a sequence of bools, got {type(overflows).__name__}")
    if isinstance(overflows, np.ndarray):
        flags = overflows
    else:
        items = overflows if isinstance(overflows, (list, tuple)) else list(overflows)
        if not items:
            return np.zeros(0, dtype=bool)
        if set(map(type, items)) == {bool}:
            return np.frombuffer(bytes(items), dtype=bool)
        flags = np.asarray(items)
    if flags.size == 0:
        return np.zeros(0, dtype=bool)
    if flags.dtype != bool or flags.ndim != 1:
        for index, flag in enumerate(np.ravel(flags).tolist() if flags.ndim else [flags.item()]):
            if not isinstance(flag, bool):
                raise TypeError(f"overflows[{index}] must be a bool, got {flag!r}")
        raise TypeError(f"overflows must be a 1-d sequence of bools, got shape {flags.shape}")
    return flags


def _vectorizable(rules: ScalerRules) -> bool:
    """Rules whose growth and backoff steps depend only on where the overflows are."""
    return (rules.dynamic and rules.growth_timing in ("N", "N+1") and rules.hysteresis is None
            and rules.tolerance is None and rules.backoff_every == 1 and rules.stop_at is None
            and rules.floor_action == "clamp" and not rules.overflow_at_inf_raises)


def _run_vectorized(rules: ScalerRules, flags: np.ndarray, profile: str, params: dict) -> Optional[ScalerTrace]:
    """The same trace as the step loop, with Python work only at growth and backoff steps.

    Returns None where the trace turns out to depend on values (a zero scale under
    an ``at_zero_scale`` policy other than ``"continue"``); the caller then runs the step loop.
    """
    overflow = flags
    n = overflow.size
    overflow_steps = np.flatnonzero(overflow)
    # Steps since the last overflow (since step -1 before any), one run per overflow.
    run_starts = np.concatenate(([0], overflow_steps))
    counters = np.arange(n, dtype=np.int64)
    counters -= np.repeat(np.concatenate(([-1], overflow_steps)), np.diff(np.append(run_starts, n)))
    period = rules.growth_interval + (1 if rules.growth_timing == "N+1" else 0)
    if period <= n:  # (a longer period never wraps a counter: and it may be past int64)
        np.remainder(counters, period, out=counters)
    counters[overflow_steps] = 0                     # an overflow resets the counter
    events = np.flatnonzero(counters == 0).tolist()  # growths and overflows
    event_overflows = overflow[events].tolist()
    # The scale after each growth or backoff; a scale sequence has few distinct values, so the
    # float32 arithmetic runs once per (scale, kind) and the rest are dictionary look-ups.
    scale = float(rules.init().scale)
    values = [scale]
    cache = {}
    for is_overflow in event_overflows:
        key = (scale, is_overflow)
        following = cache.get(key)
        if following is None:
            following = float(rules._backed_off_clamped(scale) if is_overflow else rules._grown(scale))
            cache[key] = following
        values.append(following)
        scale = following
    bounds = [0, *(index + 1 for index in events), n]
    lengths = [stop - start for start, stop in zip(bounds, bounds[1:])]
    if rules.at_zero_scale != "continue" and any(abs(v) < F32_TINY for v, length in zip(values, lengths) if length):
        return None
    # One Python float object per segment, referenced once per step of it.
    scales_used = []
    for value, length in zip(values, lengths):
        scales_used += [value] * length
    return ScalerTrace(
        profile=profile, params=dict(params or {}), scales=scales_used,
        skipped=overflow_steps.tolist(), final_scale=float(values[-1]), overflow=overflow.copy(),
        applied=~overflow, growth_counter=counters, hysteresis=None, events=[])


def run_rules(rules: ScalerRules, overflows: Sequence[bool], profile: str = "custom",
              params: Optional[dict] = None, vectorize: bool = True) -> ScalerTrace:
    """Run ``rules`` over ``overflows`` (validated) and record the trace.

    Args:
      vectorize: take the vectorized path where the rules allow it (same result,
        checked by the tests); False always runs the step-by-step state machine.
    """
    flags = _check_overflows(overflows)
    if vectorize and _vectorizable(rules):
        trace = _run_vectorized(rules, flags, profile, params)
        if trace is not None:
            return trace
    state = rules.init()
    scales, applied, counters, hysteresis, events = [], [], [], [], []
    stopped_at = None
    for step, overflow in enumerate(flags.tolist()):
        outcome = rules.update(state, overflow)
        scales.append(state.scale)
        applied.append(outcome.applied)
        if outcome.event:
            events.append((step, outcome.event))
        state = outcome.state
        counters.append(state.growth_counter if rules.dynamic else state.bad_streak)
        hysteresis.append(state.hysteresis)
        if state.stopped:
            stopped_at = step
            break
    return ScalerTrace(
        profile=profile, params=dict(params or {}), scales=scales,
        skipped=[i for i, ok in enumerate(applied) if not ok], final_scale=state.scale,
        overflow=flags[:len(scales)].copy(), applied=np.array(applied, dtype=bool),
        growth_counter=np.array(counters, dtype=np.int64),
        hysteresis=hysteresis if rules.hysteresis is not None else None,
        events=events, stopped_at=stopped_at)


def simulate_scaler(overflows: Sequence[bool], profile="torch", **params) -> ScalerTrace:
    """Simulate a real loss scaler over a sequence of overflow flags.

    Args:
      overflows: one bool per step, True where the step's gradients were inf/NaN.
      profile: a profile name (see ``fpemu.PROFILES``) or a Profile.
      **params: the implementation's own parameters (``growth_interval`` for torch,
        ``period`` for jmp, ...); the others take its real defaults.

    Returns:
      A :class:`ScalerTrace`.

    Example:
      >>> simulate_scaler([False, True, False, False], "flax", scale=8.0, growth_interval=1).scales
      [8.0, 8.0, 4.0, 4.0]
      >>> simulate_scaler([False, True, False, False], "torch", init_scale=8.0, growth_interval=1).scales
      [8.0, 16.0, 8.0, 16.0]
    """
    chosen: Profile = get_profile(profile)
    rules = chosen.rules(**params)
    return run_rules(rules, overflows, chosen.name, {**chosen.defaults, **params})


def dynamic_loss_scale(overflows, init_scale=65536.0, growth_factor=2.0, backoff_factor=0.5,
                       growth_interval=2000) -> dict:
    """Seed 000: GradScaler's dynamic loss scale in Python float arithmetic.

    Returns:
      dict with 'scales' (the scale used at each step), 'skipped' (indices of
      overflow steps) and 'final_scale'.

    Example:
      >>> dynamic_loss_scale([False, True, False, False, False], init_scale=8.0, growth_interval=2)
      {'scales': [8.0, 8.0, 4.0, 4.0, 8.0], 'skipped': [1], 'final_scale': 8.0}
    """
    for name, value in (("init_scale", init_scale), ("growth_factor", growth_factor),
                        ("backoff_factor", backoff_factor)):
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"{name} must be a number, got {value!r}")
    if not np.isfinite(init_scale) or init_scale <= 0:
        raise ValueError(f"init_scale must be positive and finite, got {init_scale}")
    if not np.isfinite(growth_factor) or growth_factor <= 1:
        raise ValueError(f"growth_factor must be greater than 1, got {growth_factor}")
    if not 0 < backoff_factor < 1:
        raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, (int, np.integer)):
        raise TypeError(f"growth_interval must be an int, got {growth_interval!r}")
    if growth_interval < 1:
        raise ValueError(f"growth_interval must be at least 1, got {growth_interval}")
    rules = ScalerRules(float(init_scale), float(growth_factor), float(backoff_factor), int(growth_interval),
                        arithmetic="python", on_growth_overflow="inf")
    return run_rules(rules, overflows, "seed").as_dict()


def unscale(grads, scale: float, profile="torch") -> np.ndarray:
    """Gradients divided by the loss scale with the profile's own arithmetic.

    torch and most PyTorch-based scalers multiply by float32(1 / float64(scale));
    jmp by float32(1) / float32(scale); flax and Keras divide; Paddle's and TensorFlow's
    CPU kernels multiply by the reciprocal with subnormals flushed (``"mul_recip_ftz"``).

    The result is float32, except that the PyTorch-based profiles (``"mul_recip_fp64"``) give
    float16 and bfloat16 gradients back in their own dtype, as torch unscales them in place
    (``_amp_foreach_non_finite_check_and_unscale_``, torch 2.13.0: the float32 product rounded
    to the gradient's dtype; torch.amp.GradScaler.unscale_ refuses float16 gradients, its
    kernel and ShardedGradScaler take them).  jmp, flax and Keras on JAX return float32 for
    them as here; Paddle's and TensorFlow's kernels write the gradient's dtype, which is
    not modelled (float32 comes back).

    Example:
      >>> g = np.float32(5.0)
      >>> float(unscale(g, 3 * 2**10, "torch")) == float(unscale(g, 3 * 2**10, "flax"))
      False
    """
    chosen = get_profile(profile)
    given = np.asarray(grads)
    grads = given.astype(np.float32, copy=False)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if chosen.unscale == "mul_recip_fp64":
            product = grads * np.float32(1.0 / np.float64(np.float32(scale)))
            return product.astype(given.dtype) if given.dtype in _IN_PLACE_DTYPES else product
        if chosen.unscale == "mul_recip_fp32":
            return grads * (np.float32(1.0) / np.float32(scale))
        if chosen.unscale == "divide":
            return grads / np.float32(scale)
        if chosen.unscale == "mul_recip_ftz":
            reciprocal = _flushed(1.0 / _flushed(np.float32(scale)).astype(np.float64))
            return _flushed(_flushed(grads).astype(np.float64) * reciprocal)  # the float64 product is exact
    return grads


# 16-bit gradients that torch unscales in place, in float32 opmath, keeping their dtype.
_IN_PLACE_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def _flushed(exact) -> np.ndarray:
    """float64 values rounded to float32 as x86 does under flush-to-zero (results) and
    denormals-are-zero (inputs): a value whose rounding to 24 bits, exponent unbounded, is
    below float32's smallest normal becomes a zero of its sign (tininess after rounding)."""
    exact = np.asarray(exact, dtype=np.float64)
    rounded = exact.astype(np.float32)
    tiny = np.abs((exact * 2.0**64).astype(np.float32)) < np.float32(2.0**-62)  # scaled by 2^64: no underflow
    return np.where(tiny, np.copysign(np.float32(0), rounded), rounded)


def step_overflowed(scaled_grads, scale: float, profile="torch") -> bool:
    """Whether the profile sees an overflow in these scaled gradients.

    The check runs where the implementation runs it: on the scaled gradients
    (torch, Keras), on the unscaled ones (flax, jmp), or on the gradient norm
    (fairseq).  Below a scale of 1 they disagree: a finite scaled gradient can
    unscale to inf.
    """
    chosen = get_profile(profile)
    scaled = np.asarray(scaled_grads, dtype=np.float32)
    if chosen.check_on == "scaled":
        return not bool(np.all(np.isfinite(scaled)))
    unscaled = unscale(scaled, scale, chosen)
    if chosen.check_on == "grad_norm":
        with np.errstate(over="ignore", invalid="ignore"):
            return not np.isfinite(np.linalg.norm(unscaled.astype(np.float32)))
    return not bool(np.all(np.isfinite(unscaled)))
