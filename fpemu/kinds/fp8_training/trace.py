"""Traces of fp8 training: a real fp8 run's casts, and fpemu's model of its recipe on the same tensors.

A run of an [fp8_training] scenario (fpemu.kinds.fp8_training.spec) trains its model for real (torchao's
Float8Linear on the CPU) and keeps every cast's high-precision input.  Its recorded trace holds what
torchao computed (each cast's amaxes, scales and a digest of its fp8 codes); its reference trace holds
what :class:`~fpemu.scalers.fp8_recipes.TorchaoScaling` computes on those very tensors.  The reference
is the golden: it needs the real run for its tensors, so it holds for the torch and torchao versions
in its metadata, and nothing of the host goes into it.
"""

from __future__ import annotations

from fpemu.adapters import adapter_versions, get_adapter, package_versions, train_fp8
from fpemu.compare import compare_traces
from fpemu.kinds.fp8_training.spec import FP8_TRAINING_ADAPTER, MODELS, Fp8TrainingScenario, parse_fp8_training_spec
from fpemu.kinds.scenario import Implementation
from fpemu.kinds.schema import Checker, parse_toml
from fpemu.traces import Trace
from fpemu.traces.layout import REFERENCE, codes_digest, fp8_cast_fields, trace_metadata

# what computed a golden's numbers: fpemu's model, and the run whose tensors it cast
_GOLDEN_PACKAGES = ("numpy", "ml_dtypes", "torch", "torchao")


def _modelled(cast):
    """fpemu's model of torchao's cast of ``cast.tensor`` (the same arguments)."""
    from fpemu.scalers.fp8_recipes import TorchaoScaling
    axis = -1 if cast.axis is None else cast.axis
    return TorchaoScaling(cast.fp8_format, cast.granularity, axis, cast.power_of_2).quantize(cast.tensor)


def _cast_records(per_step, values_of) -> tuple:
    """One step record per step: each cast's name and ``values_of(cast)`` (amaxes, scales, codes)."""
    from fpemu.adapters.torchao_float8 import linear_cast_names
    records = []
    for index, (_, casts) in enumerate(per_step):
        names = linear_cast_names(len(casts) // 6)  # the adapter checked: six casts per layer
        records.append({"step": index, **fp8_cast_fields(
            (name, amax, scale, codes_digest(codes, cast.fp8_format))
            for name, cast, (amax, scale, codes) in zip(names, casts, map(values_of, casts)))})
    return tuple(records)


def _summary(per_step) -> dict:
    """fp8 training has no loss scale (no final_scale); the run's own losses, exactly."""
    steps = len(per_step)
    return {"attempts": steps, "completed_updates": steps, "skipped_updates": 0, "stopped_at": None, "events": [],
            "losses_hex": [float(loss).hex() for loss, _ in per_step]}


def _train(scenario: Fp8TrainingScenario, device: str = "cpu") -> list:
    model = MODELS[scenario.model]
    return train_fp8(FP8_TRAINING_ADAPTER, scenario.recipe, device, steps=scenario.steps, seed=scenario.seed,
                     sizes=model.sizes, batch=model.batch, lr=model.lr)


def _model_values(cast) -> tuple:
    modelled = _modelled(cast)
    return modelled.amax, modelled.scale, modelled.codes


def _reference(scenario: Fp8TrainingScenario, per_step) -> Trace:
    metadata = trace_metadata(scenario, REFERENCE, scenario.profile, scenario.params,
                              package_versions(_GOLDEN_PACKAGES), "cpu", verified="driven",
                              tensors_from=f"{FP8_TRAINING_ADAPTER}@cpu")
    return Trace(metadata, _cast_records(per_step, _model_values), _summary(per_step))


def _recorded(scenario: Fp8TrainingScenario, impl, per_step, reference: Trace) -> Trace:
    metadata = trace_metadata(scenario, impl.key, scenario.profile, scenario.params,
                              adapter_versions(get_adapter(impl.name)), impl.device)
    observed = Trace(metadata, _cast_records(per_step, lambda cast: (cast.amax, cast.scale, cast.codes)),
                     _summary(per_step))
    same = compare_traces(reference, observed)
    message = None if same.divergence is None else same.divergence.describe("fpemu's model", "torchao")
    return Trace({**metadata, "same_tensors_model": {"status": same.status, "divergence": message}},
                 observed.steps, observed.summary)


def reference_fp8_training_trace(scenario: Fp8TrainingScenario) -> Trace:
    """The golden trace: fpemu's model of the recipe on every tensor a real run cast (needs torchao)."""
    return _reference(scenario, _train(scenario))


def recorded_fp8_training_trace(scenario: Fp8TrainingScenario, impl) -> Trace:
    """The real run's trace: torchao's casts; its metadata's ``same_tensors_model`` says whether they equal
    fpemu's model on this run's own tensors (a divergence from the golden is then the tensors', not the
    scaling's), naming the first step and cast that differ."""
    per_step = _train(scenario, impl.device)
    return _recorded(scenario, impl, per_step, _reference(scenario, per_step))


def float8_training_traces(recipe: str = "tensorwise", steps: int = 20, seed: int = 0, model: str = "mlp") -> tuple:
    """(torchao's trace, fpemu's trace) of one real Float8Linear training run of ``model`` (a key of
    fpemu.kinds.fp8_training.spec.MODELS) under torchao's ``recipe``: per step, every cast's name, amaxes,
    scales and codes digest, torchao's and fpemu's model's on the same tensors.  Needs torch and torchao.

    Example::

        observed, model = float8_training_traces("rowwise", steps=4)
        assert fpemu.compare.compare_traces(model, observed).status == "match"
    """
    text = f'steps = {steps}\n\n[fp8_training]\nmodel = "{model}"\nrecipe = "{recipe}"\nseed = {seed}\n'
    path = f"float8_linear_{recipe}.toml"
    scenario = parse_fp8_training_spec(Checker(path), parse_toml(text, path), text, path)
    per_step = _train(scenario)
    reference = _reference(scenario, per_step)
    return _recorded(scenario, Implementation(FP8_TRAINING_ADAPTER, {}), per_step, reference), reference
