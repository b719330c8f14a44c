"""Replay a recorded run's gradients through any loss scaler profile, format or parameters.

A recorded trace (fpemu.traces.recorded) keeps, per attempt, the scale it ran at, whether the
scaler found inf/NaN, and each group's largest stored gradient magnitude at that scale.  Replay
runs a profile's rules step by step and decides each step's overflow at the scale the replayed
scaler holds then, from what the run showed at its own scale:

* ``recorded``: the same scale and format as the run: the run's own verdict;
* ``implied``: a larger scale than one that overflowed, or a smaller one than one that did not
  (multiplying by a power of two moves every value alike);
* ``estimated``: otherwise, from the largest gradient magnitude computed in the compute format
  (``compute_max``: the module outputs' and autocast-cast parameters' gradients, over every
  microbatch, as the torch recorder keeps it; else the largest ``max_abs``): unscaled, times the
  replayed scale, it overflows where it reaches the format's overflow threshold.  A step
  whose gradients held inf/NaN has no finite maximum; the nearest finite step's stands in.

Where the run recorded a shadow pass (``shadow_histogram``: its float32 gradients by binade), the
replay also recounts true underflow at each sampled step: the shares of elements nonzero in float32
that the replayed scale and format round to zero or to a subnormal
(:meth:`fpemu.traces.recorded.ShadowHistogram.counts`: exact at power-of-two scales, bounds
otherwise).  That is the float32 gradient rounded once; the run's own ``shadow`` shares also hold
what its backward lost before the gradient was formed (activation gradients underflowing), so at the
run's own scale the two differ by that.

What replay cannot know: a different scale (or a skipped update the run made, or not) changes the
weights and so every later gradient; the run's parameter gradients stand in for all the values
the backward pass rounds (activation gradients can overflow first).  So a replay is exact while it
stays on the recorded trajectory (under the run's own profile and parameters it reproduces the
scale trajectory bit for bit) and an estimate after; ``ReplayResult.decisions`` says which is which.

Imports only numpy and the core (no framework).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import pathlib
from typing import Optional

import numpy as np

from fpemu.formats import get_format
from fpemu.scalers.profiles import get_profile
from fpemu.scalers.simulate import ScalerTrace, run_rules
from fpemu.traces.recorded import ShadowShares, format_thresholds, recorded_steps, recorder_settings

DECISIONS = ("recorded", "implied", "estimated")


@dataclasses.dataclass(frozen=True)
class ReplayResult:
    """A replayed run.

    Attributes:
      trace: the profile's :class:`~fpemu.scalers.ScalerTrace` over the replayed overflow flags.
      decisions: per step, how its overflow was decided: one of ``DECISIONS``.
      compute: the format the replay decided overflows in.
      shadow: per step, None (no shadow pass recorded there), or group ->
        :class:`~fpemu.traces.recorded.ShadowShares`: the float32 gradients rounded once at the
        replayed scale into ``compute``.
      shadow_total: per step, None or the :class:`~fpemu.traces.recorded.ShadowShares` of all groups
        together (shares of every element).
    """

    trace: ScalerTrace
    decisions: tuple
    compute: str
    shadow: tuple = ()
    shadow_total: tuple = ()

    @property
    def flags(self) -> list:
        return self.trace.overflow.tolist()

    @property
    def first_estimate(self) -> Optional[int]:
        """The first step decided by estimate (from there on the replay is no longer the run), or None."""
        return next((i for i, kind in enumerate(self.decisions) if kind == "estimated"), None)

    def counts(self) -> dict:
        return {kind: self.decisions.count(kind) for kind in DECISIONS}


def _largest(step) -> Optional[float]:
    """The step's largest gradient magnitude that can overflow the compute format: ``compute_max`` where
    recorded, else (older traces, JAX) the largest of every group's."""
    if step.compute_max is not None:
        return step.compute_max
    return step.max_abs() if step.grad_stats else None


def _unscaled_maxima(steps) -> list:
    """Per step, the largest unscaled gradient magnitude; a non-finite step takes its nearest finite
    neighbour's (the earlier one on a tie), None where no step is finite or statistics are absent."""
    own = [_largest(step) / step.scale if _largest(step) is not None and step.scale and math.isfinite(_largest(step))
           and not step.overflow else None for step in steps]
    finite = [i for i, value in enumerate(own) if value is not None]
    if not finite:
        return own
    return [value if value is not None else own[min(finite, key=lambda j: (abs(j - i), j))]
            for i, value in enumerate(own)]


def _decide(step, maximum: Optional[float], scale: float, same_format: bool, overflow_from: float) -> tuple:
    """(overflow, decision) of one recorded step replayed at ``scale``."""
    if same_format:
        if scale == step.scale:
            return step.overflow, "recorded"
        if step.overflow and scale > step.scale:
            return True, "implied"
        if not step.overflow and scale < step.scale:
            return False, "implied"
    if maximum is None:  # nothing finite to scale: keep the run's verdict
        return step.overflow, "estimated"
    return maximum * scale >= overflow_from, "estimated"


