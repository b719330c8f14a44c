"""The JAX recorder on real jitted loops: jmp + optax, flax DynamicScale, optax.apply_if_finite and
Keras 3 on JAX, each a tiny fp16 model whose first steps overflow."""

import doctest

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = jax.numpy
optax = pytest.importorskip("optax")

import fpemu.recorders.jax_run as jax_run  # noqa: E402
from fpemu import quantize, simulate_scaler  # noqa: E402
from fpemu.errors import FpemuInputError  # noqa: E402
from fpemu.formats import get_format, range_stats  # noqa: E402
from fpemu.traces import read_trace  # noqa: E402
from fpemu.traces.binades import CODES, numpy_codes  # noqa: E402
from fpemu.traces.recorded import GroupStats, ShadowHistogram, recorded_steps, rounding_limits  # noqa: E402
from fpemu.recorders.jax_run import grad_stats, host_grad_stats, keras_scale_state, record_jax  # noqa: E402
from tests.trace_checks import bits64  # noqa: E402

FORMATS = ("fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp4_e2m1fn")


def _awkward_values(seed=0):
    """Magnitudes from far below fp16's smallest subnormal to past bf16's max, every rounding boundary
    of every tested format, and zeros, infs and NaNs."""
    rng = np.random.default_rng(seed)
    values = [np.float32(2.0) ** rng.uniform(-150, 128, 4000)]
    for fmt in FORMATS:
        limits = rounding_limits(fmt)
        values.append(np.array(limits, np.float32))
        values.append(np.nextafter(np.array(limits, np.float32), np.float32(np.inf)))
    values.append(np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32))
    flat = np.concatenate(values).astype(np.float32)
    return flat * np.where(rng.random(flat.size) < 0.5, -1, 1).astype(np.float32)


def _expected(grads, fmt, scale=1.0):
    """The statistics from fpemu's full rounding kernel, element by element."""
    scaled = np.asarray(grads, np.float32) * np.float32(scale)
    rounded = np.abs(quantize(scaled, fmt))
    nan = np.isnan(scaled)
    kept = np.where(np.isnan(rounded), np.inf, rounded)[~nan]  # an overflow to NaN (fn formats) counts as inf
    return GroupStats.from_counts(
        elements=scaled.size, zero=int(np.sum(rounded == 0)),
        subnormal=int(np.sum((rounded != 0) & (rounded < get_format(fmt).min_normal))),
        overflow=range_stats(scaled, fmt).overflow, nan=int(nan.sum()),
        max_abs=kept.max(initial=0), min_nonzero=kept[kept != 0].min(initial=np.inf))


def test_in_jit_statistics_are_the_rounding_kernels():
    values = _awkward_values()
    stats = jax.jit(lambda g: {fmt: grad_stats(g, fmt) for fmt in FORMATS})({"w": jnp.asarray(values)})
    for fmt in FORMATS:
        assert host_grad_stats(stats[fmt], fmt) == {"w": _expected(values, fmt)}, fmt


def _raw_row(leaves, fmt):
    """A group's packed row as one reduction per statistic computes it: numpy over the float32 bit patterns."""
    limits = [int(np.array([v], np.float32).view(np.uint32)[0]) for v in rounding_limits(fmt)]
    bits = np.concatenate([np.asarray(leaf, np.float32).reshape(-1).view(np.uint32) & np.uint32(0x7FFFFFFF)
                           for leaf in leaves])
    nan, zero_at_most = bits > 0x7F800000, bits <= limits[0]
    nonzero = ~zero_at_most & ~nan
    return [bits.size, zero_at_most.sum(), (nonzero & (bits <= limits[1])).sum(), ((bits >= limits[2]) & ~nan).sum(),
            nan.sum(), np.where(nan, 0, bits).max(initial=0), np.where(nonzero, bits, 0x7F800000).min(initial=0x7F800000)]


