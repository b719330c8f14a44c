"""The loss-scale loop for JAX: N steps of a user's gradient and update functions, emulated, under a
scaler profile.

A JAX training step is pure, so the scaler is the loop's, not the program's: each step the loop
calls ``grads(state, scale, index)`` (the loss and the gradients of ``scale * loss``) through
:func:`emulate_jax`, checks and unscales the gradients with fpemu's model of the chosen profile (its
unscale arithmetic and inf check: ``fpemu.unscale``, ``step_overflowed``), calls
``update(state, unscaled_grads, index)`` through :func:`emulate_jax` unless the profile skips the
step, and moves the scale by the profile's rules (:class:`fpemu.scalers.ScalerRules`), as the torch
loop's ``EmulatedScaler`` does for ``GradScaler``'s interface.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fpemu.emulate._jax_compiled import emulate_jax
from fpemu.emulate.policy import scaler_rules
from fpemu.emulate.telemetry import Telemetry
from fpemu.emulate.trace import StepRecord
from fpemu.errors import FpemuInputError, raised
from fpemu.scalers import step_overflowed, unscale


def _flat_float32(tree) -> list:
    return [np.asarray(leaf, np.float32) for leaf in jax.tree_util.tree_leaves(tree)]


def run_jax_steps(grads, update, state, *, steps: int, policy="program", semantics="jax_cpu_strict",
                  profile="flax", params=None, where="step", on_step=None, compiled=False):
    """Run ``steps`` emulated steps of ``grads`` and ``update`` from ``state`` under a scaler profile.

    Args:
      grads: ``grads(state, scale, index) -> (loss, scaled_grads)``: a JAX function; ``scale`` is a
        float32 scalar, ``index`` an int32 scalar (both traced).
      update: ``update(state, grads, index) -> state``: applies the unscaled gradients.
      state: the initial state (a pytree of arrays).
      steps: steps to run (fewer if the scaler stops training).
      policy, semantics: as :func:`emulate_jax`.
      profile, params: the scaler profile and its parameters.
      where: how errors name the step's source (the model file).
      on_step: called with each step's index before it runs (fpemu.emulate.isolated times each step by it).
      compiled: as :func:`emulate_jax` (None: one compiled program where it computes what the interpreter
        does; False, the default: the interpreter).

    Returns:
      (list of :class:`StepRecord`, the whole run's TelemetrySummary, the final state).

    Raises:
      FpemuInputError: a primitive the interpreter cannot place; a function that raised (naming
        ``where``, the step and the module it raised in); a loss that is not a scalar.

    Example::

        records, telemetry, state = run_jax_steps(grads, update, state, steps=20, profile="flax")
    """
    chosen, rules = scaler_rules(profile, params)
    scaler = rules.init()
    telemetry, whole = Telemetry(), Telemetry()
    emulated_grads = emulate_jax(grads, policy, semantics=semantics, telemetry=telemetry, compiled=compiled)
    emulated_update = emulate_jax(update, policy, semantics=semantics, telemetry=telemetry, compiled=compiled)
    records = []
    for index in range(steps):
        if on_step is not None:
            on_step(index)
        telemetry.reset_step(index)
        telemetry.location = None
        step = np.int32(index)
        loss, scaled = _pair(_call(emulated_grads, (state, np.float32(scaler.scale), step), where, index, telemetry),
                             where, index)
        leaves = _flat_float32(scaled)
        flat = np.concatenate([leaf.ravel() for leaf in leaves]) if leaves else np.zeros(0, np.float32)
        overflow = bool(step_overflowed(flat, scaler.scale, chosen))
        if not overflow:
            unscaled = [unscale(leaf, scaler.scale, chosen).astype(np.asarray(original).dtype)
                        for leaf, original in zip(leaves, jax.tree_util.tree_leaves(scaled))]
            unscaled = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(scaled), unscaled)
            state = _call(emulated_update, (state, unscaled, step), where, index, telemetry)
        scaler = rules.update(scaler, overflow).state
        summary = telemetry.summary()
        whole.merge(summary)
        records.append(StepRecord(overflow, _loss_value(loss, where, index), summary))
        if scaler.stopped:
            break
    return records, whole.summary(), state


def _call(emulated, args, where: str, index: int, telemetry: Telemetry):
    try:
        return emulated(*args)
    except Exception as error:
        module = f" (in module {telemetry.location})" if telemetry.location else ""
        if isinstance(error, FpemuInputError):  # a primitive the interpreter cannot place
            raise FpemuInputError(f"{where}: step {index}{module}: {error}") from error
        raise FpemuInputError(f"{where}: step {index} raised {raised(error)}{module}") from error


def _pair(out, where: str, index: int) -> tuple:
    """What ``grads`` returned, checked: ``(loss, grads)``."""
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise FpemuInputError(f"{where}: step {index}: grads() returned {type(out).__name__}; it returns (loss, grads)")
    for path, leaf in jax.tree_util.tree_leaves_with_path(out[1]):
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.floating):  # an int gradient is no gradient
            raise FpemuInputError(f"{where}: step {index}: grads() returned a gradient{jax.tree_util.keystr(path)} "
                                  f"of {dtype or type(leaf).__name__}; gradients are floating-point arrays")
    return tuple(out)


def _loss_value(loss, where: str, index: int) -> float:
    value = np.asarray(loss)
    if value.size != 1:
        raise FpemuInputError(f"{where}: step {index}: grads() returned a loss of shape {value.shape}; it "
                              "returns (loss, grads) with a scalar loss")
    return float(value.astype(np.float32).reshape(()))
