"""The JAX loss-scale states fpemu reads, one row each: where each keeps its scale, growth counter,
growth period and floor.  The JAX recorder and ``audit_jax_loop`` both read states through this table.

No framework is imported: a state is matched by its class's module and name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

import numpy as np


@dataclasses.dataclass(frozen=True)
class ScaleState:
    """Where one loss-scale state class keeps its fields (None: it has no such field).

    Attributes:
      package: the package that defines it (its top-level module).
      cls: the class name.
      scale, counter, period, floor: attribute names of the loss scale, the count of finite steps
        since the last change, the number of finite steps after which it grows, and its minimum.
      dynamic: whether the scale adapts to overflows.
    """

    package: str
    cls: str
    scale: str
    counter: Optional[str]
    period: Optional[str]
    floor: Optional[str]
    dynamic: bool


SCALE_STATES = (
    ScaleState("jmp", "DynamicLossScale", "loss_scale", "counter", "period", "min_loss_scale", True),
    ScaleState("jmp", "StaticLossScale", "loss_scale", None, None, None, False),
    ScaleState("jmp", "NoOpLossScale", "loss_scale", None, None, None, False),
    ScaleState("flax", "DynamicScale", "scale", "fin_steps", "growth_interval", "minimum_scale", True),
)
# A plain mapping (Keras' LossScaleOptimizer keeps its state in variables: see keras_scale_state).
MAPPING_STATE = ScaleState("", "Mapping", "scale", "growth_counter", "growth_interval", "minimum_scale", True)


def state_kind(state) -> Optional[ScaleState]:
    """The table row of ``state`` (MAPPING_STATE for a dict), None for a number or an unknown object."""
    if isinstance(state, Mapping):
        return MAPPING_STATE
    package = type(state).__module__.partition(".")[0]
    return next((row for row in SCALE_STATES if row.package == package and row.cls == type(state).__name__),
                None)


def state_field(state, field: str, default=None):
    """One field (``scale``, ``counter``, ``period``, ``floor``) of a loss-scale state, or ``default``."""
    row = state_kind(state)
    name = None if row is None else getattr(row, field)
    if name is None:
        return default
    value = state.get(name, default) if isinstance(state, Mapping) else getattr(state, name, default)
    return default if value is None else value


def scale_of(state, where: str) -> float:
    """The loss scale a state (or a plain number) holds, as a float; a clear error otherwise."""
    raw = state_field(state, "scale", state)
    try:
        value = np.asarray(raw, dtype=np.float64)
    except (TypeError, ValueError):
        value = np.array(np.nan)
    if value.size != 1 or not np.isfinite(value) or value <= 0:
        names = ", ".join(f"{row.package}.{row.cls}" for row in SCALE_STATES)
        raise ValueError(f"{where} must be a positive loss scale, a dict with 'scale', or one of {names}; "
                         f"got {state!r:.120}")
    return float(value)