def test_one_pass_statistics_are_the_per_statistic_reductions():
    """grad_stats reduces each leaf in one variadic pass: its packed uint32 rows, raw maxima and minima
    included, are bit for bit those of one reduction per statistic, for leaves alone and grouped."""
    values = _awkward_values(2)
    grads = {"a": {"kernel": jnp.asarray(values[:3000].reshape(60, 50)), "bias": jnp.asarray(values[3000:3100])},
             "b": {"kernel": jnp.asarray(values[3100:]), "empty": jnp.zeros((0,), jnp.float32)}}
    cases = [(fmt, None) for fmt in ("fp16", "bf16", "fp8_e4m3fn", "fp4_e2m1fn")] + [("fp16", 2.0 ** 7), ("bf16", 2.0 ** 7)]
    stats, scaled = jax.jit(lambda g: ([grad_stats(g, fmt, scale=scale, group_by="module") for fmt, scale in cases],
                                       jax.tree_util.tree_map(lambda x: x * 2.0 ** 7, g)))(grads)  # one compile
    for (fmt, scale), got in zip(cases, stats):
        # the product is XLA's (it flushes float32 subnormals): the reference takes it from XLA too
        tree = grads if scale is None else scaled
        leaves = {"a": [tree["a"]["bias"], tree["a"]["kernel"]], "b": [tree["b"]["empty"], tree["b"]["kernel"]]}
        want = np.array([_raw_row(leaves[group], fmt) for group in got.groups], np.uint32)
        assert (np.asarray(got.values) == want).all(), (fmt, scale)


XLA_CASTS = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "fp8_e5m2": jnp.float8_e5m2}


def test_in_jit_statistics_agree_with_xlas_own_cast():
    values = jnp.asarray(_awkward_values(1))
    stats, casts = jax.jit(lambda g: ({fmt: grad_stats([g], fmt)["0"] for fmt in XLA_CASTS},
                                      {fmt: g.astype(dtype) for fmt, dtype in XLA_CASTS.items()}))(values)
    for fmt in XLA_CASTS:
        cast = np.abs(np.asarray(casts[fmt], np.float32))
        assert int(stats[fmt]["zero"]) == int(np.sum(cast == 0)), fmt
        assert int(stats[fmt]["overflow"]) == int(np.sum(np.isinf(cast))), fmt
        assert int(stats[fmt]["subnormal"]) == int(np.sum((cast != 0) & (cast < get_format(fmt).min_normal))), fmt


def test_grouping_by_module_and_scale_argument():
    grads = {"dense": {"kernel": jnp.array([1e-9, 0.5]), "bias": jnp.array([7e4])}, "step": jnp.int32(3)}
    by_module = jax.jit(lambda g: grad_stats(g, "fp16", group_by="module"))(grads)
    assert list(by_module) == ["dense"]  # the integer leaf is no gradient
    assert [int(by_module["dense"][k]) for k in ("elements", "zero", "overflow")] == [3, 1, 1]
    scaled = jax.jit(lambda g, s: grad_stats(g, "fp16", scale=s))(grads, 2.0 ** 20)["dense/kernel"]
    assert (int(scaled["zero"]), int(scaled["overflow"])) == (0, 1)
    with pytest.raises(ValueError, match="group_by must be one of parameter, module"):
        grad_stats(grads, group_by="layer")
    with pytest.raises(FpemuInputError, match="scaler: expected one of"):
        record_jax(name="x", scaler="apex")


def _mlp_params(seed=0):
    rng = np.random.default_rng(seed)
    return {"dense0": {"kernel": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32) * 0.3,
                       "bias": jnp.zeros(16, jnp.float32)},
            "dense1": {"kernel": jnp.asarray(rng.standard_normal((16, 1)), jnp.float32) * 0.3}}


def _mlp_loss(params, x, y, dtype):
    cast = jax.tree_util.tree_map(lambda p: p.astype(dtype), params)
    hidden = jnp.tanh(x.astype(dtype) @ cast["dense0"]["kernel"] + cast["dense0"]["bias"])
    return jnp.mean(((hidden @ cast["dense1"]["kernel"]).astype(jnp.float32) - y) ** 2)


