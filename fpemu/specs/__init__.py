"""Scenario specs (TOML files in specs/) and the scenarios they describe."""

from fpemu.specs.loader import SpecError, find_specs, load_spec, load_specs, parse_spec
from fpemu.specs.scenario import Implementation, OverflowSource, ScalerScenario, StepScenario, StepSource
from fpemu.specs.recipes import AmaxSource, RecipeScenario
from fpemu.specs._ranks import RanksDivergence, RanksScenario
from fpemu.specs.fp8_training import Fp8TrainingScenario
from fpemu.specs.blocks import BlocksScenario

__all__ = ["SpecError", "find_specs", "load_spec", "load_specs", "parse_spec", "Implementation",
           "OverflowSource", "ScalerScenario", "StepScenario", "StepSource",
           "AmaxSource", "RecipeScenario", "RanksScenario", "RanksDivergence", "Fp8TrainingScenario",
           "BlocksScenario"]
