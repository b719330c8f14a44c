"""Traces of fp8 recipes: each step's amax, the amax its scale came from, the scale and 1/scale.

The reference trace of a recipe scenario runs fpemu's model of its recipe (fpemu.scalers.fp8_recipes);
a recorded trace drives a recipe adapter (TE's own Python code, torchao) through the same amaxes.
:func:`float8_training_traces` records a real torchao Float8Linear training run and fpemu's model
of its recipe on the very tensors it cast.
"""

from __future__ import annotations

import dataclasses

import hashlib
import json

import numpy as np

from fpemu.traces import Trace, float_fields

_COLUMNS = ("scale", "amax", "amax_used", "scale_inv")


def recipe_steps(columns: dict, fields) -> tuple:
    """Step records holding the ``fields`` (of :data:`_COLUMNS`) that ``columns`` has, floats exactly."""
    kept = [field for field in fields if field in columns]
    steps = len(columns["scale"])
    records = []
    for step in range(steps):
        record = {"step": step}
        for field in kept:
            record.update(float_fields(field, columns[field][step]))
        records.append(record)
    return tuple(records)


def recipe_summary(columns: dict) -> dict:
    """The summary every trace has: a recipe step is always an attempt that completes; its final scale."""
    steps = len(columns["scale"])
    return {"attempts": steps, "completed_updates": steps, "skipped_updates": 0,
            **float_fields("final_scale", columns["scale"][-1] if steps else 1.0), "stopped_at": None, "events": []}


def reference_recipe_trace(scenario, metadata) -> Trace:
    """The golden trace of a RecipeScenario (``metadata``: fpemu.harness.run's builder, given the profile,
    parameters and versions)."""
    from fpemu.scalers.fp8_recipes import RECIPES, make_recipe
    recipe = make_recipe(scenario.recipe, **scenario.params)
    run = recipe.run(scenario.amax.amaxes(scenario.steps))
    columns = {field: getattr(run, field) for field in _COLUMNS}
    meta = metadata(scenario.recipe, dataclasses.asdict(recipe), RECIPES[scenario.recipe].source.verified)
    return Trace(meta, recipe_steps(columns, scenario.record), recipe_summary(columns))


def recorded_recipe_trace(scenario, impl, metadata) -> Trace:
    """A recipe adapter driven through the scenario's amaxes."""
    from fpemu.adapters import get_adapter, record_recipe
    adapter = get_adapter(impl.name)
    columns = record_recipe(impl.name, scenario.amax.amaxes(scenario.steps).tolist(), impl.device, **impl.params)
    fields = tuple(field for field in scenario.record if field in adapter.fields)
    return Trace(metadata(adapter.profile, dict(impl.params)), recipe_steps(columns, fields), recipe_summary(columns))


def _codes_digest(casts, codes_of) -> str:
    """sha256 of every cast's fp8 codes in order, NaN codes written as 0xFF (their sign is unspecified)."""
    from fpemu.formats import decode
    digest = hashlib.sha256()
    for cast in casts:
        codes = np.asarray(codes_of(cast), dtype=np.uint8).ravel()
        digest.update(np.where(np.isnan(decode(codes, cast.fp8_format)), np.uint8(0xFF), codes).tobytes())
    return digest.hexdigest()


def _training_steps(per_step, amax_of, scale_of, codes_of) -> tuple:
    steps = []
    for index, (_, casts) in enumerate(per_step):
        amaxes = [float(v) for cast in casts for v in np.ravel(amax_of(cast))]
        scales = [float(v) for cast in casts for v in np.ravel(scale_of(cast))]
        steps.append({"step": index, "tensor_amax": amaxes, "tensor_amax_hex": [v.hex() for v in amaxes],
                      "tensor_scale": scales, "tensor_scale_hex": [v.hex() for v in scales],
                      "fp8_codes": _codes_digest(casts, codes_of)})
    return tuple(steps)


def float8_training_traces(recipe: str = "tensorwise", steps: int = 20, seed: int = 0) -> tuple:
    """(torchao's trace, fpemu's trace) of a Float8Linear MLP trained ``steps`` steps under torchao's
    ``recipe`` (``tensorwise`` or ``rowwise``): each step's amaxes and scales of every cast, in call
    order, and a digest of the fp8 codes; fpemu's come from :class:`~fpemu.scalers.fp8_recipes.TorchaoScaling`
    run on the high-precision tensors torchao cast.  Compare them with :func:`fpemu.compare.compare_traces`.
    Needs torch and torchao."""
    import fpemu
    from fpemu.adapters import get_adapter
    from fpemu.adapters.torchao_float8 import LINEAR_CASTS, train_float8_mlp
    from fpemu.harness.run import adapter_versions, package_versions
    from fpemu.scalers.fp8_recipes import TorchaoScaling
    per_step = train_float8_mlp(recipe, steps=steps, seed=seed)
    models = {}

    def model(cast):
        key = id(cast)
        if key not in models:
            axis = -1 if cast.axis is None else cast.axis
            models[key] = TorchaoScaling(cast.fp8_format, cast.granularity, axis, cast.power_of_2).quantize(cast.tensor)
        return models[key]

    params = {"recipe": recipe, "steps": steps, "seed": seed, "model": "Linear(16,32)-ReLU-Linear(32,16), SGD 0.05",
              "casts": [f"layer{layer}.{name}" for layer in (0, 1) for name in LINEAR_CASTS]}
    text = json.dumps(params, sort_keys=True)
    spec = {"name": f"float8_linear_{recipe}", "path": "", "sha256": hashlib.sha256(text.encode()).hexdigest(),
            "text": text}

    def metadata(implementation, versions):
        return {"fpemu_version": fpemu.__version__, "spec": spec, "implementation": implementation,
                "profile": f"torchao_{recipe}", "params": params, "packages": versions, "device": "cpu"}

    losses = [loss for loss, _ in per_step]
    # fp8 training has no loss scale: the summary has no final_scale; it keeps torchao's losses
    summary = {"attempts": steps, "completed_updates": steps, "skipped_updates": 0, "stopped_at": None,
               "events": [], "losses_hex": [float(v).hex() for v in losses]}
    observed = Trace(metadata("torchao@cpu", adapter_versions(get_adapter("torchao_float8"))),
                     _training_steps(per_step, lambda c: c.amax, lambda c: c.scale, lambda c: c.codes), summary)
    reference = Trace(metadata("reference", package_versions(["numpy", "ml_dtypes"])),
                      _training_steps(per_step, lambda c: model(c).amax, lambda c: model(c).scale,
                                      lambda c: model(c).codes), summary)
    return observed, reference
