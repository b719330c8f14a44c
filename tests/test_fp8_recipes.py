"""fp8 scaling recipes: the reference models (fpemu.scalers.fp8_recipes) pinned on TE's and torchao's
worked cases, and driven bit for bit against the real code: TE's unfused delayed-scaling update and its
current-scaling reference quantizer (TE's Python source, run on the CPU), and torchao.float8 (its cast
functions, and Float8Linear forward and backward)."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import fpemu
from fpemu.scalers import fp8_recipes as rec
from hypothesis_budget import profile_examples
from trace_checks import fp8_code_mismatches, same_floats

NAN, INF = float("nan"), float("inf")
F32_MAX = float(np.finfo(np.float32).max)


# --- the models on the cases read from the sources ----------------------------------

@pytest.mark.parametrize("path, expected", [("fused", [112, 112, 112, 112, 448]),
                                            ("unfused", [112, 112, 112, 448, 448])])
def test_delayed_zero_amax_steps_roll_only_unfused(path, expected):
    run = rec.DelayedScaling(amax_history_len=2, path=path).run([4.0, 0.0, 0.0, 1.0, 1.0])
    assert list(run.scale) == expected


def test_delayed_nan_is_ignored_fused_and_freezes_unfused():
    fused = rec.simulate_recipe([1.0, NAN, 2.0, 2.0, 2.0], "te_delayed", amax_history_len=3)
    unfused = rec.simulate_recipe([1.0, NAN, 2.0, 2.0, 2.0], "te_delayed_unfused", amax_history_len=3)
    assert list(fused.scale) == [448, 448, 224, 224, 224]
    assert list(unfused.scale) == [448, 448, 448, 448, 224]
    assert math.isnan(unfused.amax_used[1]) and fused.amax_used[1] == 1.0


def test_unfused_scale_is_reciprocal_times_max():
    fused = rec.DelayedScaling(amax_history_len=1).run([117.0]).scale[0]
    unfused = rec.DelayedScaling(amax_history_len=1, path="unfused").run([117.0]).scale[0]
    assert fused == float(np.float32(448) / np.float32(117))
    assert unfused == float((np.float32(1) / np.float32(117)) * np.float32(448)) != fused


def test_delayed_tiny_amax_with_margin():
    fused = rec.DelayedScaling(margin=1).run([1e-36]).scale[0]
    unfused = rec.DelayedScaling(margin=1, path="unfused").run([1e-36]).scale[0]
    assert fused == float(np.float32(224) / np.float32(1e-36))  # 2.24e38: the margin is in the numerator
    assert unfused == F32_MAX  # 448/1e-36 overflows before the division by 2


def test_delayed_keeps_scale_on_inf_and_most_recent():
    run = rec.DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent").run([2.0, INF, 8.0, 0.0, NAN])
    assert list(run.scale) == [224, 224, 56, 56, 56]
    e5m2 = rec.DelayedScaling(fp8_format="fp8_e5m2", amax_history_len=1).run([2.0, 4.0])
    assert list(e5m2.scale) == [28672, 14336]


def test_current_scaling_kernel_special_amaxes():
    kernel = rec.CurrentScaling()
    assert [float(kernel.scale_from_amax(a)) for a in (0.0, INF, NAN)] == [1.0, 1.0, 1.0]
    assert float(kernel.scale_from_amax(1e-40)) == F32_MAX  # 448/1e-40 overflows: value_for_inf
    assert float(rec.CurrentScaling(power_2_scales=True).scale_from_amax(1e-40)) == 2.0 ** 127  # FLT_MAX masked
    assert float(rec.CurrentScaling(power_2_scales=True).scale_from_amax(3.0)) == 128.0  # 149.33 -> 2^7
    assert float(rec.CurrentScaling(amax_epsilon=1.0).scale_from_amax(0.5)) == 448.0


def test_kernel_amax_ignores_nan_and_cast_saturates_e5m2():
    t = rec.CurrentScaling(fp8_format="fp8_e5m2").quantize(np.array([1.0, NAN, -2.0, INF], np.float32))
    assert float(t.amax) == INF and float(t.scale) == 1.0  # inf amax: scale 1
    assert t.values.tolist()[::2] == [1.0, -2.0] and t.values[3] == 57344.0  # satfinite: inf -> max
    t = rec.CurrentScaling().quantize(np.array([1.0, NAN, -2.0], np.float32))
    assert float(t.amax) == 2.0 and float(t.scale) == 224.0


def test_torchao_power_of_2_rounds_up_just_below_powers_of_two():
    s = np.float32(9.536738e-07)  # a few ulp below 2^-20
    assert float(rec.torchao_round_down_to_power_of_2(s)) == 2.0 ** -20
    assert float(rec.mask_to_power_of_2(s)) == 2.0 ** -21
    edges = rec.scales_near_powers_of_2()
    assert rec.power_of_2_departures(edges) > 0
    assert rec.power_of_2_departures(2.0 ** np.arange(-30, 30, dtype=np.float32)) == 0


def test_torchao_special_amaxes():
    t = rec.TorchaoScaling()
    scales = t.scale_from_amax(np.array([0.0, INF, NAN], np.float32))
    assert scales[0] == np.float32(448e12) and scales[1] == 0.0 and math.isnan(scales[2])


def test_torchao_clamp_flushes_tensors_below_1e_12():
    x = (np.random.default_rng(0).standard_normal(256) * 1e-30).astype(np.float32)
    assert not rec.TorchaoScaling().quantize(x).values.any()  # scale 448e12: every element rounds to 0
    assert float(np.abs(rec.CurrentScaling().quantize(x).values).max()) == 448.0


def test_recipe_table_and_bad_parameters():
    assert set(rec.RECIPES) == {"te_delayed", "te_delayed_unfused", "te_current", "te_current_reference",
                                "torchao_tensorwise", "torchao_rowwise"}
    with pytest.raises(ValueError, match="amax_compute_algo"):
        rec.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="path: set by the recipe"):
        rec.make_recipe("te_delayed", path="unfused")
    with pytest.raises(ValueError, match="unexpected keyword argument 'bogus'"):
        rec.make_recipe("torchao_tensorwise", bogus=1)
    with pytest.raises(ValueError, match="recipe: expected one of"):
        rec.make_recipe("te_nvfp4")


# --- inputs -----------------------------------------------------------------------

def _tensors():
    rng = np.random.default_rng(7)
    randn = rng.standard_normal((16, 32)).astype(np.float32)
    wide = (randn * np.exp2(rng.uniform(-40, 40, randn.shape))).astype(np.float32)
    bf16 = fpemu.quantize(randn, "bf16")
    specials = randn.copy()
    specials[0, :4] = [NAN, INF, -INF, 0.0]
    specials[3, :] = NAN  # a whole row of NaN (rowwise: that row's scale is NaN)
    tiny = (randn * 1e-30).astype(np.float32)
    return {"randn": randn, "wide": wide, "bf16": bf16, "zeros": np.zeros((4, 8), np.float32),
            "specials": specials, "tiny": tiny, "huge": (randn * 1e30).astype(np.float32)}


TENSORS = _tensors()
FORMATS = rec.FP8_FORMATS


def _amaxes():
    """Random float32 bit patterns of every magnitude, edges of power-of-two scales, and 0/inf/NaN."""
    rng = np.random.default_rng(3)
    random = rng.integers(0, 0x7F800000, 4000, dtype=np.uint32).view(np.float32)
    near = (np.float32(448.0) / rec.scales_near_powers_of_2()).astype(np.float32)
    return np.concatenate([random, near, np.array([0.0, INF, NAN, 1e-45, F32_MAX], np.float32)])


# --- TE's own Python code, run from its source ----------------------------------------

def _te():
    from fpemu.adapters import te_recipes
    reason = te_recipes.te_source_unavailable()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("torch")
    pytest.importorskip("pydantic")
    return te_recipes


AMAX_EVENTS = st.sampled_from([0.0, 0.0, INF, NAN, 1e-36, 1e-45, 3e38]) | st.floats(2.0 ** -10, 2.0 ** 10, width=32)


@settings(max_examples=profile_examples(10))
@given(amaxes=st.lists(AMAX_EVENTS, min_size=1, max_size=12), length=st.integers(1, 4),
       algo=st.sampled_from(rec.AMAX_ALGOS), margin=st.integers(-2, 3), fmt=st.sampled_from(FORMATS))
@example(amaxes=[4.0, 0.0, 0.0, 1.0, 1.0], length=2, algo="max", margin=0, fmt="fp8_e4m3fn")
@example(amaxes=[1.0, NAN, 2.0, 2.0, 2.0], length=3, algo="max", margin=0, fmt="fp8_e4m3fn")
@example(amaxes=[1e-36, 1e-45, 0.0, INF], length=1, algo="most_recent", margin=1, fmt="fp8_e5m2")
@example(amaxes=[117.0], length=1, algo="max", margin=0, fmt="fp8_e4m3fn")  # reciprocal * 448, not 448 / amax
def test_unfused_delayed_scaling_matches_te(amaxes, length, algo, margin, fmt):
    te = _te()
    real = te.run_delayed_unfused(amaxes, fmt, margin, length, algo)
    model = rec.DelayedScaling(fmt, margin, length, algo, path="unfused").run(amaxes)
    assert same_floats(real["scale"], model.scale), (real, model)
    assert same_floats(real["amax_used"], model.amax_used)


@pytest.mark.stage2("torch.compile of TE's jit_fuser takes ~20 s; the same recipe unfused in the test above")
def test_unfused_delayed_scaling_compiled_as_te_defaults():
    te = _te()
    amaxes = [1.0, NAN, 2.0, 0.0, INF, 1e-36, 1e-45, 117.0, 0.0, 7.0]
    for margin in (0, 1):
        real = te.run_delayed_unfused(amaxes, margin=margin, amax_history_len=3, compiled=True)
        model = rec.DelayedScaling(margin=margin, amax_history_len=3, path="unfused").run(amaxes)
        assert same_floats(real["scale"], model.scale)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
def test_te_reference_current_scale_matches(fmt, pow2):
    te = _te()
    model = rec.CurrentScaling(fp8_format=fmt, power_2_scales=pow2, implementation="reference")
    amaxes = _amaxes()[::8]  # the reference runs per amax: a sample
    real = [te.reference_current_scale(a, fmt, pow_2_scales=pow2) for a in amaxes]
    scales = [model.scale_from_amax(a) for a in amaxes]
    assert same_floats([r[0] for r in real], scales)
    assert same_floats([r[1] for r in real], rec._reciprocal(np.array(scales, np.float32)))
    assert same_floats([r[2] for r in real], model.run(amaxes).amax_used)


@pytest.mark.parametrize("name", sorted(TENSORS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_te_reference_quantizer_matches(name, fmt):
    te = _te()
    x = TENSORS[name]
    scale_inv, codes = te.reference_current_quantize(x, fmt)
    model = rec.CurrentScaling(fp8_format=fmt, implementation="reference").quantize(x)
    assert same_floats(scale_inv, model.scale_inv)
    assert fp8_code_mismatches(codes, model.codes, fmt) == 0


@pytest.mark.parametrize("dtype, input_max", [("bfloat16", float(fpemu.get_format("bf16").max_finite)),
                                              ("float16", 65504.0)])
def test_te_reference_quantizer_on_half_inputs(dtype, input_max):
    """A bf16/fp16 input: the amax of its values, and an inf scale becomes that dtype's max (bf16 values
    of 1e-38 make 448/amax overflow)."""
    te = _te()
    if dtype == "bfloat16":
        x = fpemu.quantize((TENSORS["randn"] * 1e-38).astype(np.float32), "bf16")
    else:
        x = fpemu.quantize(TENSORS["randn"], "fp16")
    scale_inv, codes = te.reference_current_quantize(x, "fp8_e4m3fn", dtype=dtype)
    model = rec.CurrentScaling(implementation="reference", input_max=input_max).quantize(x)
    assert same_floats(scale_inv, model.scale_inv) and fp8_code_mismatches(codes, model.codes, "fp8_e4m3fn") == 0


@pytest.mark.parametrize("fmt", FORMATS)
def test_torch_eager_cast_row_is_torchs_cast(fmt):
    """CASTS["torch_eager"]: torch 2.13's CPU cast saturates e4m3fn (inf too) and overflows e5m2 to inf."""
    torch = pytest.importorskip("torch")
    x = np.array([1e6, 61439.0, 61440.0, -1e9, INF, 500.0, 449.0, 465.0, NAN, 1e-9], np.float32)
    real = torch.from_numpy(x).to(getattr(torch, fmt.replace("fp8_", "float8_"))).view(torch.uint8).numpy()
    codes, _ = rec.cast_to_fp8(x, 1.0, fmt, "torch_eager")
    assert fp8_code_mismatches(real, codes, fmt) == 0


