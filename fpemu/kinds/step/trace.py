"""Traces of step scenarios: seed 002's step iterated on the scenario's data, by fpemu's model or a real step."""

from __future__ import annotations

import numpy as np

from fpemu.adapters import adapter_versions, get_adapter, package_versions, step_function
from fpemu.kinds.scenario import Implementation
from fpemu.kinds.step.spec import StepScenario
from fpemu.steps import mixed_precision_step
from fpemu.traces import Trace, float_fields
from fpemu.traces.format import encode_float
from fpemu.traces.layout import REFERENCE, trace_metadata

STEP_PROFILE = "seed_step"  # the profile named in step traces: seed 002's own scale rule


def _run_steps(scenario: StepScenario, step_fn) -> tuple:
    """Iterate seed 002's step over the scenario's data, feeding each result into the next step.

    Returns (step records, summary) in the trace layout.
    """
    source = scenario.step
    params, data = source.inputs(scenario.steps)
    scale, good = np.float32(source.init_scale), np.int32(0)
    records, applied = [], []
    for index, (x, y) in enumerate(data):
        out = step_fn(params=params, x=x, y=y, loss_scale=scale, good_steps=good, lr=np.float32(source.lr),
                      growth_interval=source.growth_interval)
        finite = bool(out["grads_finite"])
        record = {"step": index}
        if "scale" in scenario.record:
            record.update(float_fields("scale", float(scale)))
        if "overflow" in scenario.record:
            record["overflow"] = not finite
        if "applied" in scenario.record:
            record["applied"] = finite
        if "growth_counter" in scenario.record:
            record["growth_counter"] = int(out["good_steps"])
        if "loss" in scenario.record:
            record.update(float_fields("loss", float(out["loss"])))
        params = {"w": np.asarray(out["params"]["w"], np.float32), "b": np.asarray(out["params"]["b"], np.float32)}
        if "params" in scenario.record:
            flat = np.concatenate([params["w"].ravel(), params["b"].ravel()]).astype(np.float64)
            record["params"] = [encode_float(v) for v in flat]
            record["params_hex"] = [float(v).hex() for v in flat]
        records.append(record)
        applied.append(finite)
        scale, good = np.float32(out["loss_scale"]), np.int32(out["good_steps"])
    summary = {"attempts": len(records), "completed_updates": sum(applied),
               "skipped_updates": len(records) - sum(applied), **float_fields("final_scale", float(scale)),
               "stopped_at": None, "events": []}
    return tuple(records), summary


def reference_step_trace(scenario: StepScenario) -> Trace:
    source = scenario.step
    steps, summary = _run_steps(scenario, lambda **case: mixed_precision_step(**case, compute=source.compute,
                                                                              mode=source.mode))
    metadata = trace_metadata(scenario, REFERENCE, STEP_PROFILE, {"mode": source.mode, "compute": source.compute},
                         package_versions(["numpy", "ml_dtypes"]), "cpu", verified="driven")
    return Trace(metadata, steps, summary)


def step_params(scenario: StepScenario, impl: Implementation) -> dict:
    """Every parameter of a step adapter: the spec's, else the scenario's own field of that name where
    the adapter accepts its value (a jax_cpu scenario runs jax_step in jax_cpu), else the default."""
    params = {}
    for param, accepted in get_adapter(impl.name).params.items():
        own = getattr(scenario.step, param, None)
        params[param] = impl.params.get(param, own if own in accepted else accepted[0])
    return params


def recorded_step_trace(scenario: StepScenario, impl: Implementation) -> Trace:
    params = step_params(scenario, impl)
    steps, summary = _run_steps(scenario, step_function(impl.name, scenario.step.compute, impl.device, **params))
    adapter = get_adapter(impl.name)
    metadata = trace_metadata(scenario, impl.key, impl.name, params, adapter_versions(adapter), impl.device)
    return Trace(metadata, steps, summary)
