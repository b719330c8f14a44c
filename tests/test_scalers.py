import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from packaging.version import Version

from hypothesis_budget import profile_examples
from trace_checks import assert_same_trace, bits32

import fpemu
from fpemu.adapters import record_scaler, unavailable_reason
from fpemu.scalers import ScalerRules, ScalerState, run_rules


# --- seed 000 -------------------------------------------------------------

def test_seed_examples():
    assert fpemu.dynamic_loss_scale([False, True, False, False, False], init_scale=8.0, growth_interval=2) == \
        {"scales": [8.0, 8.0, 4.0, 4.0, 8.0], "skipped": [1], "final_scale": 8.0}
    assert fpemu.dynamic_loss_scale([True, True, True], init_scale=1024.0) == \
        {"scales": [1024.0, 512.0, 256.0], "skipped": [0, 1, 2], "final_scale": 128.0}


def test_seed_conventions():
    empty = fpemu.dynamic_loss_scale([], init_scale=7)
    assert empty == {"scales": [], "skipped": [], "final_scale": 7.0} and type(empty["final_scale"]) is float
    out = fpemu.dynamic_loss_scale([False, False], init_scale=3, growth_interval=1, growth_factor=1.5)
    assert out["scales"] == [3.0, 4.5] and all(type(s) is float for s in out["scales"])
    assert out["final_scale"] == 6.75  # Python float arithmetic, no float32 rounding


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(init_scale=0.0), ValueError, "init_scale must be positive"),
    (dict(init_scale=math.inf), ValueError, "init_scale must be positive and finite"),
    (dict(growth_factor=1.0), ValueError, "growth_factor must be greater than 1"),
    (dict(backoff_factor=1.0), ValueError, r"backoff_factor must be in \(0, 1\)"),
    (dict(growth_interval=0), ValueError, "growth_interval must be at least 1"),
    (dict(growth_interval=2.5), TypeError, "growth_interval must be an int"),
])
def test_seed_bad_input(kwargs, error, words):
    with pytest.raises(error, match=words):
        fpemu.dynamic_loss_scale([False], **kwargs)


@pytest.mark.parametrize("overflows,words", [([0, 1], r"overflows\[0\] must be a bool"),
                                             ("TF", "overflows must be a sequence of bools"),
                                             (3, "overflows must be a sequence")])
def test_overflows_must_be_bools(overflows, words):
    with pytest.raises(TypeError, match=words):
        fpemu.dynamic_loss_scale(overflows)
    with pytest.raises(TypeError, match=words):
        fpemu.simulate_scaler(overflows, "torch")


# --- profiles --------------------------------------------------------------

def test_profile_parameters_are_checked():
    with pytest.raises(ValueError, match="unknown profile 'pytorch'; known profiles: torch, torch_sharded"):
        fpemu.simulate_scaler([False], "pytorch")
    with pytest.raises(TypeError, match="profile 'flax' has no parameter 'period'"):
        fpemu.simulate_scaler([False], "flax", period=3)
    with pytest.raises(TypeError, match="has no default for loss_scale"):
        fpemu.simulate_scaler([False], "jmp")
    with pytest.raises(ValueError, match="profile 'jmp': factor must be greater than 1"):
        fpemu.simulate_scaler([False], "jmp", loss_scale=1.0, factor=1)
    with pytest.raises(ValueError, match=r"profile 'torch': backoff_factor must be in \(0, 1\)"):
        fpemu.simulate_scaler([False], "torch", backoff_factor=1.5)
    with pytest.raises(ValueError, match="profile 'keras': initial_scale must be positive"):
        fpemu.simulate_scaler([False], "keras", initial_scale=-1.0)
    with pytest.raises(ValueError, match="profile 'megatron': growth_interval must be at least 1"):
        fpemu.simulate_scaler([False], "megatron", growth_interval=0)


