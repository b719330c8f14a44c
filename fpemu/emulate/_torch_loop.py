"""The loss-scale loop: N steps of a user's torch step function under a scaler profile, emulated.

The step function uses the ``torch.amp.GradScaler`` interface (``scale``, ``unscale_``, ``step``,
``update``, ``get_scale``); :class:`EmulatedScaler` implements it with fpemu's reference model of
the chosen profile: its unscale arithmetic and inf check (``fpemu.unscale``, ``step_overflowed``)
and its rules (:class:`fpemu.scalers.ScalerRules`).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils._python_dispatch import _disable_current_modes

from fpemu.emulate.policy import scaler_rules
from fpemu.emulate.telemetry import Telemetry
from fpemu.emulate.trace import StepRecord
from fpemu.errors import FpemuInputError, raised
from fpemu.scalers import step_overflowed, unscale


class EmulatedScaler:
    """A GradScaler look-alike following fpemu's model of a scaler profile.

    Args:
      profile: a profile name (``torch``, ``deepspeed``, ``megatron``, ...).
      params: the implementation's own parameters (``init_scale``, ``growth_interval``, ...).

    Example::

        scaler = EmulatedScaler("torch", {"init_scale": 2.0**16})
        scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()
    """

    def __init__(self, profile="torch", params=None):
        self.profile, self.rules = scaler_rules(profile, params)
        self.state = self.rules.init()
        self._unscaled, self._overflow, self.updates = False, None, 0
        # torch's GradScaler.get_scale() returns init_scale as given (a Python float) until the first
        # scale() makes its float32 scale tensor: 3.3e35 then, 3.2999999e35 after (torch 2.13,
        # torch/amp/grad_scaler.py); a harness reading a drop in the scale as an overflow sees one
        self._given_scale = (float(params["init_scale"]) if self.profile.name == "torch" and params
                             and "init_scale" in params else None)

    def get_scale(self) -> float:
        """The scale, as the profile's scaler reports it (see ``_given_scale``)."""
        return self._given_scale if self._given_scale is not None else self.state.scale

    def scale(self, outputs):
        """outputs times the scale (a float32 multiply, as GradScaler's)."""
        self._given_scale = None
        return outputs * torch.tensor(self.state.scale, dtype=torch.float32)

    def unscale_(self, optimizer) -> None:
        """Check the scaled gradients and unscale them in place, with the profile's arithmetic."""
        if self._unscaled:
            raise FpemuInputError("unscale_() was already called on this optimizer since the last update()")
        with _disable_current_modes(), torch.no_grad():
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            arrays = [g.detach().float().numpy() for g in grads]
            flat = np.concatenate([a.ravel() for a in arrays]) if arrays else np.zeros(0, np.float32)
            self._overflow = bool(step_overflowed(flat, self.state.scale, self.profile))
            for grad, array in zip(grads, arrays):
                grad.copy_(torch.from_numpy(np.ascontiguousarray(unscale(array, self.state.scale, self.profile))))
        self._unscaled = True

    def step(self, optimizer, *args, **kwargs):
        """The optimizer step, skipped when the gradients overflowed (as the profile decides)."""
        if not self._unscaled:
            self.unscale_(optimizer)
        if self._overflow:
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        if self._overflow is None:
            raise FpemuInputError("update() before step() or unscale_(): the step's gradients were never checked")
        self.last_overflow = self._overflow
        self.state = self.rules.update(self.state, self._overflow).state
        self._unscaled, self._overflow = False, None
        self.updates += 1


def run_steps(step, model, optimizer, *, steps: int, policy, profile="torch", params=None, where="step",
              on_step=None):
    """Run ``step(model, optimizer, scaler, index)`` ``steps`` times under ``policy`` (``on_step(index)``
    before each: fpemu.emulate.isolated times each step by it).

    Returns:
      (list of :class:`StepRecord`, the whole run's TelemetrySummary).

    Raises:
      FpemuInputError: an op the policy cannot place; a step that raised (naming ``where``, the step and
        the module it raised in); a step that never called ``scaler.update()``.
    """
    from fpemu.emulate._torch_mode import emulate_torch
    scaler = EmulatedScaler(profile, params)
    records, whole = [], Telemetry()
    telemetry = Telemetry()
    with emulate_torch(policy, model=model, telemetry=telemetry):
        for index in range(steps):
            if on_step is not None:
                on_step(index)
            telemetry.reset_step(index)
            telemetry.location = None
            before = scaler.updates
            try:
                loss = step(model, optimizer, scaler, index)
            except Exception as error:
                module = f" (in module {telemetry.location})" if telemetry.location else ""
                if isinstance(error, FpemuInputError):  # an op the policy cannot place, or scaler misuse
                    raise FpemuInputError(f"{where}: step {index}{module}: {error}") from error
                raise FpemuInputError(
                    f"{where}: step {index} raised {raised(error)}{module}") from error
            if scaler.updates != before + 1:
                raise FpemuInputError(f"{where}: step {index} called scaler.update() {scaler.updates - before} "
                                      "times; a step calls it once (after scaler.step(optimizer))")
            summary = telemetry.summary()
            whole.merge(summary)
            records.append(StepRecord(scaler.last_overflow, _loss_value(loss, where, index), summary,
                                      tuple(telemetry.fp8_casts)))
            if scaler.state.stopped:
                break
    return records, whole.summary()


def _loss_value(loss, where: str, index: int) -> float:
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return float(loss.detach().float())
    if isinstance(loss, (int, float)):
        return float(loss)
    raise FpemuInputError(f"{where}: step {index} returned {type(loss).__name__}; it returns the loss "
                          "(a scalar tensor)")
