"""DeepSpeed (installed and the 0.17.0 tree) and megatron-core scalers, driven for real and
compared bit for bit with fpemu's profiles; DeepSpeed's engine checked for the facts measured on it."""

import importlib.util
import math
import os
import pathlib

import numpy as np
import pytest
from hypothesis import assume, example, given, settings, strategies as st

from hypothesis_budget import profile_examples
from trace_checks import assert_same_trace, bits64

import fpemu
from fpemu.adapters import deepspeed_scaler, megatron_scaler
from fpemu.traces import read_trace

SPECS = pathlib.Path(__file__).resolve().parent.parent / "specs"

pytestmark = pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")



# DeepSpeed and megatron-core are installed in CI stage 2 and their tests run there (where a developer installed
# them, the default suite would grow by a minute); by default their profiles are pinned by worked trajectories.
STAGE2 = pytest.mark.stage2("a stage-2 framework; its profile's trajectories in test_scalers.py")


def _stage2_framework(skip_unless_installed):
    return lambda test: STAGE2(skip_unless_installed(test))


NO_DEEPSPEED = importlib.util.find_spec("deepspeed") is None
INSTALLED = pytest.mark.skipif(NO_DEEPSPEED, reason="deepspeed not installed "
                               "(DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed==0.19.8)")
TREE = pytest.mark.skipif(deepspeed_scaler.tree_0_17_unavailable() is not None,
                          reason=f"DeepSpeed 0.17.0: {deepspeed_scaler.tree_0_17_unavailable()}")
installed, tree = _stage2_framework(INSTALLED), _stage2_framework(TREE)
megatron = _stage2_framework(pytest.mark.skipif(importlib.util.find_spec("megatron") is None
                             or importlib.util.find_spec("megatron.core") is None,
                             reason="megatron-core not installed (pip install megatron-core==0.16.1)"))




def compare(record, seq, params):
    real = record(seq, params, "cpu")
    assert_same_trace(real, fpemu.simulate_scaler(seq, real.profile, **params))


overflow_runs = st.lists(st.booleans(), min_size=1, max_size=24)
factors = st.one_of(st.just(2.0), st.sampled_from([3.0, 1.1, 1.5, 10.0]), st.floats(1.0001, 8.0))
backoffs = st.one_of(st.just(0.5), st.sampled_from([0.3, 0.1, 0.9]), st.floats(0.01, 0.99))
F32_EXTREMES = [3e38, 1e38, float(np.finfo(np.float32).max), 3.4028235e38, 3.40282356e38, 3.5e38,
                2.0**-120, 2.0**-149, 1e-45]
# DeepSpeed keeps the scale in a Python float: float64's extremes too (it grows past float32 to inf).
F64_EXTREMES = [1.7e308, 2.0**1023, 5e-324, 1e-300]
init_scales = st.one_of(st.sampled_from([2.0**16, 1.0, 1e-3, 0.7, *F32_EXTREMES]), st.floats(1e-30, 3e38))
ds_init_scales = st.one_of(init_scales, st.sampled_from(F64_EXTREMES), st.integers(1, 2**40))
floors = st.sampled_from([1, 0.25, 4, 2.0**-20, 1e-300, 5e-324, 3.0])
windows = st.integers(1, 4)

DS_OPTIONAL = {"min_scale": floors, "delayed_shift": st.integers(1, 3), "consecutive_hysteresis": st.booleans(),
               "raise_error_at_min_scale": st.booleans()}
ds_params = st.fixed_dictionaries({"init_scale": ds_init_scales, "scale_window": windows}, optional=DS_OPTIONAL)
ds_0_17_params = st.fixed_dictionaries({"init_scale": ds_init_scales, "scale_window": windows},
                                       optional={**DS_OPTIONAL, "scale_factor": st.one_of(factors, st.integers(2, 10))})


# --- DynamicLossScaler -------------------------------------------------------------