def test_driven_profiles_are_exactly_those_with_an_adapter():
    """A profile may say it is driven only if an adapter row drives it, on versions it names."""
    from fpemu.adapters import adapters_of_kind
    driven = {a.profile for a in adapters_of_kind("scaler").values() if a.verified}
    assert {name for name, p in fpemu.PROFILES.items() if p.verified == "driven"} - {"static"} == driven
    assert all(a.profile in fpemu.PROFILES for a in adapters_of_kind("scaler").values())


def test_every_profile_records_its_source():
    for profile in fpemu.PROFILES.values():
        assert profile.verified in ("driven", "source-derived")
        assert profile.source and profile.implementation and profile.notes
        trace = fpemu.simulate_scaler([False, True, False], profile,
                                      **{k: 4.0 if k == "loss_scale" else 1 for k, v in profile.defaults.items()
                                         if v is fpemu.scalers.profiles.REQUIRED})
        assert trace.attempts == 3


GROWTH = [False] * 7 + [True] + [False] * 8


@pytest.mark.parametrize("profile,params,expected", [
    # Trajectories worked out from each implementation's source (see the profile's notes).
    ("torch", dict(init_scale=1.0, growth_interval=3), [1, 1, 1, 2, 2, 2, 4, 4, 2, 2, 2, 4, 4, 4, 8, 8]),
    ("flax", dict(scale=1.0, growth_interval=3), [1, 1, 1, 1, 2, 2, 2, 2, 1, 1, 1, 1, 2, 2, 2, 2]),
    ("deepspeed_0_17", dict(init_scale=1.0, scale_window=3, delayed_shift=1),
     [1, 1, 1, 2, 2, 2, 4, 4, 2, 2, 2, 4, 4, 4, 8, 8]),
    ("deepspeed", dict(init_scale=1.0, scale_window=3, delayed_shift=1),
     [1, 1, 1, 1, 2, 2, 2, 4, 2, 2, 2, 2, 4, 4, 4, 8]),
    ("deepspeed_fp16_optimizer", dict(init_scale=1.0, scale_window=3),
     [1, 1, 1, 1, 2, 2, 2, 4, 2, 2, 2, 2, 4, 4, 4, 8]),
    ("megatron", dict(initial_scale=1.0, growth_interval=3), [1, 1, 1, 2, 2, 2, 4, 4, 4, 4, 4, 8, 8, 8, 16, 16]),
    ("apex", dict(init_scale=1.0, scale_window=3), [1, 1, 1, 2, 2, 2, 4, 4, 2, 2, 2, 4, 4, 4, 8, 8]),
    ("fairseq", dict(init_scale=1.0, scale_window=3), [1, 1, 1, 2, 2, 2, 4, 4, 2, 2, 2, 4, 4, 4, 8, 8]),
    ("tf_keras", dict(initial_scale=1.0, dynamic_growth_steps=3), [1, 1, 1, 2, 2, 2, 4, 4, 2, 2, 2, 4, 4, 4, 8, 8]),
])
def test_growth_timing(profile, params, expected):
    assert fpemu.simulate_scaler(GROWTH, profile, **params).scales == [float(v) for v in expected]


def test_floors_and_caps_differ_between_profiles():
    down = [True] * 3
    assert fpemu.simulate_scaler(down, "torch", init_scale=2.0**-148).final_scale == 0.0  # through subnormals to 0
    assert fpemu.simulate_scaler(down, "flax", scale=2.0**-125).final_scale == 2.0**-126  # float32 tiny
    assert fpemu.simulate_scaler(down, "tf_keras", initial_scale=2.0).final_scale == 1.0
    assert fpemu.simulate_scaler(down, "keras", initial_scale=2.0**-125).final_scale == 0.0  # XLA flushes
    up = [False] * 3
    big = 3e38
    assert fpemu.simulate_scaler(up, "torch", init_scale=big, growth_interval=1).final_scale == float(np.float32(big))
    assert fpemu.simulate_scaler(up, "flax", scale=big, growth_interval=0 + 1).final_scale == float(np.finfo(np.float32).max)
    assert fpemu.simulate_scaler(up, "keras", initial_scale=big, dynamic_growth_steps=1).final_scale == math.inf
    assert fpemu.simulate_scaler(up * 10, "apex", init_scale=2.0**23, scale_window=1).final_scale == 2.0**24


