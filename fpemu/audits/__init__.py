"""Audits of training loops against the mixed-precision contract, and loss-scale advice.

``audit_torch`` watches a real torch loop (torch is imported on first use); ``audit_jax_loop``
checks the records of a JAX loop (numpy arrays in); ``advise_loss_scale`` needs numpy only.
"""

from fpemu.audits.advice import LayerFit, LossScaleAdvice, advise_loss_scale
from fpemu.audits.findings import FIXES, AuditResult, Finding, LoopAccounting
from fpemu.audits.jax_loop import JaxStep, audit_jax_loop
from fpemu.audits.torch_loop import TorchLoopAudit, audit_torch

__all__ = ["LayerFit", "LossScaleAdvice", "advise_loss_scale", "FIXES", "AuditResult", "Finding",
           "LoopAccounting", "JaxStep", "audit_jax_loop", "TorchLoopAudit", "audit_torch"]
