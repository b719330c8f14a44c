"""jmp.DynamicLossScale, flax DynamicScale and optax.apply_if_finite, driven for real under jax.jit."""

from __future__ import annotations

import functools

from fpemu.adapters._trace import observed_trace


@functools.lru_cache(maxsize=None)
def _jitted():
    import jax
    from flax.training.dynamic_scale import DynamicScale  # noqa: F401  (imported for its pytree)

    def flax_step(dynamic_scale, param, grad):
        # d(param * grad)/d(param) = grad, so grad is the unscaled gradient of this step.
        return dynamic_scale.value_and_grad(lambda p, g: p * g)(param, grad)

    return {"jmp": jax.jit(lambda scale, finite: scale.adjust(finite)), "flax": jax.jit(flax_step)}


def record_jmp(overflows, **params):
    import jax.numpy as jnp
    import jmp
    import numpy as np
    overflows = [bool(o) for o in overflows]
    kwargs = {k: v for k, v in params.items() if k != "loss_scale"}
    if "min_loss_scale" in kwargs:
        kwargs["min_loss_scale"] = np.float32(kwargs["min_loss_scale"])
    loss_scale = jmp.DynamicLossScale(jnp.float32(params["loss_scale"]), **kwargs)
    adjust = _jitted()["jmp"]
    scales, counters = [], []
    for overflow in overflows:
        scales.append(float(loss_scale.loss_scale))
        loss_scale = adjust(loss_scale, jnp.asarray(not overflow))
        counters.append(int(loss_scale.counter))
    # jmp leaves skipping to the caller (jmp.select_tree on grads_finite).
    applied = [not o for o in overflows]
    return observed_trace("jmp", params, overflows, scales, applied, counters, float(loss_scale.loss_scale))


def record_flax(overflows, **params):
    import jax.numpy as jnp
    import numpy as np
    from flax.training.dynamic_scale import DynamicScale
    overflows = [bool(o) for o in overflows]
    kwargs = dict(params)
    if "scale" in kwargs:
        kwargs["scale"] = jnp.float32(kwargs["scale"])
    dynamic_scale = DynamicScale(**kwargs)
    step = _jitted()["flax"]
    scales, applied, counters = [], [], []
    for overflow in overflows:
        scales.append(float(dynamic_scale.scale))
        dynamic_scale, finite, _, _ = step(dynamic_scale, jnp.float32(0.0), jnp.float32(np.inf if overflow else 1.0))
        applied.append(bool(finite))
        counters.append(int(dynamic_scale.fin_steps))
    return observed_trace("flax", params, overflows, scales, applied, counters, float(dynamic_scale.scale))


def record_optax(overflows, **params):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    overflows = [bool(o) for o in overflows]
    transform = optax.apply_if_finite(optax.sgd(1.0), **params)
    state = transform.init(jnp.zeros(()))
    update = jax.jit(transform.update)
    applied, counters = [], []
    for overflow in overflows:
        step, state = update(jnp.float32(np.inf if overflow else 1.0), state, jnp.zeros(()))
        applied.append(float(step) != 0.0)
        counters.append(int(state.notfinite_count))
    return observed_trace("optax", params, overflows, [1.0] * len(overflows), applied, counters, 1.0)
