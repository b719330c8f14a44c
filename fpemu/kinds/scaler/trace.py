"""Traces of scaler scenarios: the profile's model (the golden) or a real scaler driven through the flags."""

from __future__ import annotations

import numpy as np

from fpemu.adapters import adapter_versions, get_adapter, package_versions, record_scaler
from fpemu.kinds.scaler.spec import ScalerScenario
from fpemu.kinds.scenario import Implementation
from fpemu.scalers import simulate_scaler
from fpemu.scalers.profiles import get_profile
from fpemu.steps import train_trace
from fpemu.traces import Trace, read_trace
from fpemu.traces.layout import REFERENCE, trace_metadata, trace_steps, trace_summary
from fpemu.traces.replay import replay


def scenario_flags(scenario: ScalerScenario):
    """The overflow flags of every step, and the model's per-step records when a model decides them."""
    if scenario.overflow.kind == "recorded":
        source = scenario.overflow
        replayed = replay(read_trace(source.trace), scenario.profile, compute=source.compute, steps=scenario.steps,
                          **scenario.params)
        return np.array(replayed.flags, dtype=bool), None
    if scenario.overflow.kind != "model":
        return scenario.overflow.flags(scenario.steps), None
    source = scenario.overflow
    run = train_trace(source.model, compute=source.compute, profile=scenario.profile,
                      scaler_params=scenario.params, steps=scenario.steps, lr=source.lr,
                      target_scale=source.target_scale, seed=source.seed)
    # Under a dynamic or static scaler a step is skipped exactly when its scaled gradients
    # overflowed (the loader refuses profiles that let non-finite steps through).
    return np.array(run.skipped_mask, dtype=bool), _model_columns(run)


def _model_columns(run) -> dict:
    return {"loss": run.losses, "underflow_share": run.shares("underflow").tolist(),
            "subnormal_share": run.shares("subnormal").tolist(), "overflow_share": run.shares("overflow").tolist()}


def reference_scaler_trace(scenario: ScalerScenario) -> Trace:
    """The golden trace: the scenario's flags through fpemu's model of its profile."""
    flags, model_columns = scenario_flags(scenario)
    simulated = simulate_scaler(flags, scenario.profile, **scenario.params)
    profile = get_profile(scenario.profile)
    metadata = trace_metadata(scenario, REFERENCE, scenario.profile, {**profile.defaults, **scenario.params},
                              package_versions(["numpy", "ml_dtypes"]), "cpu", verified=profile.verified)
    return Trace(metadata, trace_steps(simulated, scenario.record, model_columns), trace_summary(simulated))


def recorded_scaler_trace(scenario: ScalerScenario, impl: Implementation) -> Trace:
    """Drive the real scaler ``impl`` through the scenario's overflow flags."""
    flags, _ = scenario_flags(scenario)
    observed = record_scaler(impl.name, flags.tolist(), impl.device, **impl.params)
    adapter = get_adapter(impl.name)
    metadata = trace_metadata(scenario, impl.key, observed.profile, observed.params,
                              adapter_versions(adapter), impl.device)
    fields = tuple(f for f in scenario.record if f in adapter.fields)
    return Trace(metadata, trace_steps(observed, fields), trace_summary(observed))