def test_te_reference_departs_from_kernel_on_inf_and_nan():
    te = _te()
    assert te.reference_current_scale(INF)[0] == 0.0 and rec.CurrentScaling().scale_from_amax(INF) == 1.0
    assert math.isnan(te.reference_current_scale(NAN)[0])
    assert te.reference_current_scale(NAN, pow_2_scales=True)[0] == 0.5  # frexp(NaN) has exponent 0


# --- torchao.float8 --------------------------------------------------------------------

@pytest.fixture(scope="module")
def torchao():
    pytest.importorskip("torchao.float8")
    from fpemu.adapters import torchao_float8
    return torchao_float8


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("pow2", [False, True])
def test_torchao_amax_to_scale_matches(torchao, fmt, pow2):
    amaxes = _amaxes()
    real = torchao.amax_to_scale(amaxes, fmt, pow2)
    model = rec.TorchaoScaling(fmt, power_of_2=pow2).scale_from_amax(amaxes)
    assert same_floats(real, model)


def test_torchao_power_of_2_rounding_matches_torch(torchao):
    import torch
    from torchao.float8.float8_utils import _round_scale_down_to_power_of_2
    rng = np.random.default_rng(11)
    random = rng.integers(1, 0x7F800000, 200_000, dtype=np.uint32).view(np.float32)
    scales = np.concatenate([rec.scales_near_powers_of_2(), random])
    real = _round_scale_down_to_power_of_2(torch.from_numpy(scales)).numpy()
    assert same_floats(real, rec.torchao_round_down_to_power_of_2(scales))


