"""Run a scenario on the reference model or on a real implementation, producing a Trace."""

from __future__ import annotations

import importlib.metadata
import platform

import numpy as np

import fpemu
from fpemu.adapters import SCALER_ADAPTERS, record_scaler, unavailable_reason
from fpemu.scalers import simulate_scaler
from fpemu.scalers.profiles import get_profile
from fpemu.specs.scenario import Implementation, Scenario
from fpemu.traces import Trace, float_fields

REFERENCE = "reference"


def implementation_key(impl: Implementation) -> str:
    """How an implementation is named in traces and reports: adapter@device."""
    return f"{impl.name}@{impl.device}"


def package_versions(packages) -> dict:
    versions = {}
    for package in packages:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    return versions


def skip_reason(impl: Implementation):
    """None if ``impl`` can run here, else why not."""
    reason = unavailable_reason(impl.name)
    if reason is None and impl.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            reason = "CUDA is not available on this machine"
    return reason


def _spec_metadata(scenario: Scenario) -> dict:
    return {"name": scenario.name, "path": scenario.path, "sha256": scenario.sha256, "text": scenario.text}


def scenario_flags(scenario: Scenario):
    """The overflow flags of every step, and the model's per-step records when a model decides them."""
    if scenario.overflow.kind != "model":
        return scenario.overflow.flags(scenario.steps), None
    from fpemu.steps import train_trace
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


def _steps(scaler_trace, fields, model_columns=None) -> tuple:
    records = []
    for step in range(scaler_trace.attempts):
        record = {"step": step}
        if "scale" in fields:
            record.update(float_fields("scale", scaler_trace.scales[step]))
        if "overflow" in fields:
            record["overflow"] = bool(scaler_trace.overflow[step])
        if "applied" in fields:
            record["applied"] = bool(scaler_trace.applied[step])
        if "growth_counter" in fields:
            record["growth_counter"] = int(scaler_trace.growth_counter[step])
        if "hysteresis" in fields and scaler_trace.hysteresis is not None:
            record["hysteresis"] = scaler_trace.hysteresis[step]
        if model_columns is not None:
            for field, column in model_columns.items():
                if field in fields:
                    record.update(float_fields(field, column[step]))
        records.append(record)
    return tuple(records)


def _summary(scaler_trace) -> dict:
    return {"attempts": scaler_trace.attempts, "completed_updates": scaler_trace.completed_updates,
            "skipped_updates": scaler_trace.skipped_updates, **float_fields("final_scale", scaler_trace.final_scale),
            "stopped_at": scaler_trace.stopped_at,
            "events": [[step, text] for step, text in scaler_trace.events]}


def reference_trace(scenario: Scenario) -> Trace:
    """The golden trace: the scenario run on fpemu's reference model."""
    flags, model_columns = scenario_flags(scenario)
    simulated = simulate_scaler(flags, scenario.profile, **scenario.params)
    metadata = {
        "fpemu_version": fpemu.__version__, "spec": _spec_metadata(scenario), "implementation": REFERENCE,
        "profile": scenario.profile, "params": {**get_profile(scenario.profile).defaults, **scenario.params},
        "packages": package_versions(["numpy", "ml_dtypes"]), "device": "cpu", "platform": platform.platform(),
        "verified": get_profile(scenario.profile).verified,
    }
    return Trace(metadata, _steps(simulated, scenario.record, model_columns), _summary(simulated))


def record_trace(scenario: Scenario, impl: Implementation) -> Trace:
    """Drive the real implementation ``impl`` through the scenario's overflow flags."""
    flags, _ = scenario_flags(scenario)
    kwargs = dict(impl.params)
    if impl.name.startswith("torch"):
        kwargs["device"] = impl.device
    observed = record_scaler(impl.name, flags.tolist(), **kwargs)
    packages = list(SCALER_ADAPTERS[impl.name][1]) + (["jaxlib"] if "jax" in SCALER_ADAPTERS[impl.name][1] else [])
    metadata = {
        "fpemu_version": fpemu.__version__, "spec": _spec_metadata(scenario),
        "implementation": implementation_key(impl), "profile": impl.name,
        "params": {**get_profile(impl.name).defaults, **impl.params},
        "packages": package_versions(packages), "device": impl.device, "platform": platform.platform(),
    }
    fields = tuple(f for f in scenario.record if f in ("scale", "overflow", "applied", "growth_counter"))
    return Trace(metadata, _steps(observed, fields), _summary(observed))
