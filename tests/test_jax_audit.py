"""audit_jax_loop's checks on real jitted loops (jmp + optax, flax DynamicScale): each loop with the
mistake gives the finding, the same loop fixed gives none."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jmp = pytest.importorskip("jmp")
optax = pytest.importorskip("optax")
jnp = jax.numpy

from fpemu.audits import audit_jax_loop  # noqa: E402
from fpemu.audits.jax_loop import JaxStep  # noqa: E402

CLIP = 0.5
BAD_STEPS = (2, 5)  # an input with inf: the scaled gradients overflow


def _batch(step):
    x = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(4, 3) * (1 + step)
    if step in BAD_STEPS:
        x[0, 0] = np.inf
    return jnp.asarray(x), jnp.ones((4, 1), jnp.float32)


def _loss(params, x, y):
    return jnp.mean((x.astype(jnp.float16) @ params["w"].astype(jnp.float16)).astype(jnp.float32) - y) ** 2


def jmp_loop(*, clip_scaled=False, keep_skipped_opt_state=True, steps=8, optimizer=optax.adam):
    """jmp.DynamicLossScale + an optax optimizer on a cosine schedule, clipping by global norm;
    returns the records."""
    optimizer = optimizer(optax.cosine_decay_schedule(1e-2, decay_steps=steps))
    clip = optax.clip_by_global_norm(CLIP)

    @jax.jit
    def train_step(params, opt_state, loss_scale, x, y):
        grads = jax.grad(lambda p: loss_scale.scale(_loss(p, x, y)))(params)
        unscaled = loss_scale.unscale(grads)
        if clip_scaled:  # the mistake: the limit applies to the scaled gradients
            clipped = loss_scale.unscale(clip.update(grads, clip.init(grads))[0])
        else:
            clipped = clip.update(unscaled, clip.init(unscaled))[0]
        finite = jmp.all_finite(grads)
        updates, new_opt_state = optimizer.update(clipped, opt_state, params)
        new_params = jmp.select_tree(finite, optax.apply_updates(params, updates), params)
        if keep_skipped_opt_state:
            new_opt_state = jmp.select_tree(finite, new_opt_state, opt_state)
        step = dict(scale_state=loss_scale, grads=grads,  # JaxStep's fields (a dict: jit returns pytrees)
                    update=jax.tree_util.tree_map(jnp.subtract, new_params, params),
                    grad_norm=optax.global_norm(unscaled), clipped_norm=optax.global_norm(clipped),
                    clip_norm=CLIP, schedule_count=new_opt_state[1].count)
        return new_params, new_opt_state, loss_scale.adjust(finite), step

    params = {"w": jnp.full((3, 1), 0.7, jnp.float32)}
    opt_state, loss_scale = optimizer.init(params), jmp.DynamicLossScale(jnp.float32(2.0 ** 10), period=2)
    records = []
    for step in range(steps):
        params, opt_state, loss_scale, record = train_step(params, opt_state, loss_scale, *_batch(step))
        records.append(record)
    return records


def test_fixed_loop_has_no_findings():
    result = audit_jax_loop(jmp_loop())
    assert result.findings == ()
    assert (result.accounting.completed_updates, result.accounting.scheduler_steps) == (6, 6)


def test_clip_before_unscale():
    result = audit_jax_loop(jmp_loop(clip_scaled=True))
    assert result.kinds == {"clip_before_unscale"}
    found = result.of_kind("clip_before_unscale")
    assert all(f.step not in BAD_STEPS for f in found) and len(found) == 6
    first = found[0]
    # the scaled gradients were clipped to CLIP, then divided by the scale the step used (2^10)
    assert first.effect["clipped_norm"] == pytest.approx(CLIP / 2 ** 10, rel=1e-5)
    assert first.effect["shrink"] == pytest.approx(first.effect["expected_norm"] * 2 ** 10 / CLIP, rel=1e-5)
    assert first.effect["update_norm"] > 0  # Adam normalises: the update is not 1024x smaller
    assert "loss_scale.unscale(grads) before optax.clip_by_global_norm" in first.fix


def test_scheduler_on_skipped_update():
    # SGD: a kept Adam state would also carry the skipped step's inf into its moments
    result = audit_jax_loop(jmp_loop(keep_skipped_opt_state=False, optimizer=optax.sgd))
    assert result.kinds == {"scheduler_on_skipped_update"}
    assert [f.step for f in result.findings] == list(BAD_STEPS)
    assert result.findings[-1].effect == {"schedule_count": 6, "completed_updates": 4, "lead": 2}
    assert audit_jax_loop(jmp_loop(optimizer=optax.sgd)).findings == ()
    assert result.accounting.scheduler_steps == 8 and result.accounting.completed_updates == 6


def flax_loop(*, carry):
    """flax DynamicScale; ``carry`` False passes the initial DynamicScale to every step."""
    from flax.training.dynamic_scale import DynamicScale

    @jax.jit
    def train_step(params, dynamic_scale, x, y):
        new_scale, is_fin, _, grads = dynamic_scale.value_and_grad(_loss)(params, x, y)
        new_params = jax.tree_util.tree_map(lambda p, g: jnp.where(is_fin, p - 0.01 * g, p), params, grads)
        return new_params, new_scale, (dynamic_scale, grads, jax.tree_util.tree_map(jnp.subtract, new_params, params))

    initial = DynamicScale(growth_interval=3, scale=jnp.float32(2.0 ** 10))
    params, dynamic_scale, records = {"w": jnp.full((3, 1), 0.7, jnp.float32)}, initial, []
    for step in range(8):
        params, new_scale, record = train_step(params, dynamic_scale if carry else initial, *_batch(step))
        dynamic_scale = new_scale
        records.append(record)
    return records


def test_flax_scale_state_not_carried():
    assert audit_jax_loop(flax_loop(carry=True)).findings == ()
    result = audit_jax_loop(flax_loop(carry=False))
    assert result.kinds == {"scale_not_carried"}
    found = {f.step: f.effect for f in result.findings}
    assert found[1] == {"counter_before": 0, "counter_after": 0}  # found after one step, not growth_interval
    assert found[3] == {"scale_before": 1024.0, "scale_after": 1024.0}  # step 2 overflowed, no backoff


def test_bad_records():
    with pytest.raises(TypeError, match="records\\[0\\] must have keys among scale_state, grads, update"):
        audit_jax_loop([{"scale_state": 1.0, "grads": [1.0], "update": [0.0], "lr": 0.1}])
    with pytest.raises(TypeError, match="must be a \\(scale_state, grads, update\\) tuple or a JaxStep"):
        audit_jax_loop([(1.0, [1.0])])
    step = JaxStep(1.0, [1.0], [0.1], grad_norm=2.0, clipped_norm=1.0, clip_norm=1.0)
    assert audit_jax_loop([step]).findings == ()  # no scale: nothing to clip before
