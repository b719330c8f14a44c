"""Step scenarios: seed 002's mixed-precision step iterated on seeded data.

A step spec::

    description = "bf16 step, paired dot order"
    steps = 4

    [step]
    mode = "jax_cpu"                      # fpemu.steps.SEMANTICS: how the step rounds and orders its sums
    compute = "bf16"
    batch = 2                             # 1..4: the fitted step orders
    seed = 0

    [implementations.jax_step]            # the real step (params: the adapter's own, e.g. its mode)
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fpemu.adapters import STEP, get_adapter
from fpemu.kinds.scenario import Implementation, ScenarioBase
from fpemu.kinds.schema import Checker, build_scenario, implementation_tables, record_fields
from fpemu.steps.semantics import get_semantics
from fpemu.steps.step import checked_compute

STEP_MODES = ("jax_cpu_strict", "jax_cpu", "torch_cpu", "torch_cpu_grad_scaler", "torch_cpu_compiled", "seed")
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepScenario(ScenarioBase):
    """Seed 002's mixed-precision step run on seeded data (see :func:`fpemu.specs.load_spec`)."""

    step: StepSource

    def implementation(self, name: str) -> Implementation:
        return self.declared(name) or Implementation(name, {})



def _step_source(check: Checker, raw) -> StepSource:
    keys = {f.name for f in dataclasses.fields(StepSource)}
    check.table(raw, "step", keys)
    fields = {}
    if "mode" in raw:
        fields["mode"] = check.choice(raw["mode"], "step.mode", STEP_MODES)
    if "compute" in raw:
        mode = fields.get("mode", StepSource.mode)
        fields["compute"] = check.choice(raw["compute"], "step.compute", checked_compute(get_semantics(mode)))
    for key in ("batch", "features", "outputs"):
        if key in raw:
            fields[key] = check.integer(raw[key], f"step.{key}", 1)  # 1..4, the fitted step orders: fpemu.kinds.bounds
    for key, low, high in (("magnitude", 1e-30, 1e30), ("spread", 0.0, 100.0), ("lr", 1e-12, 1e30),
                           ("init_scale", 1e-30, 3.2e38)):
        if key in raw:
            fields[key] = check.number(raw[key], f"step.{key}", low, high)
    for key in ("seed", "growth_interval"):
        if key in raw:
            fields[key] = check.integer(raw[key], f"step.{key}", 0 if key == "seed" else 1)
    return StepSource(**fields)


def _step_implementations(check: Checker, raw) -> tuple:
    out = []
    for key, adapter, device, body, reason in implementation_tables(check, raw, STEP):
        accepted = get_adapter(adapter).params
        params = check.table(body.get("params", {}), f"{key}.params", accepted)
        for param, value in params.items():
            check.choice(value, f"{key}.params.{param}", accepted[param])
        out.append(Implementation(adapter, dict(params), device, reason))
    return tuple(out)


def parse_step_spec(check: Checker, raw: dict, text: str, path: str) -> StepScenario:
    """Validate a spec with a [step] table (``check``: the loader's checker, which names the file)."""
    if not isinstance(raw["step"], dict):
        check.fail("step", f"expected a [step] table (the step scenario's settings), got {raw['step']!r}; "
                           "the number of steps is `steps`")
    if "steps" not in raw:
        check.fail("steps", "missing required key")
    for key in ("scaler", "overflow"):
        if key in raw:
            check.attempt(check.fail, key, "a [step] scenario has its own scale rule and data; remove this table")
    steps = check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw else None
    step = check.attempt(_step_source, check, raw["step"])
    implementations = check.attempt(_step_implementations, check, raw.get("implementations", {}))
    record = check.attempt(record_fields, check, raw, "step")
    check.raise_errors()
    return build_scenario(check, StepScenario, raw, text, path, steps=steps, step=step,
                     implementations=implementations, record=record)
