"""fpemu.block_quantize's own rules: the exact OCP rule, microxcaling, Transformer Engine's kernel (no torch), and
fpemu.blocks.log2 (against torch where it is installed)."""

import functools
import os
import pathlib

import ml_dtypes
import numpy as np
import pytest

import fpemu
from fpemu.blocks import SCALE_RULES, block_quantize
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks
from fpemu.errors import FpemuInputError


def test_ocp_rule_is_exact_quantize_of_each_block_by_its_power_of_two():
    x = probe_blocks("wide", "fp8_e4m3fn", rows=32, seed=1).astype(np.float64)
    q = block_quantize(x, "fp8_e4m3fn", scale_rule="ocp")
    exponent = np.floor(np.log2(np.abs(x).max(axis=-1))) - 8
    assert np.array_equal(q.scale_codes[:, 0], np.clip(exponent, -127, 127) + 127)
    scale = np.exp2(q.scale_codes.astype(np.float64) - 127)           # (32, 1): one per block
    expected = fpemu.quantize(x / scale, "fp8_e4m3fn", overflow="saturate") * scale
    assert np.array_equal(q.values, expected.astype(np.float32))
    assert np.array_equal(q.element_codes, fpemu.encode(x / scale, "fp8_e4m3fn", overflow="saturate"))


def test_microxcaling_rounds_ties_away_where_ocp_rounds_to_even():
    x = np.array([[4.0, 1.25, 2.5] + [0.0] * 29], np.float32)  # scale 1: 1.25 and 2.5 are fp4 ties
    assert block_quantize(x, "fp4_e2m1fn", scale_rule="ocp").values[0, :3].tolist() == [4.0, 1.0, 2.0]
    assert block_quantize(x, "fp4_e2m1fn", scale_rule="microxcaling").values[0, :3].tolist() == [4.0, 1.5, 3.0]


def test_microxcaling_float32_log2_gives_the_scale_above_just_below_a_power_of_two():
    x = np.zeros((2, 32), np.float32)
    x[0, 0] = np.nextafter(np.float32(2.0**20), np.float32(0))     # log2 rounds to 20.0 in float32
    x[1, 0] = np.float32(2.0**20)
    mx = block_quantize(x, "fp8_e4m3fn", scale_rule="microxcaling").scale_codes[:, 0].tolist()
    ocp = block_quantize(x, "fp8_e4m3fn", scale_rule="ocp").scale_codes[:, 0].tolist()
    assert ocp == [127 + 19 - 8, 127 + 20 - 8] and mx == [127 + 20 - 8, 127 + 20 - 8]
    zeros = block_quantize(np.zeros((1, 32), np.float32), "fp8_e4m3fn", scale_rule="microxcaling")
    assert zeros.scale_codes.tolist() == [[0]] and zeros.values.max() == 0


MICROXCALING_COMMIT = "7bc41952de394f5cc5e782baf132e7c7542eb4e4"
_MX_NAMES = {"fp8_e4m3fn": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "fp6_e2m3fn": "fp6_e2m3", "fp6_e3m2fn": "fp6_e3m2",
             "fp4_e2m1fn": "fp4_e2m1"}


@functools.lru_cache(maxsize=None)
def _microxcaling_modules():
    """microxcaling's modules on _quantize_mx's path (formats, specs, elemwise_ops, mx_ops), unchanged, from
    FPEMU_MICROXCALING_SOURCE: a checkout, or a git mirror holding 7bc4195 (default tests/data/microxcaling,
    their copies at that commit); loaded as a package of their own, without mx/__init__.py (its nn layers)."""
    import subprocess
    import sys
    import types
    root = pathlib.Path(os.environ.get("FPEMU_MICROXCALING_SOURCE") or pathlib.Path(__file__).parent / "data"
                        / "microxcaling").expanduser()
    package = types.ModuleType("_microxcaling_mx")
    package.__path__ = []
    for name in ("formats", "specs", "elemwise_ops", "mx_ops"):
        path = f"mx/{name}.py"
        if (root / path).is_file():
            text = (root / path).read_text(encoding="utf-8")
        else:
            run = subprocess.run(["git", "--git-dir", str(root), "show", f"{MICROXCALING_COMMIT}:{path}"],
                                 capture_output=True, text=True)
            if run.returncode:
                return None
            text = run.stdout
        module = types.ModuleType(f"{package.__name__}.{name}")
        module.__package__ = package.__name__
        sys.modules[module.__name__] = module
        exec(compile(text, f"<microxcaling {path}>", "exec"), module.__dict__)
        setattr(package, name, module)
    return package


