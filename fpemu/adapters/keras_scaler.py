"""Keras 3 LossScaleOptimizer on the JAX backend, driven through stateless_apply under jax.jit.

The stateful ``apply`` fails on JAX (UnexpectedTracerError: its lax.cond has side
effects), and JAX's own trainer uses ``stateless_apply``, so that is what runs here.
"""

from __future__ import annotations

import os

from fpemu.adapters._trace import observed_trace


def _import_keras():
    if "keras" not in __import__("sys").modules:
        os.environ.setdefault("KERAS_BACKEND", "jax")
    import keras
    if keras.backend.backend() != "jax":
        raise RuntimeError(f"the keras adapter needs KERAS_BACKEND=jax, got {keras.backend.backend()!r}")
    return keras


def record_keras(overflows, params, device):
    import jax
    import jax.numpy as jnp
    import numpy as np
    keras = _import_keras()
    variable = keras.Variable(np.float32(0.0), dtype="float32")
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(learning_rate=1.0), **params)
    optimizer.build([variable])
    paths = [v.path for v in optimizer.variables]
    scale_index = next(i for i, p in enumerate(paths) if p.endswith("dynamic_scale"))
    counter_index = next(i for i, p in enumerate(paths) if p.endswith("step_counter"))
    # The inner optimizer's iteration count moves only when the scaler lets its update run.
    inner_index = next(i for i, p in enumerate(paths)
                       if p.endswith("/iteration") and not p.startswith(optimizer.name))
    state = [v.value for v in optimizer.variables]
    apply = jax.jit(lambda opt_vars, grad, param: optimizer.stateless_apply(opt_vars, [grad], [param]))
    param = variable.value
    scales, applied, counters = [], [], []
    for overflow in overflows:
        scales.append(float(state[scale_index]))
        before = int(state[inner_index])
        (param,), state = apply(state, jnp.float32(np.inf if overflow else 1.0), param)
        applied.append(int(state[inner_index]) > before)
        counters.append(int(state[counter_index]))
    read_back = {"initial_scale": float(optimizer.initial_scale), "dynamic_growth_steps": optimizer.dynamic_growth_steps}
    return observed_trace("keras", params, overflows, scales, applied, counters, float(state[scale_index]),
                          read_back=read_back)
