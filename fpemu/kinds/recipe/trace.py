"""Traces of fp8 recipes: each step's amax, the amax its scale came from, the scale and 1/scale.

The reference trace of a recipe scenario runs fpemu's model of its recipe (fpemu.scalers.fp8_recipes);
a recorded trace drives a recipe adapter (TE's own Python code, torchao) through the same amaxes.
A real torchao Float8Linear training run and fpemu's model of its recipe on the very tensors it cast
are fp8 training traces (fpemu.kinds.fp8_training).
"""

from __future__ import annotations

import dataclasses

from fpemu.adapters import adapter_versions, get_adapter, package_versions, record_recipe
from fpemu.kinds.recipe.spec import RecipeScenario
from fpemu.kinds.scenario import Implementation
from fpemu.scalers.fp8_recipes import RECIPES, make_recipe
from fpemu.traces import Trace, float_fields
from fpemu.traces.layout import REFERENCE, trace_metadata

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


def reference_recipe_trace(scenario: RecipeScenario) -> Trace:
    """The golden trace of a RecipeScenario: fpemu's model of its recipe through its amaxes."""
    recipe = make_recipe(scenario.recipe, **scenario.params)
    run = recipe.run(scenario.amax.amaxes(scenario.steps))
    columns = {field: getattr(run, field) for field in _COLUMNS}
    meta = trace_metadata(scenario, REFERENCE, scenario.recipe, dataclasses.asdict(recipe),
                          package_versions(["numpy", "ml_dtypes"]), "cpu",
                          verified=RECIPES[scenario.recipe].source.verified)
    return Trace(meta, recipe_steps(columns, scenario.record), recipe_summary(columns))


def recorded_recipe_trace(scenario: RecipeScenario, impl: Implementation) -> Trace:
    """A recipe adapter driven through the scenario's amaxes."""
    adapter = get_adapter(impl.name)
    columns = record_recipe(impl.name, scenario.amax.amaxes(scenario.steps).tolist(), impl.device, **impl.params)
    fields = tuple(field for field in scenario.record if field in adapter.fields)
    metadata = trace_metadata(scenario, impl.key, adapter.profile, dict(impl.params), adapter_versions(adapter),
                              impl.device)
    return Trace(metadata, recipe_steps(columns, fields), recipe_summary(columns))
