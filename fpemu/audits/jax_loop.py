"""Audit the records of a JAX mixed-precision loop: was the loss-scale state carried from step to
step, were updates held back where the gradients were non-finite, was the clipping done on unscaled
gradients, and did the learning-rate schedule advance only with updates?

JAX loops are pure functions, so nothing can be wrapped: the loop appends one record per step,
``(scale_state, grads, update)`` or a :class:`JaxStep` with the optional measurements, and
:func:`audit_jax_loop` checks the sequence.  Records hold numpy or JAX arrays (converted with
``np.asarray``; jax is not imported here) in dicts, lists and tuples; the scale state is a number,
a dict with ``scale`` or a jmp / flax loss-scale object (``fpemu.jax_states`` lists them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np

from fpemu.jax_states import scale_of, state_field, state_kind
from fpemu.audits.findings import AuditResult, LoopAccounting, make_finding

# Relative tolerance between norms computed in float32 in different orders.
_NORM_RTOL = 1e-3


@dataclasses.dataclass(frozen=True)
class JaxStep:
    """One step of a JAX loop, as :func:`audit_jax_loop` reads it.

    Attributes:
      scale_state: the loss scale the step used: a number, a dict with ``scale``, or a jmp/flax state.
      grads: the step's gradients (scaled or unscaled: only their finiteness is read).
      update: the update applied to the parameters (optax's updates, or new minus old parameters;
        None or zeros where the step was skipped).
      grad_norm: the global norm of the unscaled gradients before clipping (``optax.global_norm``).
      clipped_norm: the global norm of the gradients the optimizer received (after clipping).
      clip_norm: the clipping limit (``optax.clip_by_global_norm(clip_norm)``).
      schedule_count: the learning-rate schedule's count after the step (the ``count`` of optax's
        ``ScaleByScheduleState`` / ``ScaleByAdamState`` / ``InjectHyperparamsState``).
    """

    scale_state: Any
    grads: Any
    update: Any
    grad_norm: Optional[float] = None
    clipped_norm: Optional[float] = None
    clip_norm: Optional[float] = None
    schedule_count: Optional[int] = None


def _as_step(record, index: int) -> JaxStep:
    if isinstance(record, JaxStep):
        return record
    if isinstance(record, Mapping):
        try:
            return JaxStep(**record)
        except TypeError:
            names = ", ".join(field.name for field in dataclasses.fields(JaxStep))
            raise TypeError(f"records[{index}] must have keys among {names} (scale_state, grads and update "
                            f"required), got {', '.join(map(str, record))}") from None
    if not isinstance(record, (list, tuple)) or len(record) != 3:
        raise TypeError(f"records[{index}] must be a (scale_state, grads, update) tuple or a JaxStep, "
                        f"got {record!r:.80}")
    return JaxStep(*record)


def _scalar(value) -> Optional[float]:
    return None if value is None else float(np.asarray(value, dtype=np.float64))


def _leaves(tree, where: str) -> list:
    """The arrays of a dict/list/tuple tree (None holds none), as numpy arrays."""
    if tree is None:
        return []
    if isinstance(tree, Mapping):
        return [leaf for key, value in tree.items() for leaf in _leaves(value, f"{where}[{key!r}]")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, value in enumerate(tree) for leaf in _leaves(value, f"{where}[{i}]")]
    array = np.asarray(tree)
    if array.dtype.kind not in "fiub":
        raise TypeError(f"{where} must hold numeric arrays, got {type(tree).__name__}")
    return [array]


def _nonfinite(leaves) -> tuple:
    """(non-finite elements, elements) over the leaves."""
    total = sum(leaf.size for leaf in leaves)
    return sum(int(np.count_nonzero(~np.isfinite(leaf))) for leaf in leaves), total


def _clip_finding(step: int, record: JaxStep, scale: float, update_leaves):
    """clip_before_unscale: the optimizer got min(norm * scale, limit) / scale, not min(norm, limit)."""
    grad_norm, clipped, limit = (_scalar(v) for v in (record.grad_norm, record.clipped_norm, record.clip_norm))
    if None in (grad_norm, clipped, limit) or not np.isfinite(grad_norm) or scale == 1.0:
        return None
    expected = min(grad_norm, limit)
    clipped_scaled = min(grad_norm * scale, limit) / scale
    if clipped >= expected * (1 - _NORM_RTOL) or abs(clipped - clipped_scaled) > _NORM_RTOL * clipped_scaled:
        return None
    update_norm = float(np.sqrt(sum(float(np.sum(np.square(leaf, dtype=np.float64))) for leaf in update_leaves)))
    return make_finding(
        "clip_before_unscale", step, f"clipping of step {step}",
        {"grad_norm": grad_norm, "clip_norm": limit, "clipped_norm": clipped, "expected_norm": expected,
         "shrink": expected / clipped, "update_norm": update_norm},
        f"gradients of norm {grad_norm:.4g} were clipped to {limit:g} while still scaled by {scale:g}: the "
        f"optimizer received norm {clipped:.4g}, {expected / clipped:.4g}x less than clipping after unscaling "
        f"gives ({expected:.4g}); the update it made had norm {update_norm:.4g}")


def _schedule_finding(step: int, count: Optional[int], previous: Optional[int], applied: bool, completed: int):
    """scheduler_on_skipped_update: the schedule's count moved on a step whose update was skipped."""
    if count is None or previous is None or applied or count <= previous:
        return None
    return make_finding(
        "scheduler_on_skipped_update", step, f"optimizer state of step {step}",
        {"schedule_count": count, "completed_updates": completed, "lead": count - completed},
        f"the update of step {step} was skipped, yet the schedule's count advanced {previous} -> {count}: "
        f"the learning rate now runs {count - completed} steps ahead of the {completed} updates made")