DS_EXAMPLES = [
    # grows to inf (Python float), then an overflow: DeepSpeed raises OverflowError in its log line
    ([False, False, True, False], dict(init_scale=1.7e308, scale_window=1, delayed_shift=1)),
    ([False, False, True, True], dict(init_scale=2.0**1023, scale_window=1, delayed_shift=3)),
    # an overflow at min_scale raises; without raise_error_at_min_scale it clamps
    ([True] * 5, dict(init_scale=8.0, scale_window=2, delayed_shift=2, min_scale=2.0)),
    ([True] * 5, dict(init_scale=8.0, scale_window=2, delayed_shift=1, min_scale=4, raise_error_at_min_scale=False)),
    # a scale below min_scale jumps up to it on the first backoff
    ([True, False, True], dict(init_scale=2.0**-120, scale_window=3, delayed_shift=1, min_scale=0.25,
                               raise_error_at_min_scale=False)),
    # the smallest double as the floor: an overflow there raises
    ([True] * 4, dict(init_scale=2.0**-1070, scale_window=1, delayed_shift=1, min_scale=5e-324)),
    # consecutive hysteresis refills on every good step
    ([True, False, True, True, False, True, True, False], dict(init_scale=64.0, scale_window=4, delayed_shift=2,
                                                               consecutive_hysteresis=True)),
    ([False] * 9 + [True] + [False] * 9, dict(init_scale=1.0, scale_window=3, delayed_shift=1)),
    ([True, False, False, False, False], dict(init_scale=3e38, scale_window=1, delayed_shift=1, min_scale=2.0**-20)),
]


def _with_examples(cases):
    def decorate(test):
        for seq, params in reversed(cases):
            test = example(seq=seq, params=params)(test)
        return test
    return decorate


@installed
@settings(max_examples=profile_examples(3), deadline=None)
@_with_examples(DS_EXAMPLES)
@given(seq=overflow_runs, params=ds_params)
def test_deepspeed_loss_scaler_matches_profile(seq, params):
    compare(deepspeed_scaler.record_deepspeed, seq, params)


@tree
@settings(max_examples=profile_examples(5), deadline=None)
@_with_examples(DS_EXAMPLES + [([False] * 8 + [True, False, False, False], dict(init_scale=1.0, scale_window=2,
                                                                              scale_factor=1.1))])
@given(seq=overflow_runs, params=ds_0_17_params)
def test_deepspeed_0_17_loss_scaler_matches_profile(seq, params):
    assume(not (isinstance(params["init_scale"], int) and isinstance(params.get("scale_factor"), int)))
    compare(deepspeed_scaler.record_deepspeed_0_17, seq, params)


@tree
@settings(max_examples=profile_examples(10), deadline=None)
@example(seq=[False] * 3 + [True] * 2, params={})
@example(seq=[True] * 3, params=dict(init_scale=2.0, min_scale=1))
@given(seq=overflow_runs, params=st.fixed_dictionaries(
    {}, optional={"init_scale": ds_init_scales, "scale_factor": factors, "scale_window": windows,
                  "min_scale": floors, "delayed_shift": st.integers(1, 3)}))
def test_deepspeed_legacy_class_defaults_match_profile(seq, params):
    compare(deepspeed_scaler.record_deepspeed_legacy, seq, params)


@tree
def test_deepspeed_0_17_int_arithmetic_is_refused():
    # Found while testing: 0.17.0 multiplies an int init_scale by an int scale_factor exactly (3 ** k *
    # (2 ** 40 + 1) stays an int) where the model rounds each product; 5 of 20 scales differed.
    seq, params = [False] * 20, dict(init_scale=2**40 + 1, scale_factor=3, scale_window=1)
    with pytest.raises(TypeError, match="scale_factor must be a float when init_scale is an int"):
        deepspeed_scaler.record_deepspeed_0_17(seq, params, "cpu")
    compare(deepspeed_scaler.record_deepspeed_0_17, seq, {**params, "scale_factor": 3.0})


def _source_build(env, commit, expected):
    where = os.environ.get(env)
    reason = (f"{env} names no DeepSpeed tree (git archive {commit} of deepspeedai/DeepSpeed, then DS_BUILD_OPS=0 "
              f"pip install --no-deps --no-build-isolation --target DIR . and hjson einops ninja into DIR)")
    return pytest.param(where, expected, id=env,
                        marks=pytest.mark.skipif(not where or not os.path.isdir(where), reason=reason))


