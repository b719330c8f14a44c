"""The differential harness: golden traces, real implementations, comparison, upgrade audits."""

from fpemu.harness.jobs import AuditChange, audit, diff, implementations_for, record, write_golden
from fpemu.kinds import record_trace, reference_trace
from fpemu.kinds.fp8_training import float8_training_traces

__all__ = ["AuditChange", "audit", "diff", "implementations_for", "record", "write_golden", "record_trace",
           "reference_trace", "float8_training_traces"]