def _batches(steps, seed=1):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        x = rng.standard_normal((32, 8)).astype(np.float32)
        yield jnp.asarray(x), jnp.asarray(np.sin(x.sum(axis=1, keepdims=True)))


def _assert_stats_of(record, grads, scale=1.0):
    """The recorded statistics are those of the gradients the step produced (returned for the test)."""
    host = jax.tree_util.tree_flatten_with_path(grads)[0]
    expected = {"/".join(jax_run._key_name(k) for k in path): _expected(np.asarray(g).ravel(), "fp16", scale)
                for path, g in host}
    assert record.grad_stats == expected


def _assert_scaler_model(trace, profile, **params):
    """The recorded scales and counters are fpemu's model of ``profile`` over the recorded overflows
    (bit for bit); returns the overflows."""
    overflows = trace.column("overflow")
    assert overflows[0] and not all(overflows)  # the first scale overflows fp16, a smaller one fits
    model = simulate_scaler(overflows, profile, **params)
    assert bits64(trace.column("scale")) == bits64(model.scales)
    assert trace.column("growth_counter") == model.growth_counter.tolist()
    assert bits64([trace.summary["final_scale"]]) == bits64([model.final_scale])
    return overflows


def test_jmp_optax_loop(tmp_path):
    jmp = pytest.importorskip("jmp")
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, loss_scale, x, y):
        def scaled_loss(p):
            loss = _mlp_loss(p, x, y, jnp.float16)
            return loss_scale.scale(loss), loss
        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        stats = grad_stats(grads, "fp16")
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        params, opt_state = jmp.select_tree(finite, (optax.apply_updates(params, updates), new_opt_state),
                                            (params, opt_state))
        aux = {"stats": stats, "loss": loss, "finite": finite, "grad_norm": optax.global_norm(grads)}
        return params, opt_state, loss_scale.adjust(finite), aux, grads

    params = _mlp_params()
    opt_state = optimizer.init(params)
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0 ** 18), period=3)
    path = tmp_path / "jmp.json"
    with record_jax("fp16", name="mlp_jmp", scaler="jmp", params={"loss_scale": 2.0 ** 18, "period": 3},
                    batch_size=32, path=path) as recorder:
        for step, (x, y) in enumerate(_batches(8)):
            params, opt_state, new_scale, aux, grads = train_step(params, opt_state, loss_scale, x, y)
            record = recorder.record(aux["stats"], scale_state=loss_scale, next_scale_state=new_scale,
                                     loss=aux["loss"], grad_norm=aux["grad_norm"], overflow=~aux["finite"],
                                     schedule_count=opt_state[0].count)
            if step in (0, 7):  # an overflowing step and a healthy one
                _assert_stats_of(record, jax.tree_util.tree_map(lambda g, s=loss_scale: g * s.loss_scale, grads))
            loss_scale = new_scale
    trace = read_trace(path)
    overflows = _assert_scaler_model(trace, "jmp", loss_scale=2.0 ** 18, period=3)
    assert overflows.count(False) >= 4
    assert trace.summary["skipped_updates"] == sum(overflows) and trace.summary["examples"] == 8 * 32
    meta = trace.metadata
    assert (meta["source"], meta["framework"], meta["recorder"]["compute_format"]) == ("recorded_run", "jax", "fp16")
    assert {"jax", "jmp", "optax"} <= set(meta["packages"]) and "host" in meta
    assert all(np.isfinite(trace.column("loss")))
    assert trace.summary["scheduler_steps"] == trace.summary["completed_updates"]  # select_tree kept the count


