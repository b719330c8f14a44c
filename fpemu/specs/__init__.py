"""Scenario specs (TOML files in specs/): loading and validating them into scenarios of their kind."""

from fpemu.kinds.blocks import BlocksScenario
from fpemu.kinds.fp8_training import Fp8TrainingScenario
from fpemu.kinds.ranks import RanksDivergence, RanksScenario
from fpemu.kinds.recipe import AmaxSource, RecipeScenario
from fpemu.kinds.scaler import OverflowSource, ScalerScenario
from fpemu.kinds.scenario import ExpectedDivergence, Implementation
from fpemu.kinds.schema import SpecError
from fpemu.kinds.step import StepScenario, StepSource
from fpemu.specs.loader import find_specs, load_spec, load_specs, parse_spec

__all__ = ["SpecError", "find_specs", "load_spec", "load_specs", "parse_spec", "ExpectedDivergence",
           "Implementation", "OverflowSource", "ScalerScenario", "StepScenario", "StepSource",
           "AmaxSource", "RecipeScenario", "RanksScenario", "RanksDivergence", "Fp8TrainingScenario",
           "BlocksScenario"]
