"""Keras 3 LossScaleOptimizer on the JAX backend, driven through stateless_apply under jax.jit.

The stateful ``apply`` fails on JAX (UnexpectedTracerError: its lax.cond has side
effects), and JAX's own trainer uses ``stateless_apply``, so that is what runs here.
"""

from __future__ import annotations

import os
import sys

from fpemu.adapters.observed import observed_trace
from fpemu.errors import RefusedCall


def _import_keras():
    # Keras reads its backend once, as it is imported: set for that import alone, so that the traces of
    # later jobs in this process (their environment flags) do not depend on a keras job before them.
    given, first = os.environ.get("KERAS_BACKEND"), "keras" not in sys.modules
    if first:
        os.environ["KERAS_BACKEND"] = given or "jax"
    try:
        import keras
    finally:
        if first and given is None:
            del os.environ["KERAS_BACKEND"]
    if keras.backend.backend() != "jax":
        raise RuntimeError(f"the keras adapter needs KERAS_BACKEND=jax, got {keras.backend.backend()!r}")
    return keras


def _drive(overflows, params, optimizer_args=None) -> dict:
    """Run a LossScaleOptimizer over SGD(learning_rate=1) through ``overflows`` (a gradient of 1.0,
    or inf on an overflow step); per step: the scale before it, whether the inner optimizer's
    update ran, the growth counter, the public ``optimizer.iterations`` after it and the update.

    Args:
      optimizer_args: more keyword arguments for LossScaleOptimizer (a release may refuse them).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    keras = _import_keras()
    variable = keras.Variable(np.float32(0.0), dtype="float32")
    try:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), **params,
                                                        **(optimizer_args or {}))
    except ValueError as error:  # Keras refuses an argument it used to take with a ValueError, not a TypeError
        if not optimizer_args:
            raise
        raise RefusedCall(f"LossScaleOptimizer({', '.join(f'{k}=' for k in optimizer_args)}) refused") from error
    optimizer.build([variable])
    paths = [v.path for v in optimizer.variables]
    scale_index = next(i for i, p in enumerate(paths) if p.endswith("dynamic_scale"))
    counter_index = next(i for i, p in enumerate(paths) if p.endswith("step_counter"))
    # The inner optimizer's iteration count moves only when the scaler lets its update run.
    inner_index = next(i for i, p in enumerate(paths)
                       if p.endswith("/iteration") and not p.startswith(optimizer.name))
    # What the public attribute reads: its own count before Keras 3.9, the inner optimizer's after.
    public_index = paths.index(optimizer.iterations.path)
    state = [v.value for v in optimizer.variables]
    apply = jax.jit(lambda opt_vars, grad, param: optimizer.stateless_apply(opt_vars, [grad], [param]))
    param = variable.value
    seen = {"scales": [], "applied": [], "counters": [], "iterations": [], "updates": []}
    for overflow in overflows:
        seen["scales"].append(float(state[scale_index]))
        before, moved_from = int(state[inner_index]), float(param)
        (param,), state = apply(state, jnp.float32(np.inf if overflow else 1.0), param)
        seen["applied"].append(int(state[inner_index]) > before)
        seen["counters"].append(int(state[counter_index]))
        seen["iterations"].append(int(state[public_index]))
        seen["updates"].append(moved_from - float(param))
    seen["final_scale"] = float(state[scale_index])
    seen["read_back"] = {"initial_scale": float(optimizer.initial_scale),
                         "dynamic_growth_steps": optimizer.dynamic_growth_steps}
    return seen


def record_keras(overflows, params, device):
    seen = _drive(overflows, params)
    return observed_trace("keras", params, overflows, seen["scales"], seen["applied"], seen["counters"],
                          seen["final_scale"], read_back=seen["read_back"])


def record_keras_iterations(overflows, params, device):
    """The scaler as a loop sees it through the public ``optimizer.iterations`` (what a learning-rate
    schedule reads): a step counts as applied when that count moved.  Keras 3.9 made the attribute
    return the inner optimizer's count, which moves on applied updates only."""
    seen = _drive(overflows, params)
    counts = [0] + seen["iterations"]
    applied = [after > before for before, after in zip(counts, counts[1:])]
    return observed_trace("keras", params, overflows, seen["scales"], applied, seen["counters"],
                          seen["final_scale"], read_back=seen["read_back"])


CLIPNORM = 0.5  # below the scaled gradient (1.0): a clip of the scaled gradient shows in the update


def record_keras_clipnorm(overflows, params, device):
    """LossScaleOptimizer given ``clipnorm=`` (as Keras 2 code passes it); the update ratio says what
    the clip did (1: nothing, the unscaled gradient is far below it; 0.5: the scaled gradient was
    clipped).  Keras 3.12 refuses the argument (ValueError: set it on the inner optimizer): ``api changed``."""
    seen = _drive(overflows, params, {"clipnorm": CLIPNORM})
    ratios = [update * scale for update, scale in zip(seen["updates"], seen["scales"])]  # unscaled update: 1/scale
    return observed_trace("keras", params, overflows, seen["scales"], seen["applied"], seen["counters"],
                          seen["final_scale"], update_ratio=ratios, read_back=seen["read_back"])
