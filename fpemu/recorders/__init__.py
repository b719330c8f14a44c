"""Record a user's own training run as a trace (the schema is fpemu.traces.recorded)."""

from fpemu.recorders.torch_run import TorchRecorder, record_torch

__all__ = ["TorchRecorder", "record_torch"]
