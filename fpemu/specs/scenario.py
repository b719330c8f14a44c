"""Scenarios: a validated spec, ready to run on the reference model or a real implementation.

A scenario names a scaler profile and its parameters, where the overflow flags
come from (an explicit list, a seeded random process, or a model trained in an
emulated format), how many steps to run, and which real implementations to
drive through it.  Overflow sources are pure: the same scenario always yields
the same flags.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Optional

import numpy as np

OVERFLOW_SOURCES = ("explicit", "bernoulli", "bursts", "periodic", "model", "recorded")


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
      trace: ``recorded``: the recorded run's trace file, whose gradients are replayed (see
        fpemu.traces.replay); compute is then the format the replay decides overflows in, and
        sequence the run's own overflow verdicts.
      trace_sha256: ``recorded``: the sha256 of the trace file as loaded (traces made from the
        scenario record it, so a golden replayed from another version of the file is refused).
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
    trace: str = ""
    trace_sha256: str = ""

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
            raise ValueError(f"overflow source {self.kind!r} is decided by the scaler's scale, not by a flag list")
        for start in starts:
            flags[start:start + self.length] = True
        return flags


@dataclasses.dataclass(frozen=True)
class StepSource:
    """A run of seed 002's mixed-precision step on seeded data (small shapes, B, D, K <= 4).

    Attributes:
      mode: the StepSemantics preset of the golden trace (``jax_cpu_strict``, ``jax_cpu``,
        ``torch_cpu``, ...).
      compute: the compute format.
      batch, features, outputs: B, D and K.
      seed: seed of the initial weights and of every step's data.
      magnitude: data are normal * magnitude * 2^U(-spread, spread): large values overflow
        the scaled gradients, small ones underflow.
      spread: see magnitude.
      lr, growth_interval, init_scale: the step's learning rate, growth interval and first scale.
    """

    mode: str = "jax_cpu_strict"
    compute: str = "bf16"
    batch: int = 2
    features: int = 3
    outputs: int = 2
    seed: int = 0
    magnitude: float = 1.0
    spread: float = 0.0
    lr: float = 0.05
    growth_interval: int = 4
    init_scale: float = 65536.0

    def inputs(self, steps: int):
        """(initial params, [(x, y) per step]) as float32 arrays."""
        rng = np.random.default_rng(self.seed)
        params = {"w": rng.standard_normal((self.features, self.outputs)).astype(np.float32),
                  "b": (0.1 * rng.standard_normal(self.outputs)).astype(np.float32)}

        def data(shape):
            spread = np.exp2(rng.uniform(-self.spread, self.spread, shape))
            return (rng.standard_normal(shape) * self.magnitude * spread).astype(np.float32)

        return params, [(data((self.batch, self.features)), data((self.batch, self.outputs)))
                        for _ in range(steps)]


@dataclasses.dataclass(frozen=True)
class ExpectedDivergence:
    """A documented difference: where the implementation first departs, and why.

    Only a first divergence at exactly this step and field is reported as known; any
    other difference is still a failure.
    """

    step: int
    field: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A real implementation to drive: an adapter name, its parameters, and a declared divergence."""

    name: str
    params: dict
    device: str = "cpu"
    expect_divergence: Optional[ExpectedDivergence] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _ScenarioBase:
    """What every scenario has: its name, its spec, its steps and the real implementations to drive."""

    name: str
    description: str
    steps: int
    implementations: tuple
    record: tuple
    path: str = ""
    sha256: str = ""
    text: str = ""
    # the adapter a golden trace needs (its reference runs on a real run's tensors), None for a pure model
    golden_needs: ClassVar[Optional[str]] = None

    def declared(self, name: str) -> Optional[Implementation]:
        """The spec's own [implementations.NAME] table, if it has one."""
        return next((impl for impl in self.implementations if impl.name == name), None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScalerScenario(_ScenarioBase):
    """A loss scaler profile driven through overflow flags (see :func:`fpemu.specs.load_spec`)."""

    profile: str
    params: dict
    overflow: OverflowSource

    def implementation(self, name: str) -> Implementation:
        """The implementation ``name`` as this scenario drives it: its own table, else the scaler's
        parameters for the profile's own adapter, else the adapter's defaults."""
        from fpemu.adapters import get_adapter
        own = get_adapter(name).profile == self.profile
        return self.declared(name) or Implementation(name, dict(self.params) if own else {})


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepScenario(_ScenarioBase):
    """Seed 002's mixed-precision step run on seeded data (see :func:`fpemu.specs.load_spec`)."""

    step: StepSource

    def implementation(self, name: str) -> Implementation:
        return self.declared(name) or Implementation(name, {})

