"""Reference mixed-precision training steps, emulated bit for bit (numpy + ml_dtypes only).

``mixed_precision_step`` is seed 002's step; :class:`StepSemantics` and its presets say
what JAX (XLA:CPU) and torch really compute; ``train_trace`` trains small models under a
compute format and a loss-scaler profile.  See ``docs/steps.md``.
"""

from fpemu.steps.semantics import DEFAULT_SEMANTICS, SEMANTICS, StepSemantics, get_semantics
from fpemu.steps.step import COMPUTE_FORMATS, mixed_precision_step
from fpemu.steps.train import MODELS, TrainStep, TrainTrace, train_trace

__all__ = ["COMPUTE_FORMATS", "DEFAULT_SEMANTICS", "SEMANTICS", "StepSemantics", "get_semantics",
           "mixed_precision_step", "MODELS", "TrainStep", "TrainTrace", "train_trace"]