@pytest.mark.parametrize("where,expected", [_source_build("FPEMU_DEEPSPEED_PRE_6976", "e440506be^", "deepspeed_0_17"),
                                            _source_build("FPEMU_DEEPSPEED_AT_6976", "e440506be", "deepspeed")])
def test_source_builds_of_0_17_1_get_the_profile_of_their_growth_rule(where, expected):
    """version.txt said 0.17.1 before PR #6976 (e440506be) changed the growth rule: a source build of
    its parent says 0.17.1 and grows as 0.17.0 does.  The profile is asked of the class, not the version."""
    assert deepspeed_scaler.deepspeed_version(where).startswith("0.17.1")
    assert deepspeed_scaler.scaler_profile(where) == expected
    seq, params = [False] * 5 + [True] + [False] * 6, dict(init_scale=4.0, scale_window=2, delayed_shift=1)
    real = deepspeed_scaler._record_loss_scaler(seq, params, "cpu", where, class_defaults=False)
    assert real.profile == expected
    assert_same_trace(real, fpemu.simulate_scaler(seq, expected, **params))


@installed
def test_deepspeed_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="profile 'deepspeed' has no parameter 'scale_factor'"):
        deepspeed_scaler.record_deepspeed([False], dict(scale_factor=3.0), "cpu")
    with pytest.raises(ValueError, match="profile 'deepspeed': scale_window must be at least 1"):
        deepspeed_scaler.record_deepspeed([False], dict(scale_window=0), "cpu")
    with pytest.raises(ValueError, match="min_scale must be positive"):
        deepspeed_scaler.record_deepspeed([False], dict(min_scale=0), "cpu")
    with pytest.raises(ValueError, match="device: the DeepSpeed adapters run DeepSpeed's CPU accelerator only"):
        deepspeed_scaler.record_deepspeed([False], {}, "cuda")
    with pytest.raises(ValueError, match=r"overflow_steps must be step indices in \[0, 3\), got \[3\]"):
        deepspeed_scaler.run_engine(3, [3])
    with pytest.raises(ValueError, match="zero_stage must be 0, 1 or 2, got 3"):
        deepspeed_scaler.run_engine(3, [], 3)


# --- FP16_Optimizer ------------------------------------------------------------------

fp16_params = st.fixed_dictionaries({"init_scale": ds_init_scales, "scale_window": windows},
                                    optional={"min_loss_scale": floors})
FP16_EXAMPLES = [
    ([False] * 7 + [True] + [False] * 8, dict(init_scale=1.0, scale_window=3)),
    ([False, False, True, False, False], dict(init_scale=1.7e308, scale_window=1)),  # inf: no raise here
    ([True] * 4, dict(init_scale=1.0, scale_window=2, min_loss_scale=0.25)),
    ([True, True], dict(init_scale=2.0**-20, scale_window=2, min_loss_scale=4)),
    ([True, True, False], dict(init_scale=1e-323, scale_window=1, min_loss_scale=5e-324)),
]


def test_deepspeed_profiles_refuse_a_zero_floor():
    # Found by hypothesis: FP16_Optimizer with min_loss_scale=0 halves 5e-324 to 0.0, then its next
    # finite step raises ZeroDivisionError in the unscale (ZeRO's unscale divides the same way).
    with pytest.raises(ValueError, match="min_loss_scale must be positive"):
        fpemu.simulate_scaler([True, True, False], "deepspeed_fp16_optimizer", init_scale=5e-324, min_loss_scale=0)
    for profile in ("deepspeed", "deepspeed_0_17", "deepspeed_legacy"):
        with pytest.raises(ValueError, match="min_scale must be positive"):
            fpemu.simulate_scaler([True], profile, min_scale=0)