def microxcaling_quantize(x, elem: str):
    """microxcaling's own _quantize_mx on x (torch, x's dtype), blocks of 32 along the last axis, round='nearest'."""
    torch = pytest.importorskip("torch")
    mx = _microxcaling_modules()
    if mx is None:
        pytest.skip("no microxcaling source (set FPEMU_MICROXCALING_SOURCE to a checkout or git mirror of "
                    f"microsoft/microxcaling holding {MICROXCALING_COMMIT[:7]})")
    bits = x.view(f"u{x.dtype.itemsize}").astype(f"i{x.dtype.itemsize}")
    dtype = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[str(x.dtype)]
    tensor = torch.from_numpy(bits).view(dtype)
    out = mx.mx_ops._quantize_mx(tensor, 8, mx.formats.ElemFormat.from_str(_MX_NAMES[elem]), axes=[-1],
                                 block_size=32, round="nearest")
    return out.double().numpy()  # (exact from every one of those types)


_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float64": np.float64, "float16": np.float16}


@pytest.mark.parametrize("dtype", list(_DTYPES))
@pytest.mark.parametrize("elem", list(_MX_NAMES))
def test_microxcaling_rule_is_microxcalings_own_code(elem, dtype):
    """Every probe kind, bit for bit (NaN-aware), in the input's own type: bf16 and float16 round every step
    again in their type (log2 too), and zero comes out +0 where the scaled value is zero (torch.sign(-0) is +0)."""
    for kind in PROBE_KINDS:
        with np.errstate(over="ignore"):  # (float16: wide values become inf)
            x = probe_blocks(kind, elem, rows=64, seed=PROBE_KINDS.index(kind)).astype(_DTYPES[dtype])
        assert_microxcalings_values(x, elem, kind)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("elem", list(_MX_NAMES))
def test_microxcaling_rule_is_microxcalings_own_code_on_every_16_bit_pattern(elem, dtype):
    """All 65,536 patterns in order (neighbours share a block) and shuffled, and float64 within 16 ulps of
    powers of two (its log2 rounds onto them there)."""
    every = np.arange(1 << 16, dtype=np.uint16).view(_DTYPES[dtype]).reshape(-1, 32)
    assert_microxcalings_values(every, elem, "in order")
    shuffled = np.random.default_rng(5).permutation(every.reshape(-1)).reshape(-1, 32)
    assert_microxcalings_values(shuffled, elem, "shuffled")
    # (values are float32: the powers of two whose blocks' values it holds exactly)
    powers = np.ldexp(1.0, np.arange(-100, 121)).view(np.int64)
    near = (powers[:, None] + np.arange(-16, 16)[None, :]).view(np.float64)       # a block per power of two
    assert_microxcalings_values(near * np.where(np.arange(32) % 3, 1, -1), elem, "float64 next to powers of two")


def assert_microxcalings_values(x, elem, what):
    theirs = microxcaling_quantize(x, elem)
    ours = block_quantize(x, elem, scale_rule="microxcaling").values.astype(np.float64)
    differ = (ours.view(np.uint64) != theirs.view(np.uint64)) & ~(np.isnan(ours) & np.isnan(theirs))
    assert np.count_nonzero(differ) == 0, (what, x[differ][:4], ours[differ][:4], theirs[differ][:4])


def test_te_kernel_scale_rounds_amax_times_reciprocal_up_and_maps_byte_0_to_2_127():
    x = np.zeros((3, 32), np.float32)
    x[0, 0], x[1, 0], x[2, 0] = 448.0, 449.0, 2.0**-130
    q = block_quantize(x, "fp8_e4m3fn", scale_rule="te_mxfp8")
    assert q.scale_codes.ravel().tolist() == [127, 128, 0]
    assert q.values[1, 0] == 448.0                                  # 449 * 2**-1 -> 224
    assert q.element_codes[2, 0] == fpemu.encode(np.float32(2.0**-130 * 2.0**127), "fp8_e4m3fn")
    nan = x.copy()
    nan[0, 5] = np.nan                                              # fmaxf leaves NaN out of amax
    assert block_quantize(nan, "fp8_e4m3fn", scale_rule="te_mxfp8").scale_codes[0, 0] == 127