def test_deepspeed_raises_at_min_scale_and_hysteresis():
    trace = fpemu.simulate_scaler([True] * 6, "deepspeed", init_scale=4.0, delayed_shift=2)
    # hysteresis absorbs the first overflow; then 4 -> 2 -> 1; an overflow at 1 raises.
    assert trace.scales == [4.0, 4.0, 2.0, 1.0] and trace.stopped_at == 3
    assert trace.events[-1] == (3, "raised: overflow at the minimum scale")
    no_raise = fpemu.simulate_scaler([True] * 6, "deepspeed", init_scale=3.0, delayed_shift=1,
                                     raise_error_at_min_scale=False)
    assert no_raise.final_scale == 1.0 and no_raise.stopped_at is None


def test_megatron_hysteresis_refills_only_at_growth():
    seq = [False, False, False, True, False, True, True, True, False, False, False, True]
    trace = fpemu.simulate_scaler(seq, "megatron", initial_scale=1.0, growth_interval=3, hysteresis=2)
    assert trace.hysteresis == [2, 2, 2, 1, 1, 0, -1, -2, -2, -2, 2, 1]
    assert trace.scales == [1, 1, 1, 2, 2, 2, 1, 1, 1, 1, 1, 2]


def test_fairseq_raises_at_min_scale_even_when_tolerance_holds_the_backoff():
    """fairseq checks the floor after every overflow: at step 4 one overflow in five steps is under
    tolerance 0.5, so the scale does not back off, but it is already at min_loss_scale: it raises."""
    trace = fpemu.simulate_scaler([False] * 4 + [True, False], "fairseq", init_scale=1.0, scale_window=100,
                                  tolerance=0.5, min_loss_scale=1.0)
    assert trace.stopped_at == 4 and trace.scales == [1.0] * 5 and trace.final_scale == 1.0
    assert trace.events == [(4, "raised: overflow with the scale at or below the minimum")]


def test_fairseq_profile_models_the_release():
    """fairseq v0.12.2's file (the same on main at 3d262bb) divides by the iterations since the last
    rescale as they are: the 1000 that the unmerged 0d77035 puts in for a 0 is not the release's.
    From init() the count is never 0; a state that has it divides by zero, as the release does.
    min_loss_scale=None is refused: every overflow compares loss_scale <= None (TypeError)."""
    source = fpemu.PROFILES["fairseq"].source
    assert "v0.12.2" in source and "0d77035" not in source
    rules = fpemu.PROFILES["fairseq"].rules(tolerance=0.25)
    with pytest.raises(ZeroDivisionError):
        rules.update(ScalerState(scale=4.0, iteration=7, last_rescale=7), True)
    with pytest.raises(TypeError, match="profile 'fairseq': min_loss_scale must be a number"):
        fpemu.simulate_scaler([True], "fairseq", min_loss_scale=None)


def test_apex_stops_when_the_scale_halves_to_zero():
    """Python floats halve through the subnormal doubles: 2**-1074 / 2 == 0.0, and the next
    unscale's 1./scale raises ZeroDivisionError."""
    trace = fpemu.simulate_scaler([True] * 1100, "apex", init_scale=1.0)
    assert trace.stopped_at == 1075 and trace.scales[1074] == 2.0**-1074 and trace.scales[1075] == 0.0
    assert trace.events[-1] == (1075, "raised: ZeroDivisionError, the scale reached 0 (1 / scale)")
    assert trace.attempts == 1076 and trace.completed_updates == 0
    assert fpemu.simulate_scaler([True] * 1100, "apex", init_scale=1.0, min_loss_scale=2.0**-3).stopped_at is None


