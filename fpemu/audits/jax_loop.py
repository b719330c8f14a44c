"""Audit the records of a JAX mixed-precision loop: was the loss-scale state carried from step to
step, and were updates held back where the gradients were non-finite?

JAX loops are pure functions, so nothing can be wrapped: the loop appends one record per step,
``(scale_state, grads, update)``, and :func:`audit_jax_loop` checks the sequence.  Records hold
numpy or JAX arrays (converted with ``np.asarray``; jax is not imported here) in dicts, lists and
tuples; the scale state is a number or a jmp / flax loss-scale object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import numpy as np

from fpemu.audits.findings import AuditResult, LoopAccounting, make_finding

# attribute of a loss-scale state -> what it holds; jmp's classes first, then flax's DynamicScale
_SCALE_ATTRS = ("loss_scale", "scale")
_PERIOD_ATTRS = ("period", "growth_interval")
_FLOOR_ATTRS = ("min_loss_scale", "minimum_scale")


def _attr(state, names, default=None):
    return next((getattr(state, name) for name in names if hasattr(state, name)), default)


def _scale_value(state, index: int) -> float:
    try:
        value = np.asarray(_attr(state, _SCALE_ATTRS, state), dtype=np.float64)
    except (TypeError, ValueError):
        value = np.array(np.nan)
    if value.size != 1 or not np.isfinite(value) or value <= 0:
        raise ValueError(f"records[{index}][0] must be a positive loss scale or a jmp/flax loss-scale state, "
                         f"got {state!r}")
    return float(value)


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


def audit_jax_loop(records, *, dynamic: Optional[bool] = None,
                   growth_interval: Optional[int] = None) -> AuditResult:
    """Check a JAX loop's per-step records against the loss-scaling contract.

    Findings:
      * ``update_on_nonfinite_grads``: a step whose gradients hold inf/NaN applied a non-zero update.
      * ``scale_not_carried``: the scale did not back off after a step with non-finite gradients
        (unless it sat at the state's floor), or did not grow after more than ``growth_interval``
        finite steps at one scale: the state is not passed from one step to the next.

    Args:
      records: one ``(scale_state, grads, update)`` per step: the loss scale the step used (a number,
        or a jmp/flax state), its gradients, and the update applied to the parameters (optax's
        updates, or new minus old parameters; None or zeros where the step was skipped).
      dynamic: whether the loop scales dynamically; None infers it from the first state (jmp's
        StaticLossScale and NoOpLossScale are static, anything else dynamic).  Static scales are
        not checked for backoff or growth.
      growth_interval: finite steps after which a dynamic scale must grow (one step of slack for
        implementations that grow a step later); None takes the state's ``period`` /
        ``growth_interval`` where it has one, and otherwise leaves growth unchecked.

    Returns:
      An :class:`~fpemu.audits.AuditResult` (no backward passes, examples or scheduler steps in its accounting).

    Example:
      >>> inf = float("inf")
      >>> records = [(1024.0, [1.0], [-0.1]), (1024.0, [inf], [0.0]), (1024.0, [1.0], [-0.1])]
      >>> [(f.kind, f.step) for f in audit_jax_loop(records).findings]
      [('scale_not_carried', 2)]
      >>> records = [(1024.0, [1.0], [-0.1]), (1024.0, [inf], [inf]), (512.0, [1.0], [-0.1])]
      >>> [(f.kind, f.step) for f in audit_jax_loop(records).findings]
      [('update_on_nonfinite_grads', 1)]
    """
    if isinstance(records, (str, bytes, Mapping)) or not hasattr(records, "__iter__"):
        raise TypeError("records must be a sequence of (scale_state, grads, update), "
                        f"got {type(records).__name__}")
    records = list(records)
    for index, record in enumerate(records):
        if not isinstance(record, (list, tuple)) or len(record) != 3:
            raise TypeError(f"records[{index}] must be a (scale_state, grads, update) tuple, "
                            f"got {record!r:.80}")
    if growth_interval is not None and (isinstance(growth_interval, bool)
                                        or not isinstance(growth_interval, int) or growth_interval < 1):
        raise ValueError(f"growth_interval must be a positive int or None, got {growth_interval!r}")
    first = records[0][0] if records else None
    if dynamic is None:
        dynamic = not (hasattr(first, "loss_scale") and not hasattr(first, "period"))
    if growth_interval is None and first is not None:
        period = _attr(first, _PERIOD_ATTRS)
        growth_interval = None if period is None else int(np.asarray(period))
    floor = float(np.asarray(_attr(first, _FLOOR_ATTRS, 0.0)))

    scales = [_scale_value(record[0], index) for index, record in enumerate(records)]
    findings, applied = [], []
    finite_run, prev_bad = 0, False  # finite steps in a row at the current scale; last step non-finite
    for step, (_, grads, update) in enumerate(records):
        bad_grads, grad_elements = _nonfinite(_leaves(grads, f"records[{step}][1]"))
        update_leaves = _leaves(update, f"records[{step}][2]")
        bad_update, update_elements = _nonfinite(update_leaves)
        applied.append(any(np.any(leaf != 0) for leaf in update_leaves))
        if bad_grads and applied[-1]:
            findings.append(make_finding(
                "update_on_nonfinite_grads", step, f"update of step {step}",
                {"nonfinite_grad_share": bad_grads / grad_elements,
                 "nonfinite_update_share": bad_update / update_elements if update_elements else 0.0},
                f"{bad_grads} of {grad_elements} gradient elements were non-finite and the update was applied "
                f"anyway ({bad_update} of {update_elements} update elements non-finite)"))
        if dynamic and step:
            previous, scale = scales[step - 1], scales[step]
            if prev_bad and scale >= previous and previous > floor:
                findings.append(make_finding(
                    "scale_not_carried", step, f"loss scale of step {step}",
                    {"scale_before": previous, "scale_after": scale},
                    f"step {step - 1} had non-finite gradients at scale {previous:g}, yet step {step} used "
                    f"{scale:g}: the backed-off scale did not reach the next step"))
            elif growth_interval is not None and scale == previous and finite_run > growth_interval:
                findings.append(make_finding(
                    "scale_not_carried", step, f"loss scale of step {step}",
                    {"scale": scale, "finite_steps": finite_run, "growth_interval": growth_interval},
                    f"{finite_run} finite steps at scale {scale:g} and no growth (growth_interval "
                    f"{growth_interval}): the grown scale did not reach the next step"))
                finite_run = 0
            if scale != previous:
                finite_run = 0
        finite_run = 0 if bad_grads else finite_run + 1
        prev_bad = bool(bad_grads)
    completed = sum(applied)
    return AuditResult(tuple(findings), LoopAccounting(attempts=len(records), completed_updates=completed,
                                                       skipped_updates=len(records) - completed))


__all__ = ["audit_jax_loop"]