@installed
@settings(max_examples=profile_examples(7), deadline=None)
@_with_examples(FP16_EXAMPLES)
@given(seq=overflow_runs, params=fp16_params)
def test_deepspeed_fp16_optimizer_matches_profile(seq, params):
    compare(deepspeed_scaler.record_deepspeed_fp16_optimizer, seq, params)


@tree
@settings(max_examples=profile_examples(10), deadline=None)
@_with_examples(FP16_EXAMPLES)
@given(seq=overflow_runs, params=fp16_params)
def test_deepspeed_0_17_fp16_optimizer_matches_profile(seq, params):
    compare(deepspeed_scaler.record_deepspeed_fp16_optimizer_0_17, seq, params)


# --- megatron-core -------------------------------------------------------------------

MEGATRON_EXAMPLES = [
    ([False] * 3, dict(initial_scale=3e38, growth_interval=1, growth_factor=3.0)),  # float32 growth to inf
    ([True] * 6, dict(initial_scale=3.5e38, min_scale=1.0, hysteresis=1)),  # rounds to inf; inf * 0.5 = inf
    ([True] * 30, dict(initial_scale=2.0**-100, min_scale=2.0**-149, hysteresis=1)),  # floor in the subnormals
    ([True] * 8, dict(initial_scale=3.0, min_scale=0.25, backoff_factor=0.3, hysteresis=2)),
    ([False, False, False, True, False, True, True, True, False, False, False, True],
     dict(initial_scale=1.0, growth_interval=3, hysteresis=2)),
    ([False] * 6, dict(initial_scale=0.7, growth_interval=1, growth_factor=1.1, min_scale=2.0**-20)),
]


@megatron
@settings(max_examples=profile_examples(3), deadline=None)
@_with_examples(MEGATRON_EXAMPLES)
@given(seq=overflow_runs, params=st.fixed_dictionaries(
    {"initial_scale": init_scales, "growth_interval": windows},
    optional={"min_scale": st.sampled_from([1.0, 0.25, 4.0, 2.0**-20, 2.0**-149, 1e-45]), "growth_factor": factors,
              "backoff_factor": backoffs, "hysteresis": st.integers(1, 3)}))
def test_megatron_dynamic_matches_profile(seq, params):
    assume(params.get("min_scale", 1.0) <= params["initial_scale"])
    compare(megatron_scaler.record_megatron, seq, params)


@megatron
@settings(max_examples=profile_examples(13), deadline=None)
@example(seq=[True, True, False, True], initial=3.5e38)
@example(seq=[False, True], initial=1e-46)  # float32 rounds it to 0
@example(seq=[True], initial=3.40282356e38)  # rounds down to float32 max
@given(seq=overflow_runs, initial=init_scales)
def test_megatron_constant_matches_profile(seq, initial):
    compare(megatron_scaler.record_megatron_constant, seq, dict(initial_scale=initial))


@megatron
def test_megatron_bad_input_names_the_argument():
    with pytest.raises(ValueError, match=r"min_scale must be in \(0, initial_scale\]"):
        megatron_scaler.record_megatron([False], dict(initial_scale=0.5), "cpu")
    with pytest.raises(ValueError, match="profile 'megatron': growth_interval must be at least 1"):
        megatron_scaler.record_megatron([False], dict(growth_interval=0), "cpu")
    with pytest.raises(ValueError, match="device must be one of 'cpu', 'cuda', got 'tpu'"):
        megatron_scaler.record_megatron_constant([False], dict(initial_scale=2.0), "tpu")


# --- the DeepSpeed engine --------------------------------------------------------------

# Measured: (ZeRO-0 multiplies the loss by the scale, the default gradient_clipping).
ENGINE_FACTS = {"0.19.8": (False, 1.0), "0.17.0": (True, 0.0)}
ENGINE_FLAGS = [False] * 4 + [True, True] + [False] * 4  # hysteresis 1: two backoffs, then growth again


def _versions():
    return [pytest.param(None, marks=(STAGE2, INSTALLED), id="installed"),
            pytest.param(deepspeed_scaler.tree_0_17(), marks=(STAGE2, TREE), id="0.17.0")]


