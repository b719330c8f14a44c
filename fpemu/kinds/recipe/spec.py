"""fp8 recipe scenarios: a per-tensor scaling recipe driven through one amax per step.

A recipe spec::

    description = "TE delayed scaling: zero-amax steps"
    steps = 5

    [recipe]
    name = "te_delayed"                   # a key of fpemu.scalers.fp8_recipes.RECIPES
    params = { amax_history_len = 2 }

    [amax]
    source = "explicit"                   # explicit | generated
    sequence = [4.0, 0.0, 0.0, 1.0, 1.0]  # TOML has nan and inf

    [implementations.te_unfused]          # TE's own unfused update (params default to the recipe's)
    expect_divergence = { step = 3, field = "scale", reason = "the fused kernel does not roll on a zero amax" }

``generated`` draws ``magnitude * 2^U(-spread, spread)`` per step (seed ``seed``) and replaces a
share of the steps by the events 0, inf and NaN (``zero_rate``, ``inf_rate``, ``nan_rate``).
"""

from __future__ import annotations

import dataclasses
import sys

import numpy as np

from fpemu.adapters import RECIPE, get_adapter
from fpemu.kinds.scenario import Implementation, ScenarioBase
from fpemu.kinds.schema import build_scenario, implementation_tables, record_fields

AMAX_SOURCES = ("explicit", "generated")
_SOURCE_KEYS = {"explicit": {"sequence"},
                "generated": {"seed", "magnitude", "spread", "zero_rate", "inf_rate", "nan_rate"}}
# The events a generated sequence injects, in the order they are drawn (a later one wins a step).
AMAX_EVENTS = {"zero_rate": 0.0, "inf_rate": float("inf"), "nan_rate": float("nan")}


@dataclasses.dataclass(frozen=True)
class AmaxSource:
    """Where a recipe scenario's amaxes come from.

    Attributes:
      kind: ``explicit`` or ``generated``.
      sequence: the amaxes, for ``explicit``.
      seed, magnitude, spread: ``generated``: ``magnitude * 2^U(-spread, spread)`` in float32.
      zero_rate, inf_rate, nan_rate: ``generated``: the share of steps whose amax is 0, inf or NaN.
    """

    kind: str
    sequence: tuple = ()
    seed: int = 0
    magnitude: float = 1.0
    spread: float = 4.0
    zero_rate: float = 0.0
    inf_rate: float = 0.0
    nan_rate: float = 0.0

    def amaxes(self, steps: int) -> np.ndarray:
        """The float32 amax of each of ``steps`` steps (the same every call).

        Example:
          >>> source = AmaxSource("generated", seed=1, magnitude=2.0, spread=0.0, zero_rate=0.25, nan_rate=0.25)
          >>> source.amaxes(6).tolist()
          [nan, 2.0, 2.0, 0.0, 2.0, 2.0]
        """
        if self.kind == "explicit":
            return np.array(self.sequence[:steps], dtype=np.float32)
        rng = np.random.default_rng(self.seed)
        amaxes = (self.magnitude * np.exp2(rng.uniform(-self.spread, self.spread, steps))).astype(np.float32)
        for rate, value in AMAX_EVENTS.items():
            amaxes[rng.random(steps) < getattr(self, rate)] = value
        return amaxes


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeScenario(ScenarioBase):
    """An fp8 scaling recipe driven through one amax per step (see :func:`fpemu.specs.load_spec`)."""

    recipe: str
    params: dict
    amax: AmaxSource

    @property
    def profile(self) -> str:
        """The recipe, under the name the harness gives what a scenario's adapters must run."""
        return self.recipe

    def implementation(self, name: str) -> Implementation:
        """The spec's own table for ``name``, else the recipe's parameters."""
        return self.declared(name) or Implementation(name, dict(self.params))


def _amax_source(check, raw) -> AmaxSource:
    kind = check.source(raw, "amax", AMAX_SOURCES, _SOURCE_KEYS)
    fields = {"kind": kind}
    if kind == "explicit":
        sequence = raw.get("sequence")
        if not isinstance(sequence, list) or not sequence or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and not v < 0
                and not (isinstance(v, int) and v > sys.float_info.max) for v in sequence):
            check.fail("amax.sequence", "expected a non-empty list of amaxes (numbers >= 0 within float's range, "
                                        "inf or nan)")
        fields["sequence"] = tuple(float(v) for v in sequence)
        return AmaxSource(**fields)
    if "seed" in raw:
        fields["seed"] = check.integer(raw["seed"], "amax.seed", 0)
    bounds = (("magnitude", 1e-38, 3e38), ("spread", 0.0, 120.0), *((rate, 0.0, 1.0) for rate in AMAX_EVENTS))
    for key, low, high in bounds:
        if key in raw:
            fields[key] = check.number(raw[key], f"amax.{key}", low, high)
    return AmaxSource(**fields)


def _recipe(check, raw) -> tuple:
    from fpemu.scalers.fp8_recipes import RECIPES
    table = check.table(raw, "recipe", {"name", "params"})
    name = check.choice(table.get("name"), "recipe.name", tuple(RECIPES))
    return name, _recipe_params(check, name, table.get("params", {}), "recipe.params")


def _recipe_params(check, recipe: str, params, key: str) -> dict:
    from fpemu.scalers.fp8_recipes import make_recipe
    if not isinstance(params, dict):
        check.fail(key, f"expected a table, got {type(params).__name__}")
    for name, value in params.items():
        check.parameter(value, f"{key}.{name}")
    try:
        make_recipe(recipe, **params)
    except ValueError as error:
        name, _, message = str(error).partition(": ")  # the model's errors start with the parameter's name
        if name in params:
            check.fail(f"{key}.{name}", message)
        check.fail(key, str(error))
    return dict(params)


def _implementations(check, raw, params: dict) -> tuple:
    out = []
    for key, adapter, device, body, reason in implementation_tables(check, raw, RECIPE):
        own = _recipe_params(check, get_adapter(adapter).profile, body.get("params", params), f"{key}.params")
        out.append(Implementation(adapter, own, device, reason))
    return tuple(out)


def parse_recipe_spec(check, raw: dict, text: str, path: str) -> RecipeScenario:
    """Validate a spec with a [recipe] table (``check``: the loader's checker, which names the file)."""
    for key in ("scaler", "overflow", "step"):
        if key in raw:
            check.attempt(check.fail, key, "a [recipe] scenario takes its amaxes from [amax]; remove this table")
    for required in ("steps", "amax"):
        if required not in raw:
            check.attempt(check.fail, required, "missing required key")
    steps = check.attempt(check.integer, raw["steps"], "steps", 1) if "steps" in raw else None
    recipe, params = check.attempt(_recipe, check, raw["recipe"]) or (None, None)
    amax = check.attempt(_amax_source, check, raw["amax"]) if "amax" in raw else None
    if amax is not None and amax.kind == "explicit" and steps is not None and len(amax.sequence) != steps:
        check.attempt(check.fail, "amax.sequence", f"expected steps={steps} amaxes, got {len(amax.sequence)}")
    record = check.attempt(record_fields, check, raw, RECIPE)
    implementations = None if params is None else check.attempt(_implementations, check,
                                                                raw.get("implementations", {}), params)
    check.raise_errors()
    return build_scenario(check, RecipeScenario, raw, text, path, steps=steps, recipe=recipe, params=params, amax=amax,
                     implementations=implementations, record=record)
