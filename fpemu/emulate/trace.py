"""An emulated training run as a trace v1 (no framework): the scale trajectory, skips, shares, modules.

The step records hold the model-trace fields (``fpemu.traces.fields.FIELDS`` recorded by ``model``):
scale, overflow, applied, growth_counter, loss and the underflow / subnormal / overflow shares of the
values the backward pass rounded, plus ``module_underflow`` and ``module_underflow_forward``: each
module's underflow share in the backward and the forward pass (``fpemu compare`` compares the
table's fields; the module shares are for the report).  Under an fp8 placement each step also holds the
fields recorded by ``emulated``: every fp8 cast's name (``fp8_casts``), the amax of its tensor
(``tensor_amax``) and the scale it was cast with (``tensor_scale``), a one-value list per cast.  The
metadata names the model file (its text and sha256 as the spec), the policy with its op table, the
scaler profile and its parameters, and the run's telemetry totals.  Nothing of the host is recorded,
so an emulated trace regenerated elsewhere is byte-identical and serves as a golden.
"""

from __future__ import annotations

import dataclasses
import hashlib

from fpemu.host import host_provenance
from fpemu.emulate.telemetry import COUNTERS, TelemetrySummary
from fpemu.scalers import get_profile, simulate_scaler
from fpemu.traces import Trace
from fpemu.traces.fields import fields_recorded_by
from fpemu.traces.layout import fp8_cast_fields, trace_steps, trace_summary
from fpemu.version import __version__

IMPLEMENTATION = "emulate_torch@cpu"


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What one emulated step did.

    Attributes:
      overflow: the scaler saw non-finite gradients.
      loss: the step's loss (float).
      telemetry: the step's :class:`TelemetrySummary`.
      fp8_casts: under an fp8 placement, each fp8 cast of the step in call order: (its name, the
        tensor's amax, the scale it was cast with).
    """

    overflow: bool
    loss: float
    telemetry: TelemetrySummary
    fp8_casts: tuple = ()


def _shares(summary: TelemetrySummary) -> dict:
    elements, *counts = summary.totals("backward")
    named = dict(zip(COUNTERS[1:], counts))
    share = (lambda n: n / elements) if elements else (lambda n: 0.0)
    return {"underflow_share": share(named["underflow"]), "subnormal_share": share(named["subnormal"]),
            "overflow_share": share(named["overflow"])}


def module_underflow(summary: TelemetrySummary, direction: str = "backward") -> dict:
    """``{module: underflow share}`` of one step's roundings in ``direction``."""
    return {name: summary.share((way, name)) for way, name in sorted(summary.by_module) if way == direction}


def emulation_trace(records, *, profile: str, params: dict, model_name: str, model_text: str, policy: dict,
                    op_table: dict, packages: dict, run_telemetry: TelemetrySummary,
                    implementation: str = IMPLEMENTATION) -> Trace:
    """The trace of an emulated run from its step records (any emulator: ``implementation`` names it,
    ``emulate_torch@cpu`` by default).

    The scaler columns come from ``simulate_scaler`` over the steps' overflow flags: the same rules
    the run's scaler followed, so the trace reads like every other model trace.  Its float32 arithmetic is
    the framework's on this host (XLA's dots and convolutions, torch's kernels), so it keeps the host as a
    recorded trace does.
    """
    chosen = get_profile(profile)
    simulated = simulate_scaler([r.overflow for r in records], chosen.name, **params)
    columns = {"loss": [r.loss for r in records]}
    for record in records:
        for name, value in _shares(record.telemetry).items():
            columns.setdefault(name, []).append(value)
    steps = trace_steps(simulated, fields_recorded_by("model"), columns)
    steps = tuple({**step, **(fp8_cast_fields(r.fp8_casts) if r.fp8_casts else {}),
                   "module_underflow": module_underflow(r.telemetry),
                   "module_underflow_forward": module_underflow(r.telemetry, "forward")}
                  for step, r in zip(steps, records))
    metadata = {"fpemu_version": __version__,
                "spec": {"name": model_name, "path": f"{model_name}.py",
                         "sha256": hashlib.sha256(model_text.encode()).hexdigest(), "text": model_text},
                "implementation": implementation, "profile": chosen.name, "params": {**chosen.defaults, **params},
                "packages": packages, "device": "cpu", "host": host_provenance(packages), "verified": chosen.verified,
                "policy": policy, "op_table": op_table, "telemetry": run_telemetry.as_dict()}
    return Trace(metadata, steps, trace_summary(simulated))
