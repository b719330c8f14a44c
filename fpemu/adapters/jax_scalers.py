"""jmp.DynamicLossScale, flax DynamicScale and optax.apply_if_finite, driven for real.

Each adapter imports only its own package (jmp needs no flax).  They run under
``jax.jit`` as a training step does; ``jmp_eager`` calls ``adjust`` op by op, which
computes differently (see the jmp profiles).
"""

from __future__ import annotations

import dataclasses
import functools

from fpemu.adapters.observed import observed_trace


@functools.lru_cache(maxsize=None)
def _jitted_adjust():
    import jax
    return jax.jit(lambda scale, finite: scale.adjust(finite))


@functools.lru_cache(maxsize=None)
def _jitted_flax_step():
    import jax

    def flax_step(dynamic_scale, param, grad):
        # d(param * grad)/d(param) = grad, so grad is the unscaled gradient of this step.
        return dynamic_scale.value_and_grad(lambda p, g: p * g)(param, grad)

    return jax.jit(flax_step)


def _drive_jmp(name, overflows, params, adjust):
    import jax.numpy as jnp
    import jmp
    import numpy as np
    kwargs = {k: v for k, v in params.items() if k != "loss_scale"}
    if "min_loss_scale" in kwargs:
        kwargs["min_loss_scale"] = np.float32(kwargs["min_loss_scale"])
    loss_scale = jmp.DynamicLossScale(jnp.float32(params["loss_scale"]), **kwargs)
    scales, counters = [], []
    for overflow in overflows:
        scales.append(float(loss_scale.loss_scale))
        loss_scale = adjust(loss_scale, jnp.asarray(not overflow))
        counters.append(int(loss_scale.counter))
    # jmp leaves skipping to the caller (jmp.select_tree on grads_finite).
    applied = [not o for o in overflows]
    # Read back after the steps: under jit the state that comes out has lost min_loss_scale.
    read_back = {"loss_scale": float(params["loss_scale"]), "period": loss_scale.period,
                 "factor": loss_scale.factor, "min_loss_scale": float(loss_scale.min_loss_scale)}
    return observed_trace(name, params, overflows, scales, applied, counters, float(loss_scale.loss_scale),
                          read_back=read_back)


def record_jmp(overflows, params, device):
    return _drive_jmp("jmp", overflows, params, _jitted_adjust())


def record_jmp_eager(overflows, params, device):
    return _drive_jmp("jmp_eager", overflows, params, lambda scale, finite: scale.adjust(finite))


def record_flax(overflows, params, device):
    import jax.numpy as jnp
    import numpy as np
    from flax.training.dynamic_scale import DynamicScale
    kwargs = dict(params)
    if "scale" in kwargs:
        kwargs["scale"] = jnp.float32(kwargs["scale"])
    dynamic_scale = DynamicScale(**kwargs)
    # Every dataclass field but the state it updates: a release without minimum_scale claims none.
    read_back = {field.name: getattr(dynamic_scale, field.name) for field in dataclasses.fields(dynamic_scale)
                 if field.name != "fin_steps"}
    read_back = {k: float(v) if k != "growth_interval" and v is not None else v for k, v in read_back.items()}
    step = _jitted_flax_step()
    scales, applied, counters = [], [], []
    for overflow in overflows:
        scales.append(float(dynamic_scale.scale))
        dynamic_scale, finite, _, _ = step(dynamic_scale, jnp.float32(0.0), jnp.float32(np.inf if overflow else 1.0))
        applied.append(bool(finite))
        counters.append(int(dynamic_scale.fin_steps))
    return observed_trace("flax", params, overflows, scales, applied, counters, float(dynamic_scale.scale),
                          read_back=read_back)


def record_optax(overflows, params, device):
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    transform = optax.apply_if_finite(optax.sgd(1.0), **params)
    state = transform.init(jnp.zeros(()))
    update = jax.jit(transform.update)
    applied, counters = [], []
    for overflow in overflows:
        step, state = update(jnp.float32(np.inf if overflow else 1.0), state, jnp.zeros(()))
        applied.append(float(step) != 0.0)
        counters.append(int(state.notfinite_count))
    return observed_trace("optax", params, overflows, [1.0] * len(overflows), applied, counters, 1.0)
