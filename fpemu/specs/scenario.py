"""Scenarios: a validated spec, ready to run on the reference model or a real implementation.

A scenario names a scaler profile and its parameters, where the overflow flags
come from (an explicit list, a seeded random process, or a model trained in an
emulated format), how many steps to run, and which real implementations to
drive through it.  Overflow sources are pure: the same scenario always yields
the same flags.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

OVERFLOW_SOURCES = ("explicit", "bernoulli", "bursts", "periodic", "model")


@dataclasses.dataclass(frozen=True)
class OverflowSource:
    """Where a scenario's overflow flags come from.

    Attributes:
      kind: one of ``explicit``, ``bernoulli``, ``bursts``, ``periodic``, ``model``.
      sequence: the flags, for ``explicit``.
      rate: per-step overflow probability (``bernoulli``) or burst-start probability (``bursts``).
      seed: seed of the random processes and of the model's data.
      length: burst length (``bursts``) or overflowing steps per period (``periodic``).
      period, offset: ``periodic``: steps ``offset, offset + period, ...`` start an overflow run.
      model: ``linear`` or ``mlp`` for ``model``; compute: the emulated compute format;
        lr and target_scale: the model's learning rate and the size of its targets (and
        so of its gradients).
    """

    kind: str
    sequence: tuple = ()
    rate: float = 0.0
    seed: int = 0
    length: int = 1
    period: int = 1
    offset: int = 0
    model: str = "linear"
    compute: str = "fp16"
    lr: float = 0.05
    target_scale: float = 1e-3

    def flags(self, steps: int) -> np.ndarray:
        """The overflow flag of each of ``steps`` steps (not for ``model``, which needs the scaler)."""
        if self.kind == "explicit":
            return np.array(self.sequence[:steps], dtype=bool)
        rng = np.random.default_rng(self.seed)
        if self.kind == "bernoulli":
            return rng.random(steps) < self.rate
        flags = np.zeros(steps, dtype=bool)
        if self.kind == "bursts":
            starts = np.flatnonzero(rng.random(steps) < self.rate)
        elif self.kind == "periodic":
            starts = np.arange(self.offset, steps, self.period)
        else:
            raise ValueError(f"overflow source {self.kind!r} is decided by the model, not by a flag list")
        for start in starts:
            flags[start:start + self.length] = True
        return flags


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A real implementation to drive: an adapter name, its parameters, and a declared divergence."""

    name: str
    params: dict
    device: str = "cpu"
    expect_divergence: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class Scenario:
    """A validated scenario (see :func:`fpemu.specs.load_spec`)."""

    name: str
    description: str
    steps: int
    profile: str
    params: dict
    overflow: OverflowSource
    implementations: tuple
    record: tuple
    path: str = ""
    sha256: str = ""
    text: str = ""

    def implementation(self, name: str) -> Implementation:
        for impl in self.implementations:
            if impl.name == name:
                return impl
        return Implementation(name, dict(self.params) if name == self.profile else {})