def test_shadow_pass_counts_true_underflow():
    """An fp16 backward at scale 1 on a loss of 1e-5: its underflowed values arrive as plain zeros,
    which only the float32 pass over the same batch tells from real zeros."""
    recorder = record_jax("fp16", name="shadow", scaler="static", params={"loss_scale": 1.0}, shadow_every=1)

    @jax.jit
    def shadow_step(params, x, y):
        run = jax.grad(lambda p: _mlp_loss(p, x, y, jnp.float16) * 1e-5)(params)
        exact = jax.grad(lambda p: _mlp_loss(p, x, y, jnp.float32) * 1e-5)(params)
        return recorder.grad_stats(run), recorder.shadow_stats(run, exact), run, exact

    x, y = next(_batches(1))
    stats, shadow, run, exact = shadow_step(_mlp_params(4), x, y)
    step = recorder.record(stats, scale_state=1.0, shadow=shadow)
    for group in ("dense0/kernel", "dense1/kernel"):
        got, want = np.asarray(run[group.split("/")[0]]["kernel"]), np.asarray(exact[group.split("/")[0]]["kernel"])
        lost = (want != 0) & (quantize(got, "fp16") == 0)
        small = (want != 0) & (quantize(got, "fp16") != 0) & (np.abs(got) < get_format("fp16").min_normal)
        assert step.shadow[group].underflow == lost.sum() / lost.size
        assert step.shadow[group].subnormal == small.sum() / small.size
        # the float32 pass by binade, counted inside jit as numpy counts it on the host
        assert step.shadow_histogram[group] == ShadowHistogram.from_counts(
            want.size, np.bincount(numpy_codes(want), minlength=CODES))
    assert step.shadow["dense0/kernel"].underflow > 0.1  # true underflow...
    assert step.grad_stats["dense0/kernel"].zero >= step.shadow["dense0/kernel"].underflow  # ...read as zeros
    trace = recorder.trace()
    assert trace.metadata["recorder"]["shadow_every"] == 1 and "shadow" in trace.steps[0]
    assert recorded_steps(trace)[0].shadow == step.shadow
    assert recorded_steps(trace)[0].shadow_histogram == step.shadow_histogram


def test_flax_dynamic_scale_loop():
    from flax.training.dynamic_scale import DynamicScale
    optimizer = optax.sgd(0.05)
    recorder = record_jax("fp16", name="mlp_flax", scaler="flax", params={"growth_interval": 2, "scale": 2.0 ** 21},
                          group_by="module")

    @jax.jit
    def train_step(params, opt_state, dynamic_scale, x, y):
        grad_fn = dynamic_scale.value_and_grad(lambda p: _mlp_loss(p, x, y, jnp.float16))
        new_scale, is_fin, loss, grads = grad_fn(params)  # grads come back unscaled
        stats = recorder.grad_stats(grads, scale=dynamic_scale.scale)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        params, opt_state = jax.tree_util.tree_map(lambda new, old: jnp.where(is_fin, new, old),
                                                   (optax.apply_updates(params, updates), new_opt_state),
                                                   (params, opt_state))
        return params, opt_state, new_scale, {"stats": stats, "loss": loss, "is_fin": is_fin}

    params = _mlp_params(2)
    opt_state = optimizer.init(params)
    dynamic_scale = DynamicScale(growth_interval=2, scale=jnp.float32(2.0 ** 21))
    for x, y in _batches(10):
        params, opt_state, new_scale, aux = train_step(params, opt_state, dynamic_scale, x, y)
        recorder.record(aux["stats"], scale_state=dynamic_scale, next_scale_state=new_scale, loss=aux["loss"],
                        overflow=~aux["is_fin"])
        dynamic_scale = new_scale
    trace = recorder.trace()
    _assert_scaler_model(trace, "flax", scale=2.0 ** 21, growth_interval=2)
    assert sorted(trace.steps[0]["grad_stats"]) == ["dense0", "dense1"]
    assert recorded_steps(trace)[0].grad_stats["dense0"].elements == 8 * 16 + 16


