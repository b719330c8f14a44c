"""The recipe kind: an fp8 per-tensor scaling recipe driven through one amax per step ([recipe] specs)."""

from fpemu.kinds.protocol import ScenarioKind
from fpemu.kinds.recipe.spec import AmaxSource, RecipeScenario, parse_recipe_spec
from fpemu.kinds.recipe.trace import recorded_recipe_trace, reference_recipe_trace
from fpemu.scalers.fp8_recipes import RECIPES

KIND = ScenarioKind("recipe", "recipe", RecipeScenario, parse_recipe_spec, other_tables=("amax",),
                    reference=reference_recipe_trace, record=recorded_recipe_trace, scale_label="fp8 scale",
                    profiles=frozenset(RECIPES))

__all__ = ["KIND", "AmaxSource", "RecipeScenario"]