def _carried_finding(step: int, states: tuple, scales: tuple, prev_bad: bool, floor: float):
    """scale_not_carried, read from the scale and (where the state has one) the growth counter."""
    (before, after), (previous, scale) = states, scales
    if prev_bad and scale >= previous and previous > floor:
        return make_finding(
            "scale_not_carried", step, f"loss scale of step {step}",
            {"scale_before": previous, "scale_after": scale},
            f"step {step - 1} had non-finite gradients at scale {previous:g}, yet step {step} used "
            f"{scale:g}: the backed-off scale did not reach the next step")
    counters = state_field(before, "counter"), state_field(after, "counter")
    if not prev_bad and scale == previous and None not in counters and int(counters[1]) <= int(counters[0]):
        return make_finding(
            "scale_not_carried", step, f"loss scale of step {step}",
            {"counter_before": int(counters[0]), "counter_after": int(counters[1])},
            f"step {step - 1}'s gradients were finite, yet step {step}'s state counts {int(counters[1])} finite "
            f"steps, as step {step - 1}'s did: the updated state did not reach the next step")
    return None


def audit_jax_loop(records, *, dynamic: Optional[bool] = None,
                   growth_interval: Optional[int] = None) -> AuditResult:
    """Check a JAX loop's per-step records against the loss-scaling contract.

    Findings:
      * ``update_on_nonfinite_grads``: a step whose gradients hold inf/NaN applied a non-zero update.
      * ``scale_not_carried``: the scale did not back off after a step with non-finite gradients
        (unless it sat at the state's floor), the state's growth counter did not move after a finite
        step (jmp's ``counter``, flax's ``fin_steps``), or the scale did not grow after more than
        ``growth_interval`` finite steps at one scale: the state is not passed from step to step.
      * ``clip_before_unscale`` (records with ``grad_norm``, ``clipped_norm`` and ``clip_norm``):
        the optimizer received ``min(norm * scale, limit) / scale``, the clipping of the scaled
        gradients, instead of ``min(norm, limit)``.
      * ``scheduler_on_skipped_update`` (records with ``schedule_count``): the schedule's count
        advanced on a step whose update was skipped (the optimizer state of a skipped step was kept).

    Args:
      records: one record per step: a ``(scale_state, grads, update)`` tuple, a :class:`JaxStep`,
        or a dict of JaxStep's fields.
      dynamic: whether the loop scales dynamically; None infers it from the first state (jmp's
        StaticLossScale and NoOpLossScale are static, anything else dynamic).  Static scales are
        not checked for backoff or growth.
      growth_interval: finite steps after which a dynamic scale must grow (one step of slack for
        implementations that grow a step later); None takes the state's ``period`` /
        ``growth_interval`` where it has one, and otherwise leaves growth unchecked.

    Returns:
      An :class:`~fpemu.audits.AuditResult` (no backward passes or examples in its accounting;
      scheduler steps where the records give the schedule's count).

    Example:
      >>> inf = float("inf")
      >>> records = [(1024.0, [1.0], [-0.1]), (1024.0, [inf], [0.0]), (1024.0, [1.0], [-0.1])]
      >>> [(f.kind, f.step) for f in audit_jax_loop(records).findings]
      [('scale_not_carried', 2)]
      >>> records = [(1024.0, [1.0], [-0.1]), (1024.0, [inf], [inf]), (512.0, [1.0], [-0.1])]
      >>> [(f.kind, f.step) for f in audit_jax_loop(records).findings]
      [('update_on_nonfinite_grads', 1)]
      >>> step = JaxStep(1024.0, [3.0], [-0.001], grad_norm=3.0, clipped_norm=1 / 1024, clip_norm=1.0)
      >>> print(audit_jax_loop([step]).findings[0].detail)
      gradients of norm 3 were clipped to 1 while still scaled by 1024: the optimizer received norm 0.0009766, 1024x less than clipping after unscaling gives (1); the update it made had norm 0.001
    """
    if isinstance(records, (str, bytes, Mapping)) or not hasattr(records, "__iter__"):
        raise TypeError("records must be a sequence of (scale_state, grads, update), "
                        f"got {type(records).__name__}")
    records = [_as_step(record, index) for index, record in enumerate(records)]
    if growth_interval is not None and (isinstance(growth_interval, bool)
                                        or not isinstance(growth_interval, int) or growth_interval < 1):
        raise ValueError(f"growth_interval must be a positive int or None, got {growth_interval!r}")
    first = records[0].scale_state if records else None
    if dynamic is None:
        kind = state_kind(first)
        dynamic = kind is None or kind.dynamic
    if growth_interval is None and first is not None:
        period = state_field(first, "period")
        growth_interval = None if period is None else int(np.asarray(period))
    floor = float(np.asarray(state_field(first, "floor", 0.0)))

    scales = [scale_of(record.scale_state, f"records[{index}][0]") for index, record in enumerate(records)]
    counts = [None if record.schedule_count is None else int(np.asarray(record.schedule_count)) for record in records]
    findings, applied = [], []
    finite_run, prev_bad = 0, False  # finite steps in a row at the current scale; last step non-finite
    for step, record in enumerate(records):
        bad_grads, grad_elements = _nonfinite(_leaves(record.grads, f"records[{step}][1]"))
        update_leaves = _leaves(record.update, f"records[{step}][2]")
        bad_update, update_elements = _nonfinite(update_leaves)
        applied.append(any(np.any(leaf != 0) for leaf in update_leaves))
        if bad_grads and applied[-1]:
            findings.append(make_finding(
                "update_on_nonfinite_grads", step, f"update of step {step}",
                {"nonfinite_grad_share": bad_grads / grad_elements,
                 "nonfinite_update_share": bad_update / update_elements if update_elements else 0.0},
                f"{bad_grads} of {grad_elements} gradient elements were non-finite and the update was applied "
                f"anyway ({bad_update} of {update_elements} update elements non-finite)"))
        found = [_clip_finding(step, record, scales[step], update_leaves),
                 _schedule_finding(step, counts[step], counts[step - 1] if step else None, applied[-1],
                                   sum(applied))]
        if dynamic and step:
            previous, scale = scales[step - 1], scales[step]
            carried = _carried_finding(step, (records[step - 1].scale_state, record.scale_state),
                                       (previous, scale), prev_bad, floor)
            if carried is None and growth_interval is not None and scale == previous and finite_run > growth_interval:
                carried = make_finding(
                    "scale_not_carried", step, f"loss scale of step {step}",
                    {"scale": scale, "finite_steps": finite_run, "growth_interval": growth_interval},
                    f"{finite_run} finite steps at scale {scale:g} and no growth (growth_interval "
                    f"{growth_interval}): the grown scale did not reach the next step")
                finite_run = 0
            found.append(carried)
            if scale != previous:
                finite_run = 0
        findings.extend(finding for finding in found if finding is not None)
        finite_run = 0 if bad_grads else finite_run + 1
        prev_bad = bool(bad_grads)
    completed = sum(applied)
    known_counts = [count for count in counts if count is not None]
    return AuditResult(tuple(findings), LoopAccounting(
        attempts=len(records), completed_updates=completed, skipped_updates=len(records) - completed,
        scheduler_steps=known_counts[-1] if known_counts else None))


__all__ = ["JaxStep", "audit_jax_loop"]