def test_apex_takes_an_infinite_max_loss_scale():
    """apex.amp's LossScaler grows with min(max_loss_scale, scale * 2.) and checks nothing, so
    max_loss_scale=inf is no cap: Python floats double to 2**1023, then to inf, and halving inf
    stays inf. None is refused, as apex's min(None, init_scale) raises TypeError."""
    up = fpemu.simulate_scaler([False] * 12, "apex", init_scale=2.0**22, scale_window=1, max_loss_scale=math.inf)
    assert up.scales == [2.0**k for k in range(22, 34)] and up.final_scale == 2.0**34
    to_inf = fpemu.simulate_scaler([False] * 3 + [True], "apex", init_scale=2.0**1022, scale_window=1,
                                   max_loss_scale=math.inf)
    assert to_inf.scales == [2.0**1022, 2.0**1023, math.inf, math.inf] and to_inf.final_scale == math.inf
    assert to_inf.stopped_at is None
    with pytest.raises(TypeError, match="profile 'apex': max_loss_scale must be a number or inf, got None"):
        fpemu.simulate_scaler([False], "apex", max_loss_scale=None)
    for bad in (math.nan, -math.inf):
        with pytest.raises(ValueError, match="profile 'apex': max_loss_scale must be at least 0 or inf"):
            fpemu.simulate_scaler([False], "apex", max_loss_scale=bad)


@pytest.mark.parametrize("field,value,error,words", [
    ("growth_timing", "n", ValueError, "ScalerRules.growth_timing must be one of 'N', 'N\\+1'"),
    ("backoff", "halve", ValueError, "ScalerRules.backoff must be one of"),
    ("at_zero_scale", "stop", ValueError, "ScalerRules.at_zero_scale must be one of"),
    ("tolerance", "0.25", TypeError, "ScalerRules.tolerance must be a number, got '0.25'"),
    ("growth_interval", 2.0, TypeError, "ScalerRules.growth_interval must be an int"),
    ("consecutive_hysteresis", "no", TypeError, "ScalerRules.consecutive_hysteresis must be True or False"),
])
def test_rules_refuse_unknown_words_and_wrong_types(field, value, error, words):
    with pytest.raises(error, match=words):
        ScalerRules(1.0, **{field: value})


@pytest.mark.parametrize("profile,params,error,words", [
    ("fairseq", dict(tolerance="0.25"), TypeError, "profile 'fairseq': tolerance must be a number, got '0.25'"),
    ("deepspeed", dict(raise_error_at_min_scale="no"), TypeError,
     "raise_error_at_min_scale must be true or false, got 'no'"),
    ("optax", dict(max_consecutive_errors=-1), ValueError, "max_consecutive_errors must be at least 0"),
    ("megatron", dict(initial_scale=1.0, min_scale=2.0), ValueError, r"min_scale must be in \(0, initial_scale\]"),
    ("jmp", dict(loss_scale=1.0, min_loss_scale="1"), TypeError, "min_loss_scale must be a number"),
])
def test_profile_parameters_are_typed(profile, params, error, words):
    with pytest.raises(error, match=words):
        fpemu.simulate_scaler([False], profile, **params)


def test_fairseq_tolerance_and_stop():
    seq = [False] * 8 + [True] * 3
    trace = fpemu.simulate_scaler(seq, "fairseq", init_scale=1.0, scale_window=100, tolerance=0.25)
    assert trace.final_scale == 0.5 and trace.scales[-1] == 1.0  # ratios 1/9, 2/10, 3/11: backs off once
    stop = fpemu.simulate_scaler([True] * 5, "fairseq", init_scale=4e-4)
    assert stop.stopped_at == 1 and stop.final_scale == 2e-4  # 4e-4 -> 2e-4 -> 1e-4 raises, restoring 2e-4


