"""The team's JAX loop: an MLP computing in fp16 through a jmp policy, jmp's DynamicLossScale, optax (clipping
and Adam), recorded by ``fpemu.record_jax`` (one line inside the jitted step, one after it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

POLICY = jmp.get_policy("params=float32,compute=float16,output=float32")


def init(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"w1": jnp.asarray(rng.normal(0, 0.25, (16, 32)), jnp.float32), "b1": jnp.zeros(32, jnp.float32),
            "w2": jnp.asarray(rng.normal(0, 0.25, (32, 4)), jnp.float32), "b2": jnp.zeros(4, jnp.float32)}


def forward(params, x):
    p, x = POLICY.cast_to_compute((params, x))
    hidden = jax.nn.gelu(x @ p["w1"] + p["b1"])
    return POLICY.cast_to_output(hidden @ p["w2"] + p["b2"])


def data(steps: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.normal(size=(steps, 32, 16)), jnp.float32),
            jnp.asarray(4.0 * rng.normal(size=(steps, 32, 4)), jnp.float32))


def train(steps: int = 12, init_scale: float = 2.0 ** 20, period: int = 3, path=None):
    """Train and return the recorded trace."""
    import fpemu
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    recorder = fpemu.record_jax("fp16", name="jax_loop", scaler="jmp", path=path,
                                params={"loss_scale": init_scale, "period": period})

    @jax.jit
    def step(params, opt_state, scale, x, y):
        def loss_fn(p):
            loss = jnp.mean((forward(p, x) - y) ** 2)
            return scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads = scale.unscale(grads)
        stats = recorder.grad_stats(grads, scale=scale.loss_scale)  # fpemu: as the fp16 backward held them
        finite = jmp.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        params, opt_state = jmp.select_tree(finite, (optax.apply_updates(params, updates), new_opt_state),
                                            (params, opt_state))
        return params, opt_state, scale.adjust(finite), stats, loss, optax.global_norm(grads)

    params = init()
    opt_state = optimizer.init(params)
    scale = jmp.DynamicLossScale(jnp.float32(init_scale), period=period)
    xs, ys = data(steps)
    with recorder:
        for index in range(steps):
            new_params, opt_state, new_scale, stats, loss, norm = step(params, opt_state, scale, xs[index], ys[index])
            recorder.record(stats, scale_state=scale, next_scale_state=new_scale, loss=loss, grad_norm=norm,
                            params_before=params, params_after=new_params)  # whether the update ran, observed
            params, scale = new_params, new_scale
    return recorder.trace()