def replay(trace, profile: str, *, compute: Optional[str] = None, steps: Optional[int] = None,
           **params) -> ReplayResult:
    """Replay a recorded trace's gradients through ``profile`` with ``params``.

    Args:
      trace: a recorded :class:`~fpemu.traces.Trace`.
      profile: an fpemu profile name (``torch``, ``flax``, ``deepspeed``...).
      compute: the format overflows are decided in; None: the format the run was recorded in.
      steps: replay the first this many attempts; None: all of them.
      **params: the profile's own parameters (the others take its defaults).

    Returns:
      A :class:`ReplayResult`.

    Example::

        run = read_trace("runs/gpt2.json")
        same = replay(run, run.metadata["profile"], **run.metadata["params"])   # the run itself
        flax = replay(run, "flax", growth_interval=40)                          # what flax would have done
    """
    recorded = recorded_steps(trace)
    recorded = recorded if steps is None else recorded[:steps]
    recorded_format = recorder_settings(trace).compute_format
    compute = get_format(compute or recorded_format).name
    same_format = get_format(recorded_format) == get_format(compute)
    overflow_from = format_thresholds(compute)[2]
    chosen = get_profile(profile)
    rules = chosen.rules(**params)
    state, flags, decisions, shadow = rules.init(), [], [], []
    for step, maximum in zip(recorded, _unscaled_maxima(recorded)):
        overflow, decision = _decide(step, maximum, state.scale, same_format, overflow_from)
        flags.append(overflow)
        decisions.append(decision)
        shadow.append(_shadow_counts(step, float(state.scale), compute))
        state = rules.update(state, overflow).state
        if state.stopped:
            break
    result = run_rules(rules, np.array(flags, dtype=bool), chosen.name, {**chosen.defaults, **params})
    kept = shadow[:result.attempts]
    return ReplayResult(result, tuple(decisions[:result.attempts]), compute,
                        shadow=tuple(None if counts is None else {group: share.per(elements) for group, (share, elements)
                                                                  in counts.items()} for counts in kept),
                        shadow_total=tuple(None if counts is None else _total(counts.values()) for counts in kept))


def _shadow_counts(step, scale: float, compute: str) -> Optional[dict]:
    """group -> (ShadowShares of counts, elements) of one step's shadow histograms at ``scale``, or None."""
    if step.shadow_histogram is None:
        return None
    return {group: (histogram.counts(scale, compute), histogram.elements)
            for group, histogram in step.shadow_histogram.items()}


def _total(per_group) -> ShadowShares:
    """Shares of every element of the groups together."""
    per_group = list(per_group)
    return ShadowShares.total(counts for counts, _ in per_group).per(sum(elements for _, elements in per_group))


def file_sha256(path) -> str:
    """The sha256 (hex) of a file's bytes."""
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def pinned_sha256_problem(path, actual: str, pinned: str) -> str:
    """What is wrong with a spec's pinned ``sha256`` of the trace file at ``path`` ('' if it matches).

    Example:
      >>> pinned_sha256_problem("runs/a.json", "ab" * 32, "cd" * 32)[:60]
      'runs/a.json changed since the spec pinned it: its sha256 is '
    """
    if pinned == actual:
        return ""
    return (f"{path} changed since the spec pinned it: its sha256 is {actual}, the spec pins {pinned}; "
            f"replaying it would replay another run (set sha256 = \"{actual}\" to accept the file as it is now)")


def replayed_metadata(scenario) -> dict:
    """``{"replayed": {"trace": ..., "sha256": ..., "compute": ...}}`` for the traces of a scenario whose
    overflow source is ``recorded`` (the file as the spec names it, relative to the spec, the sha256 of
    its bytes when loaded, and the format the replay decides overflows in); {} for any other scenario."""
    source = getattr(scenario, "overflow", None)  # a multi-rank scenario's is a table per rank
    if getattr(source, "kind", None) != "recorded":
        return {}
    relative = os.path.relpath(source.trace, pathlib.Path(scenario.path).parent)
    return {"replayed": {"trace": pathlib.PurePath(relative).as_posix(), "sha256": source.trace_sha256,
                         "compute": source.compute}}


def replayed_file_changed(golden_metadata: dict, current: dict, golden_path) -> str:
    """Why a golden trace replayed from a recorded run no longer fits: the replayed file's sha256
    recorded in ``golden_metadata`` differs from ``current`` (what :func:`replayed_metadata` gives
    now); '' where it fits or either side replays nothing."""
    before, now = golden_metadata.get("replayed"), current.get("replayed")
    if not (before and now) or before["sha256"] == now["sha256"]:
        return ""
    return (f"{golden_path}: golden trace was replayed from another version of {now['trace']} (its sha256 was "
            f"{before['sha256'][:12]}, the file's is now {now['sha256'][:12]}): the recorded run changed")


__all__ = ["DECISIONS", "ReplayResult", "replay", "file_sha256", "pinned_sha256_problem", "replayed_metadata",
           "replayed_file_changed"]
