"""Real scalers that run in isolated environments, bit for bit against fpemu's profiles.

PaddlePaddle 3.3.1 (environment ``paddle``, numpy 2.3.5) and tf-keras 2.21.0 (environment
``tf_keras``) are driven in a worker of their environment's Python through
:func:`call_in_environment`.  Each test skips, saying how to build it, where its
environment is not built here (`fpemu env build paddle`).
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hypothesis_budget import profile_examples
from trace_checks import assert_same_trace, bits32

import fpemu
from fpemu.environments import EnvironmentCallError, call_in_environment, environment_python

F32_MAX = float(np.finfo(np.float32).max)
TINY = 2.0**-126


# Paddle's and tf-keras's environments are built in CI stage 2, where these run; by default the profiles
# are pinned by their worked trajectories (test_scalers.py) and the flushed-unscale edges below.
isolated = pytest.mark.stage2("a stage-2 framework's environment; its profile's trajectories in test_scalers.py")


def call(environment, entry, *args):
    if environment_python(environment) is None:
        pytest.skip(f"environment {environment!r} is not built: run `fpemu env build {environment}`")
    return call_in_environment(environment, entry, *args)


sequences = st.lists(st.booleans(), min_size=1, max_size=40)
# float32's extremes: its largest values (growth overflows), subnormals and values near its smallest normal.
LARGEST_SUBNORMAL = float(np.nextafter(np.float32(TINY), np.float32(0)))
extreme_scales = st.sampled_from([F32_MAX, 3e38, 2.0**127, 1e38, TINY, 2.0**-125, LARGEST_SUBNORMAL, 2.0**-149, 1e-40,
                                  2.0**-140, 1.0, 0.7, 2.0**16, 1e-30])
init_scales = st.one_of(extreme_scales, st.floats(2.0**-149, F32_MAX, width=32), st.floats(1e-3, 1e6))
growths = st.one_of(st.just(2.0), st.sampled_from([3.0, 1.1, 1.5, 10.0, 1.0001, 7.77]), st.floats(1.0001, 16.0))
backoffs = st.one_of(st.just(0.5), st.sampled_from([0.3, 0.1, 0.9, 0.999]), st.floats(0.001, 0.999))


# --- the flushed unscale and the TF initial scale, without an environment -----------------------

def _f32(bits):
    return float(np.array([bits], np.uint32).view(np.float32)[0])


@pytest.mark.parametrize("grad,scale,expected", [
    (1.0, 4.0, 0.25),
    (2.0**-125 - 2.0**-149, 2.0, 0.0),   # 2^-126 - 2^-150 is tiny: flushed (IEEE rounds it up to 2^-126)
    (_f32(0x008CCCCD), 1.1, 2.0**-126),  # tiny before rounding, not after: x86 keeps 2^-126
    (-(2.0**-130), 2.0**-10, -0.0),      # a subnormal gradient reads as (signed) 0
    (2.0**100, 2.0**127, 0.0),           # 1/scale is subnormal: 0
    (1.0, 2.0**-140, np.inf),            # a subnormal scale reads as 0: 1/0
    (0.0, 2.0**-140, np.nan),
])
def test_flushed_unscale_edges(grad, scale, expected):
    for profile in ("paddle_cpu", "tf_keras"):
        out = fpemu.unscale(np.float32([grad]), scale, profile)
        assert np.isnan(out[0]) if np.isnan(expected) else bits32(out) == bits32([expected])
    assert bits32(fpemu.unscale(np.float32([2.0**-125 - 2.0**-149]), 2.0, "torch")) == bits32([2.0**-126])


@pytest.mark.parametrize("initial", [2.0**-149, LARGEST_SUBNORMAL])
def test_tf_keras_keeps_a_subnormal_initial_scale_until_its_arithmetic_flushes_it(initial):
    # The subnormal reads as 0 (denormals-are-zero), even where twice it would be normal.
    trace = fpemu.simulate_scaler([False, False, True], "tf_keras", initial_scale=initial, dynamic_growth_steps=1)
    assert trace.scales == [initial, 0.0, 0.0] and trace.final_scale == 1.0  # 0 * 2 = 0; max(0 / 2, 1)


# --- paddle.amp.GradScaler on the CPU --------------------------------------------------

PADDLE = "fpemu.adapters.paddle_scaler"


def record_paddle(seq, **params):
    return call("paddle", f"{PADDLE}:record_paddle", seq, params, "cpu")


@isolated
@settings(max_examples=profile_examples(1), deadline=None)
@given(seq=sequences, init=init_scales, growth=growths, backoff=backoffs, incr=st.integers(1, 4),
       decr=st.integers(1, 3))
def test_paddle_cpu_matches_profile(seq, init, growth, backoff, incr, decr):
    params = dict(init_loss_scaling=init, incr_ratio=growth, decr_ratio=backoff, incr_every_n_steps=incr,
                  decr_every_n_nan_or_inf=decr)
    assert_same_trace(record_paddle(seq, **params), fpemu.simulate_scaler(seq, "paddle_cpu", **params))


@isolated
def test_paddle_backs_off_after_decr_every_n_consecutive_overflows():
    seq = [True, False, True, True, True, True, False, False]
    params = dict(init_loss_scaling=8.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=2)
    real = record_paddle(seq, **params)
    assert real.scales == [8.0] * 4 + [4.0, 4.0, 2.0, 2.0]  # backs off after the 2nd and 4th consecutive
    assert_same_trace(real, fpemu.simulate_scaler(seq, "paddle_cpu", **params))


@isolated
def test_paddle_cpu_keeps_stepping_at_a_zero_scale():
    # 2^-148 -> 2^-149 -> 0: the scale is not flushed, and at 0 the CPU kernel checks the
    # scaled gradients (finite), so finite steps still run; the GPU profile skips them.
    seq = [True, True, False, False]
    real = record_paddle(seq, init_loss_scaling=2.0**-148, incr_every_n_steps=1)
    assert real.scales == [2.0**-148, 2.0**-149, 0.0, 0.0] and real.applied.tolist() == [False, False, True, True]
    assert_same_trace(real, fpemu.simulate_scaler(seq, "paddle_cpu", init_loss_scaling=2.0**-148,
                                                  incr_every_n_steps=1))
    gpu = fpemu.simulate_scaler(seq, "paddle", init_loss_scaling=2.0**-148, incr_every_n_steps=1)
    assert gpu.applied.tolist() == [False, False, False, False]


def _near_tiny(scale, rng):
    """Scaled gradients whose unscaled values land on both sides of float32's smallest normal."""
    with np.errstate(over="ignore"):  # 1 / 2^-140 is inf in float32
        reciprocal = np.float32(1 / np.float64(np.float32(scale)))
    centre = (np.float32(TINY) / reciprocal).view(np.uint32).astype(np.int64)
    values = (centre + rng.integers(-3000, 3000, 3000)).astype(np.uint32).view(np.float32)
    return values[np.isfinite(values)] * rng.choice(np.float32([-1, 1]), values[np.isfinite(values)].size)