def test_torchao_power_of_2_rounding_matches_torch_next_to_every_power_of_2(torchao):
    """64 ulps either side of every float32 power of two, 2**-149 to 2**128 (FLT_MAX's neighbours: log2 128,
    exp2 inf), and the specials: numpy's float32 exp2 gave 2**127 + 1 ulp for every scale from 2**127 up."""
    import torch
    from torchao.float8.float8_utils import _round_scale_down_to_power_of_2
    k = np.arange(-149, 129)
    powers = np.ldexp(np.float32(1), np.minimum(k, 127)).view(np.uint32).astype(np.int64)
    powers = np.where(k == 128, 0x7F800000, powers)                                # (2**128: inf's bits)
    near = (powers[:, None] + np.arange(-64, 65)[None, :]).ravel()
    near = np.unique(near[(near > 0) & (near < 0x7F800000)]).astype(np.uint32).view(np.float32)
    scales = np.concatenate([near, np.array([0.0, -0.0, np.inf, -np.inf, -1.0, np.nan], np.float32)])
    real = _round_scale_down_to_power_of_2(torch.from_numpy(scales)).numpy()
    assert same_floats(real, rec.torchao_round_down_to_power_of_2(scales))
    assert rec.torchao_round_down_to_power_of_2(np.float32(2.0**127)).view(np.uint32) == 0x7F000000


