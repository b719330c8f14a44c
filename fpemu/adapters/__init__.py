"""Adapters drive real implementations through the same scenarios as the reference models.

Each adapter module imports its framework on first use, so ``import fpemu``
never needs torch or JAX.  ``available(name)`` tells whether an adapter's
packages are installed, and ``unavailable_reason(name)`` says why not.
"""

from __future__ import annotations

import importlib
import importlib.util

# adapter name -> (module, packages it needs)
SCALER_ADAPTERS = {
    "torch": ("fpemu.adapters.torch_amp", ("torch",)),
    "torch_sharded": ("fpemu.adapters.torch_amp", ("torch",)),
    "jmp": ("fpemu.adapters.jax_scalers", ("jax", "jmp")),
    "flax": ("fpemu.adapters.jax_scalers", ("jax", "flax")),
    "keras": ("fpemu.adapters.keras_scaler", ("jax", "keras")),
    "optax": ("fpemu.adapters.jax_scalers", ("jax", "optax")),
}

# Seed 002's mixed-precision step, run by the real frameworks (for step scenarios).
STEP_ADAPTERS = {
    "jax_step": ("fpemu.adapters.jax_step", ("jax",)),
    "torch_step": ("fpemu.adapters.torch_step", ("torch",)),
}
ADAPTERS = {**SCALER_ADAPTERS, **STEP_ADAPTERS}


def unavailable_reason(name: str):
    """None if adapter ``name`` can run here, else the reason it cannot."""
    if name not in ADAPTERS:
        return f"no adapter named {name!r}; adapters: {', '.join(ADAPTERS)}"
    missing = [pkg for pkg in ADAPTERS[name][1] if importlib.util.find_spec(pkg) is None]
    return f"{', '.join(missing)} not installed" if missing else None


def available(name: str) -> bool:
    return unavailable_reason(name) is None


def record_scaler(name: str, overflows, **params):
    """Drive the real implementation ``name`` through ``overflows``; returns a ScalerTrace."""
    reason = unavailable_reason(name)
    if reason:
        raise RuntimeError(f"adapter {name!r} cannot run: {reason}")
    module = importlib.import_module(SCALER_ADAPTERS[name][0])
    return getattr(module, f"record_{name}")(overflows, **params)
