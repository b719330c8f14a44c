"""The fp8 training kind: a small model trained for real under an fp8 recipe, every cast traced."""

from fpemu.kinds.protocol import ScenarioKind
from fpemu.kinds.fp8_training.spec import RECIPES, Fp8TrainingScenario, parse_fp8_training_spec
from fpemu.kinds.fp8_training.trace import (float8_training_traces, recorded_fp8_training_trace,
                                            reference_fp8_training_trace)

KIND = ScenarioKind("fp8_training", "fp8_training", Fp8TrainingScenario, parse_fp8_training_spec,
                    reference=reference_fp8_training_trace, record=recorded_fp8_training_trace,
                    runs_by_default="own", scale_label=None,
                    profiles=frozenset(f"torchao_{recipe}" for recipe in RECIPES))

__all__ = ["KIND", "Fp8TrainingScenario", "float8_training_traces"]
