"""What an emulated run's rounding did, per op and per module, forward and backward (no framework).

Each rounding of an op's result to the low format reports five counts (``COUNTERS``): the
elements rounded, those that underflowed (nonzero before rounding, zero after), became subnormal,
overflowed (finite before, infinite after, or NaN where the format has no infinity) or became NaN.
:class:`Telemetry` sums them per (direction, op) and per (direction, module) and keeps the first
op and module whose result held an inf or NaN in each direction.  A torch or JAX emulator feeds it
through :meth:`Telemetry.record`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

COUNTERS = ("elements", "underflow", "subnormal", "overflow", "nan")
ROOT = "<root>"  # the module of an op outside every module
DIRECTIONS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class NonFinite:
    """The first op whose result held an inf or NaN in one direction.

    Attributes:
      direction: ``forward`` or ``backward``.
      op: the op's name (``aten::sum.dim_IntList``).
      module: the module it ran in (``transformer.h.3.mlp.c_proj``; ``<root>`` outside any).
      step: the training step (0 outside a loop).
      produced: ``overflow`` (rounding made it infinite) or ``nan`` / ``inf`` (the float32 result already was).
    """

    direction: str
    op: str
    module: str
    step: int
    produced: str


@dataclasses.dataclass(frozen=True)
class TelemetrySummary:
    """A snapshot of :class:`Telemetry`: plain dicts of count tuples (``COUNTERS`` order)."""

    by_op: dict
    by_module: dict
    first_nonfinite: dict
    float32_ops: tuple

    def share(self, key: tuple, counter: str = "underflow", table: str = "by_module") -> float:
        """``counter`` / elements for ``key`` (``(direction, name)``) in ``by_module`` or ``by_op``; 0 if none."""
        counts = getattr(self, table).get(key)
        if not counts or not counts[0]:
            return 0.0
        return counts[COUNTERS.index(counter)] / counts[0]

    def totals(self, direction: str) -> tuple:
        """The counts summed over every op of ``direction``."""
        rows = [counts for (way, _), counts in self.by_op.items() if way == direction]
        return tuple(sum(column) for column in zip(*rows)) if rows else (0,) * len(COUNTERS)

    def as_dict(self) -> dict:
        """JSON values: ``{"by_op": {"backward": {"aten::mm": {"elements": ..., ...}}}, ...}``."""
        def table(source):
            out = {}
            for (direction, name), counts in sorted(source.items()):
                out.setdefault(direction, {})[name] = dict(zip(COUNTERS, counts))
            return out
        return {"by_op": table(self.by_op), "by_module": table(self.by_module),
                "first_nonfinite": {d: dataclasses.asdict(e) for d, e in sorted(self.first_nonfinite.items())},
                "float32_ops": list(self.float32_ops)}


class Telemetry:
    """The accumulator an emulator writes into while it runs (not thread-safe; one per run)."""

    def __init__(self):
        self.step = 0
        self.location = None  # the module the emulator runs now (an error names it), None outside any
        self._by_op, self._by_module, self._first = {}, {}, {}
        self._float32_ops = set()
        self.fp8_casts = []  # this step's fp8 casts in call order: (name, amax, scale)

    def record(self, direction: str, op: str, module: str, counts, nonfinite: Optional[str] = None) -> None:
        """Add one rounding's ``counts`` (``COUNTERS`` order); ``nonfinite``: ``overflow``, ``inf`` or
        ``nan`` when its result held one."""
        self._add(self._by_op, (direction, op), counts)
        self._add(self._by_module, (direction, module), counts)
        if nonfinite is not None and direction not in self._first:
            self._first[direction] = NonFinite(direction, op, module, self.step, nonfinite)

    def record_fp8(self, name: str, amax: float, scale: float) -> None:
        """Note one fp8 cast of this step: the tensor's name, the amax it contributed and the scale it was
        cast with (float32 values)."""
        self.fp8_casts.append((name, amax, scale))

    def left_in_float32(self, op: str) -> None:
        """Note an op the policy ran in float32 (listed in the trace)."""
        self._float32_ops.add(op)

    def summary(self) -> TelemetrySummary:
        return TelemetrySummary({k: tuple(v) for k, v in self._by_op.items()},
                                {k: tuple(v) for k, v in self._by_module.items()},
                                dict(self._first), tuple(sorted(self._float32_ops)))

    def merge(self, summary: TelemetrySummary) -> None:
        """Add a snapshot's counts, first non-finite ops and float32 ops (a run's total from its steps)."""
        for (direction, op), counts in summary.by_op.items():
            self._add(self._by_op, (direction, op), counts)
        for key, counts in summary.by_module.items():
            self._add(self._by_module, key, counts)
        for direction, event in summary.first_nonfinite.items():
            self._first.setdefault(direction, event)
        self._float32_ops.update(summary.float32_ops)

    @staticmethod
    def _add(table: dict, key, counts) -> None:
        row = table.get(key)
        if row is None:
            table[key] = list(counts)
        else:
            for index, value in enumerate(counts):
                row[index] += value

    def reset_step(self, step: int) -> None:
        """Start counting step ``step`` afresh (the first-nonfinite records are kept)."""
        self.step = step
        self._by_op, self._by_module = {}, {}
        self.fp8_casts = []