@pytest.mark.parametrize("rule", ["ocp", "microxcaling"])
def test_a_block_with_inf_gets_the_same_codes_from_float64_as_from_float32(rule):
    # (the float64 path once skipped its NaN handling when amax was inf, not NaN: codes 0x7F, not 0)
    x = np.zeros((1, 32), np.float32)
    x[0, :2] = np.inf, 1.0
    single, double = (block_quantize(x.astype(dtype), "fp8_e4m3fn", scale_rule=rule) for dtype in (np.float32, np.float64))
    assert single.scale_codes.tolist() == double.scale_codes.tolist() == [[255]]
    assert single.element_codes.tolist() == double.element_codes.tolist() == [[0] * 32]


def test_axis_blocks_and_result_shapes():
    x = probe_blocks("random", "fp8_e4m3fn", rows=64, block_size=4, seed=2).reshape(8, 32)
    along0 = block_quantize(x, "fp8_e5m2", block_size=8, scale_rule="ocp", axis=0)
    along1 = block_quantize(x.T.copy(), "fp8_e5m2", block_size=8, scale_rule="ocp")
    assert along0.scale_codes.shape == (1, 32) and along0.axis == 0
    assert np.array_equal(along0.values, along1.values.T) and np.array_equal(along0.scale_codes, along1.scale_codes.T)
    assert block_quantize(x, "fp4_e2m1fn").packed_codes.shape == (8, 16)


def test_nvfp4_one_level_underflows_small_tensors_two_levels_keep_them():
    x = (np.random.default_rng(0).standard_normal((16, 64)) * 1e-3).astype(np.float32)
    one = block_quantize(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4")
    two = block_quantize(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4_2level")
    assert np.count_nonzero(one.values) == 0
    assert np.count_nonzero(two.values) > 0.9 * x.size and two.tensor_scale == float(np.float32(np.abs(x).max()) / np.float32(2688))


def test_two_level_nvfp4_nan_tensor_amax_follows_torchs_thread_split():
    """torch's max of a NaN-holding tensor is 0xFFFFFFFF (fp4 code 0xC) unless 2+ threads split it past
    32,768 values (0x7FC00000, code 0x3): a one-value tensor's NaN comes back quieted, its sign cleared."""
    x = np.ones((2049, 16), np.float32)
    x[7, 7] = np.nan
    codes = {threads: block_quantize(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4_2level",
                                     torch_threads=threads).element_codes[0, 0] for threads in (1, 2)}
    assert codes == {1: 0xC, 2: 0x3}
    small = block_quantize(x[:2048], "fp4_e2m1fn", scale_rule="torchao_nvfp4_2level", torch_threads=2)
    assert small.element_codes[0, 0] == 0xC
    lone = np.array([[np.array(0xFF800001, np.uint32).view(np.float32)]])
    one = block_quantize(lone, "fp4_e2m1fn", block_size=1, scale_rule="torchao_nvfp4_2level")
    assert np.float32(one.tensor_scale).view(np.uint32) == 0x7FC00001


def test_every_rule_names_its_departures_and_source():
    for rule in SCALE_RULES.values():
        assert rule.source and rule.departs, rule.name


@pytest.mark.parametrize("call,words", [
    (lambda: block_quantize(np.ones(32, np.float32), scale_rule="mx"), "scale_rule: unknown rule 'mx'"),
    (lambda: block_quantize(np.ones(32, np.float32), "bf16"), "element_format: rule 'ocp' supports"),
    (lambda: block_quantize(np.ones(30, np.float32)), "not a multiple of block_size=32"),
    (lambda: block_quantize(np.ones(32, np.float32), block_size=0), "block_size must be a positive int"),
    (lambda: block_quantize(np.ones(32, np.float32), axis=1), "axis must be an int in"),
    (lambda: block_quantize(np.ones(32, np.float32), scale_format="fp8_e4m3fn"), "scale_format: rule 'ocp'"),
    (lambda: block_quantize(np.full(32, 0.1), scale_rule="torchao_floor"), "computes in float32"),
    (lambda: block_quantize(np.ones(32, np.float32), torch_threads=0), "torch_threads must be a positive int"),
])
def test_bad_input_names_the_argument(call, words):
    with pytest.raises(FpemuInputError, match=words):
        call()


@pytest.mark.parametrize("rule", ["torchao_floor", "ocp", "torchao_nvfp4_2level"])
def test_chunked_arithmetic_gives_the_one_pass_result(rule, monkeypatch):
    import fpemu.blocks.quantize as implementation
    monkeypatch.setattr(implementation, "KERNELS", None)  # (the compiled pass has no chunks)
    x = probe_blocks("wide", "fp4_e2m1fn", rows=40, block_size=32, seed=4)
    whole = block_quantize(x, "fp4_e2m1fn", scale_rule=rule)
    monkeypatch.setattr(implementation, "_CHUNK_VALUES", 96)  # 3 blocks of 32 per chunk, a partial last one
    monkeypatch.setattr(implementation, "_ELEMENT_VALUES", 64)  # integer path: 2 blocks per pass, then 1
    chunked = block_quantize(x, "fp4_e2m1fn", scale_rule=rule)
    for field in ("scale_codes", "scales", "element_codes", "values"):
        a, b = getattr(whole, field), getattr(chunked, field)
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), field
    assert whole.tensor_scale == chunked.tensor_scale


def _integer_path_inputs() -> dict:
    rng = np.random.default_rng(11)
    shape = (256, 32)
    return {
        # every class of float32: subnormals, inf, quiet and signalling NaNs, in random blocks
        "bit patterns": rng.integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32).view(np.float32),
        # one scale per block across float32's whole exponent range (byte 0, 254, clamps)
        "all scales": (rng.standard_normal(shape) * np.exp2(rng.integers(-149, 127, (shape[0], 1)))).astype(np.float32),
        # 4 bits of mantissa: ties of every element format, max finite's neighbours
        "ties": (np.exp2(rng.integers(-30, 30, shape)) * (1 + rng.integers(0, 16, shape) / 16)).astype(np.float32),
    }


