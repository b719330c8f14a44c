"""Record a user's own training run as a trace (the schema is fpemu.traces.recorded)."""

from fpemu.recorders.jax_run import JaxRecorder, record_jax
from fpemu.recorders.torch_run import TorchRecorder, record_torch

__all__ = ["JaxRecorder", "TorchRecorder", "record_jax", "record_torch"]
