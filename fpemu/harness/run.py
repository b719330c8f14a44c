"""Run a scenario on the reference model or on a real implementation, producing a Trace."""

from __future__ import annotations

import numpy as np

from fpemu._host import installed_versions
from fpemu.traces.layout import REFERENCE, trace_metadata, trace_steps, trace_summary
from fpemu.adapters import get_adapter, record_scaler, step_function, unavailable_reason
from fpemu.scalers import simulate_scaler
from fpemu.scalers.profiles import get_profile
from fpemu.harness.recipe_traces import recorded_recipe_trace, reference_recipe_trace
from fpemu.harness._fp8_training import recorded_fp8_training_trace, reference_fp8_training_trace
from fpemu.harness._blocks import recorded_blocks_trace, reference_blocks_trace
from fpemu.specs.blocks import BlocksScenario
from fpemu.specs.fp8_training import Fp8TrainingScenario
from fpemu.specs.recipes import RecipeScenario
from fpemu.specs.scenario import Implementation, ScalerScenario, StepScenario
from fpemu.traces import Trace, float_fields
from fpemu.traces.format import encode_float

STEP_PROFILE = "seed_step"  # the profile named in step traces: seed 002's own scale rule


def implementation_key(impl: Implementation) -> str:
    """How an implementation is named in traces and reports: adapter@device."""
    return f"{impl.name}@{impl.device}"


def package_versions(packages, environment=None) -> dict:
    """Each package's installed version, here or in an isolated environment (from its build manifest)."""
    if environment is not None:
        from fpemu.harness.environments import environment_manifest
        installed = (environment_manifest(environment) or {}).get("packages", {})
        return {package: installed.get(package, "not installed") for package in packages}
    return installed_versions(packages)


def adapter_versions(adapter) -> dict:
    """The versions of everything ``adapter`` runs: its packages (in its environment, if it has one)
    and what its ``versions`` hook reports (a DeepSpeed tree outside site-packages)."""
    return {**package_versions(adapter.packages, adapter.isolated_in), **adapter.extra_versions()}


def skip_reason(impl: Implementation):
    """None if ``impl`` can run here, else why not."""
    return unavailable_reason(impl.name, impl.device)


def scenario_flags(scenario: ScalerScenario):
    """The overflow flags of every step, and the model's per-step records when a model decides them."""
    if scenario.overflow.kind == "recorded":
        from fpemu.traces.replay import replay
        from fpemu.traces import read_trace
        source = scenario.overflow
        replayed = replay(read_trace(source.trace), scenario.profile, compute=source.compute, steps=scenario.steps,
                          **scenario.params)
        return np.array(replayed.flags, dtype=bool), None
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


def _reference_step_trace(scenario: StepScenario) -> Trace:
    from fpemu.steps import mixed_precision_step
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


def _recorded_step_trace(scenario: StepScenario, impl: Implementation) -> Trace:
    params = step_params(scenario, impl)
    steps, summary = _run_steps(scenario, step_function(impl.name, scenario.step.compute, impl.device, **params))
    adapter = get_adapter(impl.name)
    metadata = trace_metadata(scenario, implementation_key(impl), impl.name, params, adapter_versions(adapter), impl.device)
    return Trace(metadata, steps, summary)


def reference_trace(scenario: ScalerScenario | StepScenario | RecipeScenario) -> Trace:
    """The golden trace: the scenario run on fpemu's reference model."""
    if isinstance(scenario, StepScenario):
        return _reference_step_trace(scenario)
    if isinstance(scenario, Fp8TrainingScenario):
        return reference_fp8_training_trace(scenario)
    if isinstance(scenario, BlocksScenario):
        return reference_blocks_trace(scenario)
    if isinstance(scenario, RecipeScenario):
        return reference_recipe_trace(scenario, lambda profile, params, verified: trace_metadata(
            scenario, REFERENCE, profile, params, package_versions(["numpy", "ml_dtypes"]), "cpu", verified=verified))
    flags, model_columns = scenario_flags(scenario)
    simulated = simulate_scaler(flags, scenario.profile, **scenario.params)
    profile = get_profile(scenario.profile)
    metadata = trace_metadata(scenario, REFERENCE, scenario.profile, {**profile.defaults, **scenario.params},
                         package_versions(["numpy", "ml_dtypes"]), "cpu", verified=profile.verified)
    return Trace(metadata, trace_steps(simulated, scenario.record, model_columns), trace_summary(simulated))


def record_trace(scenario: ScalerScenario | StepScenario, impl: Implementation) -> Trace:
    """Drive the real implementation ``impl`` through the scenario's overflow flags (or its steps)."""
    if isinstance(scenario, StepScenario):
        return _recorded_step_trace(scenario, impl)
    if isinstance(scenario, Fp8TrainingScenario):
        return recorded_fp8_training_trace(scenario, impl)
    if isinstance(scenario, BlocksScenario):
        return recorded_blocks_trace(scenario, impl)
    if isinstance(scenario, RecipeScenario):
        return recorded_recipe_trace(scenario, impl, lambda profile, params: trace_metadata(
            scenario, implementation_key(impl), profile, params, adapter_versions(get_adapter(impl.name)), impl.device))
    flags, _ = scenario_flags(scenario)
    observed = record_scaler(impl.name, flags.tolist(), impl.device, **impl.params)
    adapter = get_adapter(impl.name)
    metadata = trace_metadata(scenario, implementation_key(impl), observed.profile, observed.params,
                         adapter_versions(adapter), impl.device)
    fields = tuple(f for f in scenario.record if f in adapter.fields)
    return Trace(metadata, trace_steps(observed, fields), trace_summary(observed))