@pytest.mark.parametrize("passes", ["compiled", "numpy"])
@pytest.mark.parametrize("rule", [name for name, r in SCALE_RULES.items()
                                  if r.scale_format == "e8m0" and r.rounding == "nearest_even"])
def test_integer_element_path_gives_the_rules_own_arithmetic(rule, passes, monkeypatch):
    import fpemu.blocks.quantize as implementation
    if passes == "compiled" and implementation.KERNELS is None:
        pytest.skip("fpemu's compiled loops (fpemu/formats/_ckernels.c) were not built here or FPEMU_COMPILED=0")
    if passes == "numpy":  # (the path quantize takes without the compiled loops)
        monkeypatch.setattr(implementation, "KERNELS", None)
    rule = SCALE_RULES[rule]
    for elem in rule.elements:
        fmt = fpemu.get_format(elem)
        for kind, x in _integer_path_inputs().items():
            with np.errstate(all="ignore"):
                peak = implementation._block_peak(x)
                codes = implementation._EXPONENT_RULES[rule.exponent](
                    implementation._block_amax(x, peak, rule.amax_nan), fmt).astype(np.uint8)
                scales = implementation._e8m0_values(codes)
                fast, own = np.empty_like(x), np.empty_like(x)
                fast_codes = implementation._fast_elements(x, peak, codes, scales, fmt, rule, fast)
                own_codes = implementation._scaled_elements(x, codes, scales, fmt, rule, own)
            assert np.array_equal(fast_codes, own_codes), (rule.name, elem, kind)
            assert np.array_equal(fast.view(np.uint32), own.view(np.uint32)), (rule.name, elem, kind)


def _peak_edges(elem) -> np.ndarray:
    """Blocks of randn * 2**-30 under one peak each: every float32 exponent, with the mantissas where the
    compiled scale rules turn (0, 1 ulp, EVEN's half ulp at the element's width and its neighbours, all
    ones) and the amaxes within 2 ulps of max(element) * 2**k (TE's rounding of amax * fl32(1 / max))."""
    half = 1 << (22 - elem.mantissa_bits)
    mantissas = np.array([0, 1, half - 1, half, half + 1, 0x7FFFFF], np.uint32)
    fields = np.arange(1, 255, dtype=np.uint32)
    peaks = ((fields[:, None] << np.uint32(23)) | mantissas).reshape(-1)
    tops = (np.float32(elem.max_finite) * np.exp2(np.arange(-126, 127 - np.log2(elem.max_finite)))).astype(np.float32)
    near = (tops.view(np.uint32)[:, None].astype(np.int64) + np.arange(-2, 3)).reshape(-1).astype(np.uint32)
    peaks = np.concatenate([peaks, near]).view(np.float32)
    x = (np.random.default_rng(5).standard_normal((len(peaks), 32)) * 2.0**-30).astype(np.float32) * peaks[:, None]
    x[:, 7] = peaks * np.where(np.arange(len(peaks)) % 2, 1, -1)
    return x