FLOAT32_ELEMENTS = st.floats(width=32, allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-45, 448.0])


@settings(max_examples=profile_examples(10))
@given(values=st.lists(FLOAT32_ELEMENTS, min_size=1, max_size=24), fmt=st.sampled_from(FORMATS),
       rowwise=st.booleans(), pow2=st.booleans())
@example(values=[1e-30, -2e-30, 3e-31, 0.0], fmt="fp8_e4m3fn", rowwise=False, pow2=True)  # below the 1e-12 clamp
@example(values=[float.fromhex("0x1.fffffep-2"), 1.0, -0.5, 0.25], fmt="fp8_e5m2", rowwise=True, pow2=True)
def test_torchao_cast_matches_on_any_float32(torchao, values, fmt, rowwise, pow2):
    x = np.array(values + [0.0] * (-len(values) % 4), np.float32).reshape(-1, 4)
    granularity = "rowwise" if rowwise else "tensorwise"
    scale, codes = torchao.quantize(x, fmt, granularity, -1, pow2)
    model = rec.TorchaoScaling(fmt, granularity, -1, pow2).quantize(x)
    assert same_floats(scale.reshape(model.scale.shape), model.scale)
    assert fp8_code_mismatches(codes, model.codes, fmt) == 0


@settings(max_examples=profile_examples(10))
@given(values=st.lists(FLOAT32_ELEMENTS, min_size=1, max_size=24), fmt=st.sampled_from(FORMATS), pow2=st.booleans())
@example(values=[float("inf"), 1.0], fmt="fp8_e5m2", pow2=False)  # scale 0: inf * 0 is NaN
def test_te_reference_quantizer_matches_on_any_float32(values, fmt, pow2):
    te = _te()
    x = np.array(values, np.float32).reshape(1, -1)
    scale_inv, codes = te.reference_current_quantize(x, fmt, pow_2_scales=pow2)
    model = rec.CurrentScaling(fp8_format=fmt, power_2_scales=pow2, implementation="reference").quantize(x)
    assert same_floats(scale_inv, model.scale_inv)
    assert fp8_code_mismatches(codes, model.codes, fmt) == 0