def _facts(run):
    if run.version not in ENGINE_FACTS:
        pytest.skip(f"engine facts were measured on DeepSpeed {', '.join(ENGINE_FACTS)}, not {run.version}")
    return ENGINE_FACTS[run.version]


@pytest.mark.parametrize("where", _versions())
@pytest.mark.parametrize("stage", [0, 1, 2])
def test_engine_unscales_with_the_scale_after_its_update(where, stage):
    steps = len(ENGINE_FLAGS)
    run = deepspeed_scaler.run_engine(steps, [i for i, f in enumerate(ENGINE_FLAGS) if f], stage, tree=where)
    zero0_scales_the_loss, _ = _facts(run)
    loss_scaled = zero0_scales_the_loss or stage > 0
    # ZeRO 1/2 use DynamicLossScaler; ZeRO-0 with a torch optimizer FP16_UnfusedOptimizer (FP16_Optimizer's rule).
    profile = "deepspeed_fp16_optimizer" if stage == 0 else deepspeed_scaler.scaler_profile(where)
    assert run.optimizer == ("FP16_UnfusedOptimizer" if stage == 0 else "DeepSpeedZeroOptimizer")
    params = dict(init_scale=16.0, scale_window=2)
    if stage:
        params["delayed_shift"] = 1
    model = fpemu.simulate_scaler(ENGINE_FLAGS, profile, **params)
    assert bits64(run.scales) == bits64(model.scales) and run.skipped == ENGINE_FLAGS
    after = model.scales[1:] + [model.final_scale]
    for step, (skipped, used, unscaled_with) in enumerate(zip(run.skipped, run.scales, after)):
        if skipped:
            assert not run.updates[step].any()
            continue
        # The gradients carry the loss's multiplier and are divided by the scale after the update.
        ratio = (used if loss_scaled else 1.0) / unscaled_with
        assert bits64(run.updates[step]) == bits64(run.correct * ratio), (step, run.ratios)
    grew = [i for i, (s, a) in enumerate(zip(model.scales, after)) if a > s]
    # A growth step moves the weights half as far as it should (or, with the loss unscaled, 1/scale as far).
    assert grew and all(run.ratios[i] == (0.5 if loss_scaled else 1 / after[i]) for i in grew)


@pytest.mark.parametrize("where", _versions())
@pytest.mark.parametrize("stage", [1, 2])
def test_engine_default_gradient_clipping(where, stage):
    explicit = deepspeed_scaler.run_engine(2, [], stage, loss_scale_window=100, tree=where)
    default = deepspeed_scaler.run_engine(2, [], stage, loss_scale_window=100, gradient_clipping=None, tree=where)
    _, clip = _facts(default)
    assert explicit.ratios == [1.0, 1.0]
    lr = 2.0**-4
    norms = [float(np.linalg.norm(update)) / lr for update in default.updates]
    if clip:
        # |x| = 1.152 is clipped to 1.0 (to fp16 weight rounding: the clipped values are not on a power-of-two grid)
        assert all(math.isclose(norm, clip, rel_tol=2.0**-9) for norm in norms), norms
    else:
        assert default.ratios == [1.0, 1.0]