@pytest.mark.parametrize("rule", [name for name, r in SCALE_RULES.items()
                                  if r.scale_format == "e8m0" and r.rounding == "nearest_even"])
def test_compiled_block_pass_gives_the_rules_own_arithmetic(rule):
    """fpemu_mx_blocks (peak, the rule's scale code or the codes given, and the element pass in C) against
    the rule's own arithmetic in numpy (no short path), on every probe kind, float32's bit patterns, every
    peak exponent with the rules' turning mantissas, bf16 values and a width other than 32."""
    import fpemu.blocks.quantize as implementation
    if implementation.KERNELS is None:
        pytest.skip("fpemu's compiled loops (fpemu/formats/_ckernels.c) were not built here or FPEMU_COMPILED=0")
    rule = SCALE_RULES[rule]
    for elem in rule.elements:
        fmt = fpemu.get_format(elem)
        inputs = {kind: probe_blocks(kind, elem, rows=64, seed=3) for kind in ("random", "wide", "edges", "tiny",
                                                                                 "zeros", "nan", "inf")}
        inputs.update(_integer_path_inputs())
        inputs["peak edges"] = _peak_edges(fmt)
        inputs["bf16 values"] = fpemu.quantize(probe_blocks("random", elem, rows=64, seed=4), "bf16")
        inputs["width 48"] = probe_blocks("wide", elem, rows=32, block_size=48, seed=6)
        for kind, x in inputs.items():
            compiled = block_quantize(x, elem, block_size=x.shape[1], scale_rule=rule)
            with implementation._rules_own_arithmetic():
                reference = block_quantize(x, elem, block_size=x.shape[1], scale_rule=rule)
            for field in ("scale_codes", "scales", "element_codes", "values"):
                ours, theirs = getattr(compiled, field), getattr(reference, field)
                assert np.array_equal(ours.view(np.uint8), theirs.view(np.uint8)), (rule.name, elem, kind, field)


def test_randn_blocks_take_the_compiled_pass_alone(monkeypatch):
    import fpemu.blocks.quantize as implementation
    if implementation.KERNELS is None:
        pytest.skip("fpemu's compiled loops (fpemu/formats/_ckernels.c) were not built here or FPEMU_COMPILED=0")

    def numpy_arithmetic(*args, **kwargs):
        raise AssertionError("a randn block was handed to the numpy arithmetic")

    monkeypatch.setattr(implementation, "_mx", numpy_arithmetic)
    x = probe_blocks("random", "fp8_e4m3fn", rows=512, seed=8)
    assert block_quantize(x, "fp8_e4m3fn", scale_rule="torchao_floor").values.shape == x.shape


def test_amax_ignoring_nan_takes_the_largest_other_value_even_next_to_a_signalling_nan():
    # numpy 2.4's np.fmax.reduce returns 4.27e33 for this block (it skips 9.14e35 next to the sNaN)
    import fpemu.blocks.quantize as implementation
    x = _integer_path_inputs()["bit patterns"]
    with np.errstate(all="ignore"):
        amax = implementation._block_amax(x, implementation._block_peak(x), "ignore")
        expected = [np.abs(row[~np.isnan(row)]).max() for row in x]
    assert np.array_equal(amax, np.array(expected, np.float32))


# --- floor and ceil of log2 as torch rounds it (fpemu.blocks.log2) --------------------------------------

