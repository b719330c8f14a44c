"""The step kind: seed 002's mixed-precision step iterated on seeded data ([step] specs)."""

from fpemu.adapters import adapters_of_kind
from fpemu.kinds.protocol import ScenarioKind
from fpemu.kinds.step.spec import StepScenario, StepSource, parse_step_spec
from fpemu.kinds.step.trace import STEP_PROFILE, recorded_step_trace, reference_step_trace

# A step spec drives only the step adapters it declares (one fitted to torch would falsely diverge on JAX).
KIND = ScenarioKind("step", "step", StepScenario, parse_step_spec, reference=reference_step_trace,
                    record=recorded_step_trace, runs_by_default="declared",
                    profiles=frozenset({STEP_PROFILE, *adapters_of_kind("step")}))

__all__ = ["KIND", "StepScenario", "StepSource"]