UNSCALE_SCALES = [3 * 2**10, 65536.0, 0.3, 1e-30, 7.0, 1.1, 3e38, 2.0**127, 2.0**-140, TINY, 0.7, 5.0]


def _unscale_cases():
    rng = np.random.default_rng(3)
    normal = (rng.standard_normal(4096) * 3 * 2**10).astype(np.float32)
    subnormal = (rng.uniform(-1, 1, 512) * TINY).astype(np.float32)
    for scale in UNSCALE_SCALES:
        yield scale, np.concatenate([normal, subnormal, _near_tiny(scale, rng), np.float32([0.0, -0.0])])


@isolated
@pytest.mark.parametrize("scale,grads", list(_unscale_cases()), ids=[str(s) for s in UNSCALE_SCALES])
def test_paddle_cpu_unscale_matches_real_kernel(scale, grads):
    real, found_inf = call("paddle", f"{PADDLE}:unscale_paddle", grads, scale)
    assert not found_inf
    assert bits32(real) == bits32(fpemu.unscale(grads, scale, "paddle_cpu"))


@isolated
def test_paddle_cpu_checks_the_scaled_gradients():
    scaled = np.float32([1e38])  # finite, but 1e41 once unscaled at a scale of 1e-3
    real, found_inf = call("paddle", f"{PADDLE}:unscale_paddle", scaled, 1e-3)
    assert not found_inf and real.tolist() == [np.inf]
    assert not fpemu.step_overflowed(scaled, 1e-3, "paddle_cpu")
    assert fpemu.step_overflowed(scaled, 1e-3, "paddle")  # the GPU kernel checks the unscaled value
    # A non-finite scaled gradient makes the kernel write x * 0 (the step is then skipped).
    real, found_inf = call("paddle", f"{PADDLE}:unscale_paddle", np.float32([np.inf, 1.0, -2.0]), 3.0)
    assert found_inf and np.isnan(real[0]) and bits32(real[1:]) == bits32([0.0, -0.0])


# --- tf_keras.mixed_precision.LossScaleOptimizer ---------------------------------------------

TF_KERAS = "fpemu.adapters.tf_keras_scaler"


@isolated
@pytest.mark.parametrize("entry,examples", [("record_tf_keras", profile_examples(2)),
                                            ("record_tf_keras_legacy", profile_examples(5))])
def test_tf_keras_matches_profile(entry, examples):
    @settings(max_examples=examples, deadline=None)
    @given(seq=sequences, init=init_scales, steps=st.integers(1, 4))
    def check(seq, init, steps):
        params = dict(initial_scale=init, dynamic_growth_steps=steps)
        real = call("tf_keras", f"{TF_KERAS}:{entry}", seq, params, "cpu")
        assert_same_trace(real, fpemu.simulate_scaler(seq, "tf_keras", **params))

    check()


@isolated
def test_tf_keras_growth_and_floor():
    seq = [False] * 3 + [True] * 4
    real = call("tf_keras", f"{TF_KERAS}:record_tf_keras", seq, dict(initial_scale=3e38, dynamic_growth_steps=1),
                "cpu")
    big = float(np.float32(3e38))
    assert real.scales == [big] * 4 + [big / 2, big / 4, big / 8]  # growth to inf keeps the old scale
    low = call("tf_keras", f"{TF_KERAS}:record_tf_keras", [True] * 3, dict(initial_scale=2.0), "cpu")
    assert low.scales == [2.0, 1.0, 1.0] and low.final_scale == 1.0  # max(scale / 2, 1)


@isolated
@pytest.mark.parametrize("scale,grads", list(_unscale_cases()), ids=[str(s) for s in UNSCALE_SCALES])
def test_tf_keras_unscale_matches_real(scale, grads):
    real = call("tf_keras", f"{TF_KERAS}:unscale_tf_keras", grads, scale)
    assert bits32(real) == bits32(fpemu.unscale(grads, scale, "tf_keras"))


@isolated
def test_framework_objects_do_not_cross_back():
    for environment, entry, arg in (("paddle", "paddle:to_tensor", [1.0]), ("tf_keras", "tensorflow:constant", 1.0)):
        with pytest.raises(EnvironmentCallError, match=f"environment '{environment}', {entry}: its result cannot be "
                                                       "unpickled here .*No module named.*; return plain values"):
            call(environment, entry, arg)