def test_optax_apply_if_finite_loop():
    optimizer = optax.apply_if_finite(optax.sgd(0.05), max_consecutive_errors=5)
    scale = 2.0 ** 21  # a static scale too large for fp16: the first steps' gradients overflow

    @jax.jit
    def train_step(params, opt_state, x, y):
        grads = jax.grad(lambda p: _mlp_loss(p, x, y, jnp.float16) * scale)(params)
        stats = grad_stats(grads, "fp16")
        updates, opt_state = optimizer.update(jax.tree_util.tree_map(lambda g: g / scale, grads), opt_state)
        return optax.apply_updates(params, updates), opt_state, stats, opt_state.last_finite

    params = _mlp_params(3)
    opt_state = optimizer.init(params)
    recorder = record_jax("fp16", name="mlp_optax", scaler="optax", params={"max_consecutive_errors": 5})
    for x, y in _batches(4):
        params, opt_state, stats, last_finite = train_step(params, opt_state, x, y)
        recorder.record(stats, scale_state=scale, applied=last_finite)
    trace = recorder.trace()
    assert trace.column("overflow") == [not a for a in trace.column("applied")]
    assert any(trace.column("overflow")) and "growth_counter" not in trace.steps[0]


def test_keras_on_jax_loop():
    from fpemu.adapters import unavailable_reason
    from fpemu.adapters.keras_scaler import _import_keras
    if unavailable_reason("keras"):
        pytest.skip(f"keras: {unavailable_reason('keras')}")
    keras = _import_keras()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="tanh", dtype="mixed_float16"),
                              keras.layers.Dense(1, dtype="mixed_float16")])
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05), initial_scale=2.0 ** 21,
                                                    dynamic_growth_steps=2)
    optimizer.build(model.trainable_variables)
    names = [v.path for v in model.trainable_variables]
    # optimizer.scale_loss reads the scale variable, which stateless_apply never writes back: a
    # stateless loop scales by the scale in its own optimizer state.
    scale_index = [v.path for v in optimizer.variables].index(f"{optimizer.name}/dynamic_scale")

    def scaled_loss(trainable, scale, x, y):
        prediction, _ = model.stateless_call(trainable, [], x)
        loss = jnp.mean((prediction.astype(jnp.float32) - y) ** 2)
        return loss * scale, loss

    @jax.jit
    def train_step(trainable, opt_vars, x, y):
        grads, loss = jax.grad(scaled_loss, has_aux=True)(trainable, opt_vars[scale_index], x, y)
        stats = grad_stats(dict(zip(names, grads)), "fp16")
        trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
        return trainable, opt_vars, stats, loss

    trainable = [v.value for v in model.trainable_variables]
    opt_vars = [v.value for v in optimizer.variables]
    recorder = record_jax("fp16", name="mlp_keras", scaler="keras",
                          params={"initial_scale": 2.0 ** 21, "dynamic_growth_steps": 2})
    for x, y in _batches(8):
        before = keras_scale_state(optimizer, opt_vars)
        trainable, opt_vars, stats, loss = train_step(trainable, opt_vars, x, y)
        recorder.record(stats, scale_state=before, next_scale_state=keras_scale_state(optimizer, opt_vars), loss=loss)
    trace = recorder.trace()
    _assert_scaler_model(trace, "keras", initial_scale=2.0 ** 21, dynamic_growth_steps=2)
    assert sorted(trace.steps[0]["grad_stats"]) == sorted(names)