@pytest.mark.parametrize("name", sorted(TENSORS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granularity, axis", [("tensorwise", -1), ("rowwise", -1), ("rowwise", 0)])
@pytest.mark.parametrize("pow2", [False, True])
def test_torchao_cast_matches(torchao, name, fmt, granularity, axis, pow2):
    x = TENSORS[name]
    scale, codes = torchao.quantize(x, fmt, granularity, axis, pow2)
    model = rec.TorchaoScaling(fmt, granularity, axis, pow2).quantize(x)
    assert same_floats(scale.reshape(model.scale.shape), model.scale)
    assert fp8_code_mismatches(codes, model.codes, fmt) == 0


def test_torchao_bf16_input_cast_matches(torchao):
    x = TENSORS["bf16"]
    scale, codes = torchao.quantize(x, "fp8_e4m3fn", dtype="bfloat16")
    model = rec.TorchaoScaling().quantize(x)
    assert same_floats(scale, model.scale) and fp8_code_mismatches(codes, model.codes, "fp8_e4m3fn") == 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_linear_training_casts_match(torchao, recipe):
    steps = [casts for _, casts in torchao.train_float8_mlp(recipe, steps=3)]
    assert all(len(casts) == 2 * len(torchao.LINEAR_CASTS) for casts in steps)
    for casts in steps:
        for cast in casts:
            axis = -1 if cast.axis is None else cast.axis
            model = rec.TorchaoScaling(cast.fp8_format, cast.granularity, axis, cast.power_of_2).quantize(cast.tensor)
            assert same_floats(cast.scale.reshape(model.scale.shape), model.scale)
            assert fp8_code_mismatches(cast.codes, model.codes, cast.fp8_format) == 0
    if recipe == "rowwise":
        assert all(cast.power_of_2 and cast.fp8_format == "fp8_e4m3fn" for cast in steps[0])


@pytest.mark.stage2("a transformers Llama under Float8Linear takes ~15 s; the casts on single Linears in the "
                    "tests above")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_llama_from_config_casts_match(torchao, recipe):
    """As a user would: a 2-layer Llama from a LlamaConfig (random weights), its Linears converted to
    Float8Linear, 3 AdamW steps; every cast torchao makes is fpemu's model's, bit for bit."""
    import torch
    transformers = pytest.importorskip("transformers")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                               module_filter_fn=lambda module, fqn: "lm_head" not in fqn)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = 0
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16))
        with torchao.watching_casts() as casts:
            loss = model(input_ids=ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
        optimizer.step()
        for cast in casts:
            axis = -1 if cast.axis is None else cast.axis
            fp8 = rec.TorchaoScaling(cast.fp8_format, cast.granularity, axis, cast.power_of_2).quantize(cast.tensor)
            assert same_floats(cast.scale.reshape(fp8.scale.shape), fp8.scale)
            assert fp8_code_mismatches(cast.codes, fp8.codes, cast.fp8_format) == 0
        seen += len(casts)
    assert seen == 3 * 2 * 7 * len(torchao.LINEAR_CASTS)  # 7 Linears per decoder layer
