"""Emulate a framework's training step in any format on the CPU: policies, telemetry, the torch mode,
the JAX interpreter (and, opt-in, the compiled program checked against it).

torch is imported on first use of :func:`emulate_torch`, JAX on first use of :func:`emulate_jax` (the
policies and telemetry import no framework).
"""

from fpemu.emulate.policy import POLICIES, Policy, get_policy
from fpemu.emulate.telemetry import COUNTERS, NonFinite, Telemetry, TelemetrySummary

__all__ = ["POLICIES", "Policy", "get_policy", "COUNTERS", "NonFinite", "Telemetry", "TelemetrySummary",
           "emulate_torch", "op_table", "emulate_jax"]


def emulate_torch(policy="cuda_autocast_fp16", **kwargs):
    """See :func:`fpemu.emulate._torch_mode.emulate_torch` (imports torch)."""
    from fpemu.emulate._torch_mode import emulate_torch as run
    return run(policy, **kwargs)


def op_table(policy) -> dict:
    """See :func:`fpemu.emulate._torch_mode.op_table` (imports torch)."""
    from fpemu.emulate._torch_mode import op_table as table
    return table(policy)


def emulate_jax(fn, policy="program", **kwargs):
    """See :func:`fpemu.emulate._jax_compiled.emulate_jax` (imports JAX)."""
    from fpemu.emulate._jax_compiled import emulate_jax as run
    return run(fn, policy, **kwargs)