def test_paddle_backs_off_after_consecutive_bad_steps():
    trace = fpemu.simulate_scaler([True, False, True, True], "paddle", init_loss_scaling=8.0,
                                  decr_every_n_nan_or_inf=2)
    assert trace.scales == [8.0, 8.0, 8.0, 8.0] and trace.final_scale == 4.0


def test_optax_lets_late_consecutive_errors_through():
    seq = [True] * 5 + [False] + [True] * 3
    trace = fpemu.simulate_scaler(seq, "optax", max_consecutive_errors=2)
    assert trace.applied.tolist() == [False, False, True, True, True, True, False, False, True]
    assert trace.growth_counter.tolist() == [1, 2, 3, 4, 5, 0, 1, 2, 3]


def test_accounting_100_attempts_10_skipped():
    seq = [i % 10 == 9 for i in range(100)]
    trace = fpemu.simulate_scaler(seq, "torch", growth_interval=1000)
    assert (trace.attempts, trace.completed_updates, trace.skipped_updates) == (100, 90, 10)


def test_torch_arithmetic_is_fp64_then_fp32():
    trace = fpemu.simulate_scaler([False] * 30, "torch", init_scale=1.0, growth_factor=1.1, growth_interval=1)
    f32 = run_rules(ScalerRules(1.0, 1.1, growth_interval=1, arithmetic="fp32"), [False] * 30)
    assert bits32(trace.scales) != bits32(f32.scales)


def test_unscale_reciprocal_vs_divide():
    grads = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 3 * 2**10
    torch_way = fpemu.unscale(grads, 3 * 2**10, "torch")
    flax_way = fpemu.unscale(grads, 3 * 2**10, "flax")
    differ = np.count_nonzero(torch_way.view(np.uint32) != flax_way.view(np.uint32))
    assert 200 < differ < 450


def test_check_location_decides_skips_below_scale_one():
    scaled = np.array([1e38], np.float32)  # finite scaled gradient, unscales to inf at scale 1e-3
    assert not fpemu.step_overflowed(scaled, 1e-3, "torch")
    assert not fpemu.step_overflowed(scaled, 1e-3, "keras")
    assert fpemu.step_overflowed(scaled, 1e-3, "flax")


# --- the real implementations, bit for bit -------------------------------------

def _skip_unless(name):
    reason = unavailable_reason(name)
    if reason:
        pytest.skip(f"{name}: {reason}")


overflow_runs = st.lists(st.booleans(), min_size=1, max_size=24)
factors = st.one_of(st.just(2.0), st.sampled_from([3.0, 1.1, 1.5, 10.0]), st.floats(1.0001, 8.0))
backoffs = st.one_of(st.just(0.5), st.sampled_from([0.3, 0.1, 0.9]), st.floats(0.01, 0.99))
init_scales = st.one_of(st.sampled_from([2.0**16, 1.0, 3e38, 1e38, 1e-3, 2.0**-120, 0.7, 2.0**-149, 2.0**-127]),
                        st.floats(1e-30, 3e38))
intervals = st.integers(1, 4)


@settings(max_examples=profile_examples(5), deadline=None)
@given(seq=overflow_runs, init=init_scales, growth=factors, backoff=backoffs, interval=intervals)
def test_torch_gradscaler_matches_profile(seq, init, growth, backoff, interval):
    _skip_unless("torch")
    params = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    assert_same_trace(record_scaler("torch", seq, **params), fpemu.simulate_scaler(seq, "torch", **params))