_TORCH_LOG2_CHECK = """
import sys, numpy as np, torch, ml_dtypes
from fpemu.blocks.log2 import floor_log2, ceil_log2
torch.set_num_threads(1)

def mismatches(x, tensor):
    log2 = torch.log2(tensor)
    got = [torch.floor(log2).double().numpy(), torch.ceil(log2).double().numpy()]
    model = [floor_log2(x).astype(np.float64), ceil_log2(x).astype(np.float64)]
    return sum(int(np.count_nonzero((g != m) & ~(np.isnan(g) & np.isnan(m)))) for g, m in zip(got, model))

out = [torch.backends.cpu.get_cpu_capability()]
k = np.arange(-149, 129)
f32 = np.where(k == 128, 0x7F800000, np.ldexp(np.float32(1), np.minimum(k, 127)).view(np.uint32).astype(np.int64))
near = (f32[:, None] + np.arange(-1024, 1025)[None, :]).ravel()
near = np.unique(near[(near > 0) & (near < 0x7F800000)])
sweep = np.arange(1, 0x7F800000, 16411)
x = np.concatenate([near, sweep]).astype(np.uint32).view(np.float32)
out.append(mismatches(x, torch.from_numpy(x)))
every16 = np.arange(1 << 16, dtype=np.uint16)
for dtype, tdtype in ((ml_dtypes.bfloat16, torch.bfloat16), (np.float16, torch.float16)):
    out.append(mismatches(every16.view(dtype), torch.from_numpy(every16.view(np.int16)).view(tdtype)))
k = np.arange(-1074, 1025)
f64 = np.where(k == 1024, 0x7FF0000000000000, np.ldexp(1.0, np.minimum(k, 1023)).view(np.int64))
near = (f64[:, None] + np.arange(-256, 257)[None, :]).ravel()
x = np.unique(near[(near > 0) & (near < 0x7FF0000000000000)]).view(np.float64)
out.append(mismatches(x, torch.from_numpy(x)))
print(*out)
"""


# The tier below this host's (AVX2) by default; the host's own tier and the scalar one in stage 2 (a subprocess
# importing torch each, ~5-15 s apiece on 2 cores).
_STAGE2 = pytest.mark.stage2("another torch tier; the AVX2 tier's case of this test")


@pytest.mark.parametrize("tier", [pytest.param("", marks=_STAGE2), "avx2", pytest.param("default", marks=_STAGE2)],
                         ids=["torch_default_tier", "avx2", "no_simd"])
def test_floor_and_ceil_log2_are_torchs_on_every_tier(tier):
    """torch's floor/ceil of log2 against the model: float32 within 1,024 ulps of every power of two and
    every 16,411th bit pattern (0.7M values; all 2.1G positive float32 matched once: 0 mismatches), every
    bf16 and float16, float64 within 256 ulps of every power of two; ATEN_CPU_CAPABILITY picks the tier."""
    torch = pytest.importorskip("torch")
    import contextlib
    import io
    import subprocess
    import sys
    here = torch.backends.cpu.get_cpu_capability()
    expected = {"": here, "avx2": "AVX2", "default": "DEFAULT"}[tier]
    if expected == here:  # this process runs that tier (an AVX2 host): no child
        printed, threads = io.StringIO(), torch.get_num_threads()
        try:
            with contextlib.redirect_stdout(printed):
                exec(_TORCH_LOG2_CHECK, {})
        finally:
            torch.set_num_threads(threads)
        output = printed.getvalue()
    else:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": tier} if tier else dict(os.environ)
        output = subprocess.run([sys.executable, "-c", _TORCH_LOG2_CHECK], env=env, capture_output=True, text=True,
                                check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))).stdout
    capability, *counts = output.split()
    assert capability == expected and counts == ["0", "0", "0", "0"]


def test_floor_log2_rounds_up_just_below_powers_of_two_and_ceil_down_just_above():
    from fpemu.blocks.log2 import ceil_log2, floor_log2
    power = np.float32(2.0**100)
    below = (power.view(np.uint32) - np.arange(1, 47, dtype=np.uint32)).view(np.float32)   # 44 round up to 100
    above = (power.view(np.uint32) + np.arange(1, 25, dtype=np.uint32)).view(np.float32)   # 22 round down to 100
    assert floor_log2(below).tolist() == [100.0] * 44 + [99.0] * 2
    assert ceil_log2(above).tolist() == [100.0] * 22 + [101.0] * 2
    assert floor_log2(np.float32(np.finfo(np.float32).max)) == 128                         # torch: 128, exp2: inf
    specials = np.array([0.0, -0.0, np.inf, -1.0, np.nan, 1e-45], np.float32)
    assert np.array_equal(floor_log2(specials), np.array([-np.inf, -np.inf, np.inf, np.nan, np.nan, -149], np.float32),
                          equal_nan=True)
    with pytest.raises(TypeError, match="x: log2 is modelled for"):
        floor_log2(np.array([1], np.int32))
