"""Loss-scaler reference models: one state machine, one profile per real implementation."""

from fpemu.scalers.model import ScalerRules, ScalerState, StepOutcome
from fpemu.scalers.profiles import PROFILES, Profile, get_profile
from fpemu.scalers.simulate import (ScalerTrace, dynamic_loss_scale, run_rules, simulate_scaler,
                                    step_overflowed, unscale)

__all__ = ["ScalerRules", "ScalerState", "StepOutcome", "PROFILES", "Profile", "get_profile",
           "ScalerTrace", "dynamic_loss_scale", "run_rules", "simulate_scaler", "step_overflowed",
           "unscale"]