@settings(max_examples=profile_examples(8), deadline=None)
@given(seq=overflow_runs, init=init_scales, growth=factors, backoff=backoffs, interval=intervals)
def test_torch_sharded_matches_profile(seq, init, growth, backoff, interval):
    _skip_unless("torch_sharded")
    params = dict(init_scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    assert_same_trace(record_scaler("torch_sharded", seq, **params),
                      fpemu.simulate_scaler(seq, "torch_sharded", **params))


jmp_floors = st.sampled_from([None, 1.0, 0.3, 4.0, 2.0**-20, 0.0])


@pytest.mark.parametrize("name", ["jmp", "jmp_eager"])
@settings(max_examples=profile_examples(8), deadline=None)
@given(seq=overflow_runs, init=init_scales, factor=st.sampled_from([2, 3, 10]),
       period=st.one_of(intervals, intervals.map(float)), floor=jmp_floors)
def test_jmp_matches_profile(name, seq, init, factor, period, floor):
    _skip_unless(name)
    params = dict(loss_scale=init, factor=factor, period=period)
    if floor is not None:
        params["min_loss_scale"] = floor
    assert_same_trace(record_scaler(name, seq, **params), fpemu.simulate_scaler(seq, name, **params))


@pytest.mark.parametrize("name", ["jmp", "jmp_eager"])
@pytest.mark.parametrize("params,seq", [
    # jmp's own test_dynamic_loss_scale_explicit_min_loss_scale case (5., 2., 0.): 100 overflows from 10.
    (dict(loss_scale=10.0, period=5.0, factor=2.0, min_loss_scale=0.0), [True] * 100),
    (dict(loss_scale=10.0, period=5.0, factor=3), [False] * 12 + [True] + [False] * 11),
    (dict(loss_scale=1.0, period=float(2**24), factor=2), [False] * 3),
])
def test_jmp_takes_a_float_period(name, params, seq):
    """jmp (0.0.4) never checks period: a float makes its int32 counter a float32 one (counter ==
    period - 1 compares in float32), which counts exactly as the int period does while the
    counter stays an integer below 2**24."""
    model = fpemu.simulate_scaler(seq, name, **params)
    assert model.params["period"] == params["period"]
    _skip_unless(name)
    assert_same_trace(record_scaler(name, seq, **params), model)


@pytest.mark.parametrize("period,words", [
    (2.5, "period must be an int or a float with an integer value, got 2.5"),
    (float(2**24 + 2), r"period must be at most 2\*\*24 as a float"),
    (0.0, "period must be at least 1"),
    (math.nan, "period must be an int or a float with an integer value"),
])
def test_jmp_refuses_periods_its_float32_counter_cannot_count(period, words):
    with pytest.raises(ValueError, match=f"profile 'jmp': {words}"):
        fpemu.simulate_scaler([False], "jmp", loss_scale=1.0, period=period)


@pytest.mark.parametrize("name,params,expected", [
    ("jmp", dict(loss_scale=2.0**-149, period=1), [2.0**-149, 0.0, 0.0, 1.0]),
    ("jmp_eager", dict(loss_scale=2.0**-149, period=1, min_loss_scale=0.0), [2.0**-149, 0.0, 0.0, 0.0]),
    ("flax", dict(scale=2.0**-149, growth_interval=1, minimum_scale=None), [2.0**-149, 0.0, 0.0, 0.0]),
    ("keras", dict(initial_scale=2.0**-149, dynamic_growth_steps=1), [0.0, 0.0, 0.0, 0.0]),
])
def test_subnormal_initial_scale_is_kept_as_given_where_the_state_stores_it(name, params, expected):
    """jmp and flax keep the float32 they were given (XLA flushes only results: 2^-149 * 2 is 0);
    Keras assigns it to a variable through XLA, which flushes it at once."""
    seq = [False, False, True, False]
    assert bits32(fpemu.simulate_scaler(seq, name, **params).scales) == bits32(expected)
    _skip_unless(name)
    assert bits32(record_scaler(name, seq, **params).scales) == bits32(expected)


@pytest.mark.parametrize("name,expected", [
    ("jmp", [10, 5, 2.5, 1.25, 1, 1, 1, 1]),                    # jit drops min_loss_scale: floor 1.0
    ("jmp_eager", [10, 5, 2.5, 1.25, 0.625, 0.3125, np.float32(0.3), np.float32(0.3)]),
])
def test_jmp_min_loss_scale_under_jit_and_eager(name, expected):
    """The user's report: jmp under jax.jit ignores min_loss_scale=0.3 (the pytree drops it)."""
    params = dict(loss_scale=10.0, min_loss_scale=0.3, period=2)
    model = fpemu.simulate_scaler([True] * 8, name, **params)
    assert bits32(model.scales) == bits32(expected)
    _skip_unless(name)
    recorded = record_scaler(name, [True] * 8, **params)
    assert bits32(recorded.scales) == bits32(expected)
    # The trace keeps the parameters as the real object holds them: jit has dropped the floor.
    assert recorded.params["min_loss_scale"] == (1.0 if name == "jmp" else float(np.float32(0.3)))


def test_jmp_adapter_needs_no_flax(tmp_path):
    """record_jmp must run with jax and jmp installed but not flax."""
    _skip_unless("jmp")
    import subprocess
    import sys
    code = ("import sys; sys.modules['flax'] = None\n"
            "from fpemu.adapters import record_scaler\n"
            "print(record_scaler('jmp', [False, True], loss_scale=4.0, period=1).scales)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[4.0, 8.0]"


@settings(max_examples=profile_examples(8), deadline=None)
@given(seq=overflow_runs, init=init_scales, growth=factors, backoff=backoffs, interval=intervals,
       floor=st.sampled_from([None, "default", 0.5]))
def test_flax_matches_profile(seq, init, growth, backoff, interval, floor):
    _skip_unless("flax")
    params = dict(scale=init, growth_factor=growth, backoff_factor=backoff, growth_interval=interval)
    if floor != "default":
        params["minimum_scale"] = floor
    assert_same_trace(record_scaler("flax", seq, **params), fpemu.simulate_scaler(seq, "flax", **params))


@settings(max_examples=profile_examples(25), deadline=None)
@given(seq=overflow_runs, init=init_scales, steps=intervals)
def test_keras_matches_profile(seq, init, steps):
    _skip_unless("keras")
    params = dict(initial_scale=init, dynamic_growth_steps=steps)
    assert_same_trace(record_scaler("keras", seq, **params), fpemu.simulate_scaler(seq, "keras", **params))


@settings(max_examples=profile_examples(13), deadline=None)
@given(seq=overflow_runs, limit=st.integers(0, 3))
def test_optax_matches_profile(seq, limit):
    _skip_unless("optax")
    params = dict(max_consecutive_errors=limit)
    assert_same_trace(record_scaler("optax", seq, **params), fpemu.simulate_scaler(seq, "optax", **params))


def test_torch_unscale_matches_real_kernel():
    _skip_unless("torch")
    import torch
    rng = np.random.default_rng(1)
    grads = (rng.standard_normal(4096) * 3 * 2**10).astype(np.float32)
    for scale in (3 * 2**10, 65536.0, 0.3, 1e-30, 7.0):
        param = torch.nn.Parameter(torch.zeros(4096))
        param.grad = torch.from_numpy(grads.copy())
        scaler = torch.amp.GradScaler("cpu", init_scale=scale)
        optimizer = torch.optim.SGD([param], lr=1.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(optimizer)
        assert param.grad.numpy().view(np.uint32).tolist() == fpemu.unscale(grads, scale, "torch").view(np.uint32).tolist()


def test_flax_unscale_matches_real():
    _skip_unless("flax")
    import jax
    import jax.numpy as jnp
    from flax.training.dynamic_scale import DynamicScale
    grads = (np.random.default_rng(2).standard_normal(4096) * 3 * 2**10).astype(np.float32)
    scale = np.float32(3 * 2**10)
    unscaled_target = grads / scale

    def loss(p):
        return jnp.sum(p * jnp.asarray(unscaled_target))

    scaled = scale * unscaled_target  # the scaled gradient JAX computes: cotangent scale times c
    ds = DynamicScale(scale=jnp.float32(scale))
    _, _, _, jitted = jax.jit(lambda d, p: d.value_and_grad(loss)(p))(ds, jnp.zeros(4096))
    assert np.asarray(jitted).view(np.uint32).tolist() == fpemu.unscale(scaled, scale, "flax").view(np.uint32).tolist()
    # Called eagerly, the same code multiplies by a reciprocal from jax 0.10.1 on (XLA folds the
    # concrete scale; up to 0.10.0 it divides, as jitted): the profile models the jitted train step,
    # and the two differ on ~1/3 of values.
    _, _, _, eager = ds.value_and_grad(loss)(jnp.zeros(4096))
    eager_rule = "jmp" if Version(jax.__version__) >= Version("0.10.1") else "flax"  # reciprocal, division
    expected = fpemu.unscale(scaled, scale, eager_rule)
    assert np.asarray(eager).view(np.uint32).tolist() == expected.view(np.uint32).tolist()


@given(seq=st.lists(st.booleans(), max_size=40),
       name=st.sampled_from(["torch", "torch_sharded", "jmp", "flax", "keras", "tf_keras", "apex", "paddle"]),
       init=init_scales, interval=intervals, growth=factors)
def test_vectorized_path_equals_step_machine(seq, name, init, interval, growth):
    profile = fpemu.get_profile(name)
    params = {k: init for k in profile.defaults if k in ("init_scale", "loss_scale", "scale", "initial_scale",
                                                          "init_loss_scaling")}
    params.update({k: interval for k in profile.defaults if k in ("growth_interval", "period", "scale_window",
                                                                   "dynamic_growth_steps", "incr_every_n_steps")})
    params.update({k: growth for k in profile.defaults if k in ("growth_factor", "incr_ratio")})
    rules = profile.rules(**params)
    fast, slow = run_rules(rules, seq), run_rules(rules, seq, vectorize=False)
    assert np.array(fast.scales, np.float64).tobytes() == np.array(slow.scales, np.float64).tobytes()
    assert fast.applied.tolist() == slow.applied.tolist() and fast.skipped == slow.skipped
    assert fast.growth_counter.tolist() == slow.growth_counter.tolist()
    assert np.float64(fast.final_scale).tobytes() == np.float64(slow.final_scale).tobytes()


def test_vectorized_path_keeps_the_stop_at_an_overflow_with_an_infinite_scale():
    """DeepSpeed raises on an overflow once its scale has grown to inf: the fast path must not skip it."""
    rules = ScalerRules(2.0**126, 2.0, growth_interval=1, arithmetic="fp32", on_growth_overflow="inf",
                        overflow_at_inf_raises=True)
    flags = [False] * 4 + [True]
    fast, slow = run_rules(rules, flags), run_rules(rules, flags, vectorize=False)
    assert fast.stopped_at == slow.stopped_at == 4 and fast.events == slow.events


def test_a_profile_with_an_unknown_word_or_an_unkinded_parameter_is_refused():
    torch = fpemu.get_profile("torch")
    with pytest.raises(ValueError, match="unscale must be one of mul_recip_fp64"):
        dataclasses.replace(torch, unscale="mul_recip")
    with pytest.raises(ValueError, match="parameters colour have no kind"):
        dataclasses.replace(torch, defaults={**torch.defaults, "colour": 1})


def test_deepspeed_engine_config_takes_exact_powers_of_two_only():
    from fpemu.adapters.deepspeed_scaler import _engine_config
    assert _engine_config("deepspeed", {"init_scale": 2.0**16})["initial_scale_power"] == 16
    assert _engine_config("deepspeed", {"init_scale": 2.0**-3})["initial_scale_power"] == -3
    with pytest.raises(ValueError, match="init_scale must be a power of two, got 1048576.0000000002"):
        _engine_config("deepspeed", {"init_scale": 2.0**20 * (1 + 2.0**-52)})  # log2 gives 20.0
