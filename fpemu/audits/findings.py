"""What a training-loop audit reports: findings with their measured effect, and the step accounting.

Shared by the torch and JAX audits; imports nothing beyond the standard library.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

# kind -> the fix, one sentence each.
FIXES = {
    "clip_before_unscale":
        "Call scaler.unscale_(optimizer) before clipping (JAX: loss_scale.unscale(grads) before "
        "optax.clip_by_global_norm), so the limit applies in the gradient's own units.",
    "unscale_twice":
        "Call scaler.unscale_(optimizer) at most once between backward passes and scaler.step(optimizer), "
        "and call scaler.update() only after scaler.step().",
    "manual_unscale":
        "Leave the unscaling to scaler.unscale_(optimizer) or scaler.step(optimizer); do not divide .grad by "
        "scaler.get_scale() yourself.",
    "backward_after_unscale":
        "Run every backward pass of the step before scaler.unscale_(optimizer); unscale once, just before "
        "clipping and scaler.step(optimizer).",
    "gradients_carried_across_steps":
        "Zero the gradients after every scaler.step(optimizer), or accumulate microbatches without stepping "
        "and call scaler.step and scaler.update only at the accumulation boundary.",
    "zero_grad_between_microbatches":
        "Call optimizer.zero_grad() once per update, after scaler.step(optimizer) and scaler.update() (or before "
        "the first microbatch), never between the backward passes that accumulate into it.",
    "scale_changed_in_accumulation":
        "Keep one scale through the accumulated microbatches: call scaler.update() (and step every optimizer "
        "that shares the scaler) only at effective-batch boundaries.",
    "scheduler_on_skipped_update":
        "Step the LR scheduler only when the optimizer update ran (for example when scaler.get_scale() did not "
        "decrease in scaler.update(); JAX: keep the skipped step's optimizer state too, with "
        "jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state)) or optax.apply_if_finite), "
        "or define the schedule on attempts and say so.",
    "all_updates_skipped":
        "Find the source of the non-finite gradients (inputs, loss, forward overflow) or a format whose range "
        "fits the model (fpemu.audits.advise_loss_scale), before training further.",
    "fp16_autocast_without_scaler":
        "Use torch.amp.GradScaler with fp16 autocast, or autocast to bf16 instead.",
    "scaler_under_bf16":
        "Drop the GradScaler (or construct it with enabled=False) under bf16 autocast: bf16 has float32's "
        "range.",
    "scale_not_carried":
        "Return the new loss-scale state from the train step and pass it into the next step.",
    "found_inf_not_reduced":
        "Use ShardedGradScaler (it all-reduces found-inf over its process group), or all-reduce found-inf with "
        "MAX over every rank that shares the parameters before scaler.update().",
    "ranks_disagree":
        "Reduce found-inf across every rank that shares parameters (ShardedGradScaler, or FSDP2's DTensor "
        "gradients) and find the rank-local source of the non-finite gradient.",
    "update_on_nonfinite_grads":
        "Apply the update only where the gradients are finite: torch: step through scaler.step(optimizer), not "
        "optimizer.step(); JAX: jmp.select_tree(grads_finite, new, old) or optax.apply_if_finite.",
}


@dataclasses.dataclass(frozen=True)
class Finding:
    """One breach of the mixed-precision contract, where it happened and what it did.

    Attributes:
      kind: what went wrong, a key of ``fpemu.audits.FIXES``.
      step: the index of the update attempt it happened in (0-based, per optimizer).
      call: the call that broke the contract, as the user wrote it.
      effect: the measured effect, name -> number (or tuple of numbers).
      detail: one sentence with those numbers.
      fix: one sentence saying what to do.
    """

    kind: str
    step: int
    call: str
    effect: dict
    detail: str
    fix: str

    def __str__(self) -> str:
        return f"[{self.kind}] step {self.step}, {self.call}: {self.detail} Fix: {self.fix}"

    @property
    def measurable(self) -> bool:
        """Every number of its effect is finite (at an overflowed step a norm or error is inf/NaN)."""
        values = [v for value in self.effect.values() for v in (value if isinstance(value, tuple) else (value,))]
        return all(math.isfinite(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool))


def make_finding(kind: str, step: int, call: str, effect: dict, detail: str) -> Finding:
    """A Finding with the fix for ``kind``."""
    return Finding(kind=kind, step=int(step), call=call, effect=dict(effect), detail=detail, fix=FIXES[kind])


@dataclasses.dataclass(frozen=True)
class LoopAccounting:
    """The clocks of a training loop, which differ as soon as one update is skipped.

    Attributes:
      attempts: update attempts (``scaler.step`` calls, or ``optimizer.step`` calls without a scaler).
      completed_updates: attempts whose optimizer update ran.
      skipped_updates: attempts whose update was skipped for non-finite gradients.
      backward_passes: backward passes (microbatches), None where not observed.
      examples: examples processed, None where the batch size was not given.
      scheduler_steps: LR scheduler steps, None where not observed.
    """

    attempts: int
    completed_updates: int
    skipped_updates: int
    backward_passes: Optional[int] = None
    examples: Optional[int] = None
    scheduler_steps: Optional[int] = None

    def summary(self) -> str:
        parts = [f"{self.attempts} attempts", f"{self.completed_updates} completed updates",
                 f"{self.skipped_updates} skipped"]
        for label, value in (("backward passes", self.backward_passes), ("examples", self.examples),
                             ("scheduler steps", self.scheduler_steps)):
            if value is not None:
                parts.append(f"{value} {label}")
        return ", ".join(parts)


@dataclasses.dataclass(frozen=True)
class AuditResult:
    """Findings of one audited loop, its accounting, and which attempts were skipped at which scale.

    Example:
      >>> result = AuditResult((), LoopAccounting(attempts=100, completed_updates=90, skipped_updates=10))
      >>> print(result.summary())
      100 attempts, 90 completed updates, 10 skipped
      No findings.
    """

    findings: tuple
    accounting: LoopAccounting
    skipped_steps: tuple = ()  # the attempts whose update was skipped (torch: the first optimizer's)
    scales: tuple = ()  # the loss scale at each attempt, where the audit reads it

    @property
    def kinds(self) -> set:
        """The kinds of finding present."""
        return {finding.kind for finding in self.findings}

    def of_kind(self, kind: str) -> tuple:
        """The findings of ``kind``, in the order they happened."""
        if kind not in FIXES:
            raise ValueError(f"kind must be one of {', '.join(FIXES)}, got {kind!r}")
        return tuple(finding for finding in self.findings if finding.kind == kind)

    def summary(self) -> str:
        """The accounting, then per kind: how often, at which steps, the first occurrence and the fix."""
        lines = [self.accounting.summary()]
        if not self.findings:
            return "\n".join(lines + ["No findings."])
        for kind in sorted(self.kinds, key=list(FIXES).index):
            found = self.of_kind(kind)
            steps = ", ".join(str(f.step) for f in found[:10]) + (", ..." if len(found) > 10 else "")
            measurable = [f for f in found if f.measurable]
            shown = measurable[0] if measurable else found[0]
            first = "first" if shown is found[0] else f"first measurable (step {shown.step})"
            line = f"{kind}: {len(found)}x at step {steps}; {first}: {shown.call}: {shown.detail}"
            if measurable and len(measurable) < len(found):
                line += (f" ({len(found) - len(measurable)} at steps whose gradients held inf/NaN, where its "
                         f"size has no value)")
            lines.append(line)
            lines.append(f"  fix: {shown.fix}")
        return "\n".join(lines)
