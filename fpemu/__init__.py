"""fpemu: bit-exact emulation of number formats and loss scaling for mixed-precision training.

The emulation core imports only numpy and ml_dtypes; adapters that drive real
frameworks import them on first use.
"""

from fpemu.formats import (FORMATS, OVERFLOW_MODES, ROUNDING_MODES, Format, RangeStats, decode,
                           encode, format_names, get_format, make_format, quantize, range_stats)
from fpemu.scalers import (PROFILES, ScalerTrace, dynamic_loss_scale, get_profile, simulate_scaler,
                           step_overflowed, unscale)
from fpemu.steps import SEMANTICS, StepSemantics, TrainTrace, mixed_precision_step, train_trace
from fpemu.audits import (AuditResult, Finding, LoopAccounting, LossScaleAdvice, advise_loss_scale,
                          audit_jax_loop, audit_torch)
from fpemu.emulate import POLICIES as EMULATION_POLICIES, Policy, emulate_torch, get_policy

__version__ = "0.1.0"

__all__ = ["FORMATS", "OVERFLOW_MODES", "ROUNDING_MODES", "Format", "RangeStats", "decode",
           "encode", "format_names", "PROFILES", "ScalerTrace", "dynamic_loss_scale", "get_profile",
           "simulate_scaler", "step_overflowed", "unscale", "AuditResult", "Finding", "LoopAccounting",
           "LossScaleAdvice", "advise_loss_scale", "audit_jax_loop", "audit_torch", "SEMANTICS",
           "StepSemantics", "TrainTrace", "mixed_precision_step", "train_trace", "get_format", "make_format", "quantize", "range_stats",
           "EMULATION_POLICIES", "Policy", "emulate_torch", "get_policy",
           "__version__"]
