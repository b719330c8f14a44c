"""The scaler kind: a loss scaler profile driven through one overflow flag per step (the default kind)."""

from fpemu.kinds.protocol import ScenarioKind
from fpemu.kinds.scaler.spec import OverflowSource, ScalerScenario, parse_scaler_spec
from fpemu.kinds.scaler.trace import recorded_scaler_trace, reference_scaler_trace
from fpemu.scalers.profiles import PROFILES

KIND = ScenarioKind("scaler", None, ScalerScenario, parse_scaler_spec, other_tables=("scaler", "overflow"),
                    reference=reference_scaler_trace, record=recorded_scaler_trace, records=("scaler", "model"),
                    profiles=frozenset(PROFILES))

__all__ = ["KIND", "OverflowSource", "ScalerScenario"]
