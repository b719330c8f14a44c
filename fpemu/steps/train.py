"""Model-driven traces: train a small model in a compute format under a real scaler's rules.

Each step draws a batch, runs the emulated forward and backward pass of ``S * loss``
in the compute format, lets the scaler profile decide from those scaled gradients
whether the step overflowed (``fpemu.scalers.step_overflowed``), and applies the
update only when the profile's rules say so.  Beside it, the same pass in float32
gives the reference gradients whose ``range_stats`` at the step's scale say what
share of the scaled gradients the format flushes to zero, keeps only as
subnormals, or overflows.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from fpemu.formats import FORMATS, RangeStats, range_stats
from fpemu.scalers import get_profile, step_overflowed, unscale
from fpemu.scalers.model import F32_MAX
from fpemu.steps.kernel import F32, Kernel
from fpemu.steps.model import forward_backward, sgd_update
from fpemu.steps.semantics import get_semantics
from fpemu.steps.step import check_int, compute_format, positive_float32

MODELS = ("linear", "mlp")


@dataclasses.dataclass(frozen=True)
class TrainStep:
    """One attempted step.

    Attributes:
      loss: the float32 loss of the batch (before the update).
      scale: the loss scale the step used.
      skipped: the optimizer update did not run.
      grad_stats: ``range_stats`` of the float32 reference gradients times ``scale`` in the
        compute format (None when the scale is not a positive finite float32).
    """

    loss: float
    scale: float
    skipped: bool
    grad_stats: Optional[RangeStats]


@dataclasses.dataclass(frozen=True)
class TrainTrace:
    """What training did, step by step.

    Attributes:
      model, compute, profile, semantics: what was trained, in which format, under which
        scaler profile and which step semantics.
      scaler_params: the profile's parameters, defaults included.
      steps: one :class:`TrainStep` per attempt.
      final_params: ``((w, b), ...)`` float32 master weights after the last step.
    """

    model: str
    compute: str
    profile: str
    semantics: str
    scaler_params: dict
    steps: tuple
    final_params: tuple

    @property
    def losses(self) -> list:
        return [s.loss for s in self.steps]

    @property
    def scales(self) -> list:
        return [s.scale for s in self.steps]

    @property
    def skipped(self) -> list:
        """Indices of the steps whose update did not run."""
        return [i for i, s in enumerate(self.steps) if s.skipped]

    @property
    def skipped_mask(self) -> list:
        """Per step, whether its update did not run."""
        return [s.skipped for s in self.steps]

    @property
    def attempts(self) -> int:
        """Batches processed."""
        return len(self.steps)

    @property
    def completed_updates(self) -> int:
        return self.attempts - self.skipped_updates

    @property
    def skipped_updates(self) -> int:
        return len(self.skipped)

    def shares(self, field: str) -> np.ndarray:
        """Per step, ``field``'s share of the scaled gradients (``"underflow"``, ``"subnormal"``,
        ``"overflow"``); NaN where the step has no statistics."""
        return np.array([s.grad_stats.share(field) if s.grad_stats else np.nan for s in self.steps])


def _init_layers(rng, model: str, features: int, hidden: int, outputs: int, target_scale):
    """He-style normal weights and zero biases; the output layer is scaled to the targets."""
    sizes = [features, outputs] if model == "linear" else [features, hidden, outputs]
    layers = [((rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in)), np.zeros(fan_out))
              for fan_in, fan_out in zip(sizes[:-1], sizes[1:])]
    layers[-1] = (layers[-1][0] * target_scale, layers[-1][1])
    return [(w.astype(F32), b.astype(F32)) for w, b in layers]


def train_trace(model: str = "linear", *, compute: str = "fp16", profile="torch", scaler_params=None,
                steps: int = 50, batch: int = 32, features: int = 8, hidden: int = 16, outputs: int = 4,
                lr: float = 0.05, target_scale: float = 1e-3, seed: int = 0, mode="numpy") -> TrainTrace:
    """Train ``model`` for ``steps`` steps on seeded data and record every step.

    The data: ``x`` standard normal (batch, features); ``y = target_scale * (x @ W)`` for a
    fixed random ``W``.  The output layer starts at ``target_scale`` times a normal
    initialisation, so the output layer's gradients are of the order of ``target_scale``
    (the MLP's first layer's, of its square).

    Args:
      model: ``"linear"`` (the seed's model) or ``"mlp"`` (dense, ReLU, dense).
      compute: compute format (``"fp16"``, ``"bf16"``, ``"fp8_e4m3fn"``, ``"fp8_e5m2"``, ``"fp32"``).
      profile: a scaler profile name (``"torch"``, ``"jmp"``, ``"static"`` for a fixed scale, ...).
      scaler_params: the profile's own parameters (the rest take its defaults).
      steps, batch, features, hidden, outputs: run length and sizes.
      lr, target_scale, seed: learning rate, size of the targets, seed of data and weights.
      mode: step semantics without fitted orders (``"numpy"``, ``"seed"`` or a StepSemantics).

    Returns:
      A :class:`TrainTrace`.

    Example:
      >>> t = train_trace("mlp", compute="fp16", profile="static", steps=3, target_scale=1e-4)
      >>> t.attempts, t.completed_updates, bool(t.shares("underflow")[0] > 0.6)
      (3, 3, True)
    """
    if model not in MODELS:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    semantics = get_semantics(mode)
    if semantics.fitted:
        raise ValueError(f"mode {semantics.name!r} has orders fitted to the seed's small step; "
                         f"use 'numpy', 'seed' or a StepSemantics without xla_cpu/torch_cpu orders")
    fmt = compute_format(compute)
    chosen = get_profile(profile)
    rules = chosen.rules(**(scaler_params or {}))
    for name, value in (("steps", steps), ("batch", batch), ("features", features), ("hidden", hidden),
                        ("outputs", outputs)):
        check_int(value, name, 1)
    lr = positive_float32(lr, "lr")
    target_scale = positive_float32(target_scale, "target_scale")
    check_int(seed, "seed", 0)

    rng = np.random.default_rng(seed)
    layers = _init_layers(rng, model, features, hidden, outputs, float(target_scale))
    teacher = rng.standard_normal((features, outputs)).astype(F32)
    low, reference = Kernel(semantics, fmt), Kernel(semantics, FORMATS["fp32"])
    state, records = rules.init(), []
    for _ in range(steps):
        x = rng.standard_normal((batch, features)).astype(F32)
        y = (x @ teacher * target_scale).astype(F32)
        scale = state.scale
        with np.errstate(over="ignore"):
            scale32 = F32(scale)
        loss, grads = forward_backward(low, layers, x, y, scale32)
        stats = None
        if 0 < scale <= F32_MAX:
            _, exact = forward_backward(reference, layers, x, y, F32(1))
            stats = range_stats(np.concatenate([g.ravel() for pair in exact for g in pair]), fmt, scale)
        flat = np.concatenate([g.ravel() for pair in grads for g in pair])
        outcome = rules.update(state, step_overflowed(flat, scale, chosen))
        if outcome.applied:
            layers = [(sgd_update(low, w, unscale(gw, scale, chosen), lr),
                       sgd_update(low, b, unscale(gb, scale, chosen), lr))
                      for (w, b), (gw, gb) in zip(layers, grads)]
        records.append(TrainStep(float(loss), float(scale), not outcome.applied, stats))
        state = outcome.state
        if state.stopped:
            break
    return TrainTrace(model, fmt.name, chosen.name, semantics.name, {**chosen.defaults, **(scaler_params or {})},
                      tuple(records), tuple(layers))
