"""fpemu: bit-exact emulation of number formats and loss scaling for mixed-precision training.

The emulation core imports only numpy and ml_dtypes; adapters that drive real
frameworks import them on first use.
"""

from fpemu.formats import (FORMATS, OVERFLOW_MODES, ROUNDING_MODES, Format, RangeStats, decode,
                           encode, format_names, get_format, make_format, quantize, range_stats)
from fpemu.blocks import SCALE_RULES, BlockQuantized, BlockStats, block_quantize, block_stats
from fpemu.scalers import (PROFILES, ScalerTrace, dynamic_loss_scale, get_profile, simulate_scaler,
                           step_overflowed, unscale)
from fpemu.scalers.fp8_recipes import RECIPES, CurrentScaling, DelayedScaling, TorchaoScaling, simulate_recipe
from fpemu.steps import SEMANTICS, StepSemantics, TrainTrace, mixed_precision_step, train_trace
from fpemu.emulate import POLICIES as EMULATION_POLICIES, Policy, emulate_jax, emulate_torch, get_policy
from fpemu.recorders import JaxRecorder, record_jax, record_torch
from fpemu.audits import (AuditResult, Finding, JaxStep, LoopAccounting, LossScaleAdvice, advise_loss_scale,
                          audit_jax_loop, audit_torch)

from fpemu.version import __version__

__all__ = [
    # number formats
    "FORMATS", "OVERFLOW_MODES", "ROUNDING_MODES", "Format", "RangeStats", "decode", "encode",
    "format_names", "get_format", "make_format", "quantize", "range_stats",
    # block-scaled formats (MX, NVFP4)
    "SCALE_RULES", "BlockQuantized", "BlockStats", "block_quantize", "block_stats",
    # loss scalers
    "PROFILES", "ScalerTrace", "dynamic_loss_scale", "get_profile", "simulate_scaler", "step_overflowed",
    "unscale",
    # fp8 scaling recipes
    "RECIPES", "CurrentScaling", "DelayedScaling", "TorchaoScaling", "simulate_recipe",
    # mixed-precision steps and models
    "SEMANTICS", "StepSemantics", "TrainTrace", "mixed_precision_step", "train_trace",
    # emulating a user's model
    "EMULATION_POLICIES", "Policy", "emulate_jax", "emulate_torch", "get_policy",
    # recording a user's run
    "JaxRecorder", "record_jax", "record_torch",
    # auditing training loops
    "AuditResult", "Finding", "JaxStep", "LoopAccounting", "LossScaleAdvice", "advise_loss_scale",
    "audit_jax_loop", "audit_torch",
    "__version__",
]