def test_docstring_examples():
    result = doctest.testmod(jax_run, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def _jmp_loop(recorder, guarded: bool, steps: int = 8, observe: bool = True):
    """The jmp + optax loop; ``guarded=False`` applies every update, overflowed or not (no select_tree).  Each
    attempt records what the step really did: ``applied`` from whether the parameters changed (``observe=False``:
    the parameters are not handed over, so the recorder can only assume it)."""
    jmp = pytest.importorskip("jmp")
    optimizer = optax.adam(1e-2)

    @jax.jit
    def train_step(params, opt_state, loss_scale, x, y):
        grads = jax.grad(lambda p: loss_scale.scale(_mlp_loss(p, x, y, jnp.float16)))(params)
        stats = grad_stats(grads, "fp16")
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        new = (optax.apply_updates(params, updates), new_opt_state)
        new_params, opt_state = jmp.select_tree(finite, new, (params, opt_state)) if guarded else new
        return new_params, opt_state, loss_scale.adjust(finite), stats, finite

    params = _mlp_params()
    opt_state = optimizer.init(params)
    loss_scale = jmp.DynamicLossScale(jnp.float32(2.0 ** 18), period=3)
    for x, y in _batches(steps):
        new_params, opt_state, new_scale, stats, finite = train_step(params, opt_state, loss_scale, x, y)
        observed = {"params_before": params, "params_after": new_params} if observe else {}
        recorder.record(stats, scale_state=loss_scale, next_scale_state=new_scale, overflow=~finite, **observed)
        params, loss_scale = new_params, new_scale
    return recorder


def test_applied_is_observed_from_the_parameters_not_inferred():
    """Issue 28: a loop that applies its update on overflowed steps is recorded as applying it."""
    guarded = _jmp_loop(record_jax("fp16", name="guarded", scaler="jmp"), guarded=True).steps
    unguarded = _jmp_loop(record_jax("fp16", name="unguarded", scaler="jmp"), guarded=False).steps
    assert any(s.overflow for s in guarded) and unguarded[0].overflow == guarded[0].overflow
    assert [s.applied for s in guarded] == [not s.overflow for s in guarded]
    first = next(i for i, s in enumerate(unguarded) if s.overflow)
    assert unguarded[first].applied  # the update ran on the inf/NaN gradients: the parameters changed
    assert bool(jax_run.params_changed({"w": jnp.array([jnp.nan, 1.0])}, {"w": jnp.array([jnp.nan, 1.0])})) is False


def test_an_applied_assumed_from_overflow_is_marked_in_the_trace_and_warned_once(tmp_path):
    """Issue 28: without the parameters (or applied=) the recorder cannot see a loop applying inf/NaN updates;
    the trace counts the steps it assumed, so a reader knows 'skips exactly the overflowing steps' was not
    observed there, and the loop's author is told once how to observe it."""
    from fpemu.traces.recorded import recorder_settings
    with pytest.warns(RuntimeWarning, match="assumed from overflow") as warned:
        assumed = _jmp_loop(record_jax("fp16", name="assumed", scaler="jmp"), guarded=False, observe=False)
    assert len([w for w in warned if "assumed from overflow" in str(w.message)]) == 1
    overflowed = [i for i, s in enumerate(assumed.steps) if s.overflow]
    assert overflowed and not any(assumed.steps[i].applied for i in overflowed)  # what it had to assume
    written = read_trace(assumed.write(tmp_path / "assumed.json"))
    assert written.metadata["recorder"]["applied_assumed"] == 8 == recorder_settings(written).applied_assumed
    observed = _jmp_loop(record_jax("fp16", name="observed", scaler="jmp"), guarded=False).trace()
    assert "applied_assumed" not in observed.metadata["recorder"]  # observed runs read as before
    assert recorder_settings(observed).applied_assumed == 0


def test_scaler_parameters_come_from_the_real_state_not_the_caller():
    """Issue 28: stale parameters passed by the caller (period 5, scale 2^10) lose to the state's (period 3,
    2^18), so the trace replays under its own profile and parameters as the run went."""
    from fpemu.traces.replay import replay
    recorder = _jmp_loop(record_jax("fp16", name="stale", scaler="jmp", params={"loss_scale": 2.0 ** 10, "period": 5}),
                         guarded=True)
    trace = recorder.trace()
    assert trace.metadata["params"] == {"loss_scale": 2.0 ** 18, "period": 3, "factor": 2, "min_loss_scale": 1.0}
    same = replay(trace, "jmp", **trace.metadata["params"])
    assert [float(s) for s in same.trace.scales] == [s.scale for s in recorder.steps]
    assert jax_run.state_params(2.0 ** 15, "jmp") == {}