@installed
def test_engine_spec_reports_the_update_sizes_from_a_spec(tmp_path):
    """specs/engine_deepspeed.toml: the engine's scale follows the deepspeed profile at ZeRO 0, 1 and 2
    while its updates do not (measured on 0.19.8): every ZeRO-0 update is 1/16 of the right one,
    and ZeRO-1/2's first growth step (step 2) is half of it."""
    from fpemu.harness import diff, write_golden
    if deepspeed_scaler.deepspeed_version() != "0.19.8":
        pytest.skip(f"the engine spec's divergences were measured on DeepSpeed 0.19.8, not "
                    f"{deepspeed_scaler.deepspeed_version()}")
    spec = SPECS / "engine_deepspeed.toml"
    write_golden([spec], tmp_path / "golden")
    verdicts = {v.implementation: v for v in diff([spec], tmp_path / "golden", save_dir=tmp_path / "observed")}
    assert {key: (v.status, v.divergence.step, v.divergence.field) for key, v in verdicts.items()} == {
        "deepspeed_zero0@cpu": ("known divergence", 0, "update_ratio"),
        "deepspeed_zero1@cpu": ("known divergence", 2, "update_ratio"),
        "deepspeed_zero2@cpu": ("known divergence", 2, "update_ratio")}
    golden = read_trace(tmp_path / "golden" / "engine_deepspeed.json")
    for key in verdicts:
        observed = read_trace(tmp_path / "observed" / f"engine_deepspeed.{key.replace('@', '-')}.json")
        assert observed.column("scale") == golden.column("scale") and observed.column("applied") == golden.column("applied")
    zero0 = read_trace(tmp_path / "observed" / "engine_deepspeed.deepspeed_zero0-cpu.json").column("update_ratio")
    # 1 / (the scale after the step's update): the loss is not scaled, the gradients are unscaled with
    # 16, 16, then 32 on the growth step, as ZeRO-1/2 unscale with it too.
    assert zero0[:3] == [1 / 16, 1 / 16, 1 / 32]


@installed
def test_a_hung_worker_call_is_a_timeout_and_the_next_call_gets_a_fresh_worker():
    worker = deepspeed_scaler._worker(None)
    # 20,000 engine steps take tens of seconds: half a second is sure to run out.
    with pytest.raises(TimeoutError, match="no answer to engine within 0.5 s"):
        worker.call("engine", timeout=0.5, steps=20_000, overflow_steps=[], zero_stage=1, fp16={}, lr=1.0,
                    gradient_clipping=0.0)
    assert deepspeed_scaler._worker(None) is not worker and deepspeed_scaler.deepspeed_version() == worker.version


# --- unscale of 16-bit gradients ---------------------------------------------------

UNSCALE_SCALES = [3 * 2**10, 1e-3, 0.7, 2.0**-20, 65536.0, 1.1, 3e38]


def _torch_unscaled_in_place(bits, dtype, scale):
    """Every 16-bit pattern as a parameter's gradient, unscaled in place by the real scaler:
    ShardedGradScaler for float16 (torch.amp.GradScaler refuses float16 gradients), GradScaler for bfloat16."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from fpemu.adapters.torch_amp import _ensure_process_group
    _ensure_process_group(dist)  # ShardedGradScaler all-reduces found_inf
    param = torch.nn.Parameter(torch.zeros(bits.size, dtype=getattr(torch, dtype)))
    param.grad = torch.from_numpy(bits.view(np.int16).copy()).view(param.dtype)
    scaler = (ShardedGradScaler("cpu", init_scale=scale) if dtype == "float16"
              else torch.amp.GradScaler("cpu", init_scale=scale))
    scaler.scale(torch.ones(()))  # starts the scale tensor
    scaler.unscale_(torch.optim.SGD([param], lr=1.0))
    assert param.grad.dtype == param.dtype
    return param.grad.view(torch.int16).numpy().view(np.uint16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_unscale_keeps_16_bit_gradients_as_torch_writes_them(dtype):
    """torch's _amp_foreach_non_finite_check_and_unscale_ multiplies in float32 by float32(1/float64(s))
    and rounds the product to the gradient's dtype, in place; every pattern, bit for bit (NaN-aware).
    One rounding of the exact product would differ (342 float16 patterns at 3 * 2**10)."""
    import ml_dtypes
    pytest.importorskip("torch")
    dtype_np = np.dtype(np.float16) if dtype == "float16" else np.dtype(ml_dtypes.bfloat16)
    bits = np.arange(2**16, dtype=np.uint16)
    for scale in UNSCALE_SCALES:
        model = fpemu.unscale(bits.view(dtype_np), scale, "torch")
        assert model.dtype == dtype_np, (scale, model.dtype)
        real = _torch_unscaled_in_place(bits, dtype, scale)
        both_nan = np.isnan(model.astype(np.float32)) & np.isnan(real.view(dtype_np).astype(np.float32))
        assert np.count_nonzero((model.view(np.uint16) != real) & ~both_nan) == 0, scale
