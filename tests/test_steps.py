"""Seed 002's mixed-precision step: the seed's examples, bad input, bit-exact differential
tests against real JAX (both XLA flag modes) and torch, and model-driven traces."""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from hypothesis_budget import profile_examples

import fpemu.steps.step
import fpemu.steps.train
from fpemu.adapters import available
from fpemu.adapters.jax_step import process_mode
from fpemu.formats import Format
from fpemu.steps import SEMANTICS, StepSemantics, mixed_precision_step, train_trace
from fpemu.steps.probes import edge_cases
from fpemu.steps.semantics import FITTED_COMPUTE

SEED_EXAMPLES = [
    (dict(params={"w": [[0.5], [-1.25]], "b": [0.1]}, x=[[1.0, 2.0], [0.5, -1.0]], y=[[-1.9], [1.5]],
          loss_scale=1024.0, good_steps=0, lr=0.1, growth_interval=2),
     {"loss": 0.005159, "params": {"w": [[0.494775], [-1.240137]], "b": [0.089697]}, "loss_scale": 1024.0,
      "good_steps": 1, "grads_finite": True}),
    (dict(params={"w": [[1.3], [0.7]], "b": [-0.2]}, x=[[0.9, 1.1], [-0.4, 2.2]], y=[[1.94], [0.81]],
          loss_scale=512.0, good_steps=2, lr=0.05, growth_interval=3),
     {"loss": 0.021242, "params": {"w": [[1.309521], [0.709766]], "b": [-0.19043]}, "loss_scale": 1024.0,
      "good_steps": 0, "grads_finite": True}),
    (dict(params={"w": [[0.5], [-1.25]], "b": [0.1]}, x=[[1.0, 2.0], [0.5, -1.0]], y=[[40.0], [-30.0]],
          loss_scale=3e38, good_steps=0, lr=0.1, growth_interval=2),
     {"loss": 1377.068848, "params": {"w": [[0.5], [-1.25]], "b": [0.1]}, "loss_scale": 1.5e38,
      "good_steps": 0, "grads_finite": False}),
]


def rounded(out):
    """The seed's printed form: six decimals (the scale to seven significant digits)."""
    return {"loss": round(float(out["loss"]), 6),
            "params": {k: np.round(np.asarray(v, np.float64), 6).tolist() for k, v in out["params"].items()},
            "loss_scale": float(f"{float(out['loss_scale']):.7g}"), "good_steps": int(out["good_steps"]),
            "grads_finite": bool(out["grads_finite"])}


@pytest.mark.parametrize("inputs,expected", SEED_EXAMPLES)
def test_seed_examples(inputs, expected):
    out = mixed_precision_step(**inputs)
    assert rounded(out) == expected
    assert out["loss"].dtype == np.float32 and out["params"]["w"].dtype == np.float32
    assert out["good_steps"].dtype == np.int32 and out["grads_finite"].dtype == np.bool_


def test_default_xla_flags_do_not_give_the_seed_outputs():
    """With excess precision (XLA's default) the bias add stays float32: a different step."""
    out = mixed_precision_step(**SEED_EXAMPLES[0][0], mode="jax_cpu")
    assert round(float(out["loss"]), 6) == 0.00501 and rounded(out) != SEED_EXAMPLES[0][1]
    assert float(mixed_precision_step(**SEED_EXAMPLES[2][0])["loss_scale"]) == float(np.float32(3e38) / 2)


def test_fp16_compute_rounds_differently():
    bf16 = mixed_precision_step(**SEED_EXAMPLES[0][0])
    fp16 = mixed_precision_step(**SEED_EXAMPLES[0][0], compute="fp16")
    assert fp16["loss"] != bf16["loss"] and abs(float(fp16["loss"]) - 0.00516) < 2e-4


def bad(**changes):
    return {**SEED_EXAMPLES[0][0], **changes}


@pytest.mark.parametrize("inputs,error,words", [
    (bad(x=[[1.0, 2.0, 3.0]]), ValueError, r"params\['w'\] must have shape \(D, K\) with D = x.shape\[1\] = 3"),
    (bad(y=[[1.0, 2.0], [3.0, 4.0]]), ValueError, r"y must have shape \(B, K\) = \(2, 1\)"),
    (bad(params={"w": [[0.5], [1.0]], "b": [0.1, 0.2]}), ValueError, r"params\['b'\] must have shape \(K,\)"),
    (bad(x=[1.0, 2.0]), ValueError, "x must be a non-empty 2-d array"),
    (bad(params={"w": [[1.0]]}), TypeError, "params must be a dict with keys 'w' and 'b'"),
    (bad(growth_interval=0), ValueError, "growth_interval must be at least 1"),
    (bad(growth_interval=2.0), TypeError, "growth_interval must be an int"),
    (bad(good_steps=2), ValueError, "good_steps must be from 0 to 1"),
    (bad(loss_scale=0.0), ValueError, "loss_scale must be a positive finite float32"),
    (bad(loss_scale=1e39), ValueError, "loss_scale must be a positive finite float32"),
    (bad(lr=-0.1), ValueError, "lr must be a positive finite float32"),
    (bad(lr="0.1"), TypeError, "lr must be a number"),
])
def test_bad_input(inputs, error, words):
    with pytest.raises(error, match=words):
        mixed_precision_step(**inputs)


def test_bad_compute_and_mode():
    with pytest.raises(ValueError, match="compute: unknown format 'bf8'.*compute formats: bf16, fp16"):
        mixed_precision_step(**SEED_EXAMPLES[0][0], compute="bf8")
    with pytest.raises(ValueError, match="compute: 'tf32' is not a compute format"):
        mixed_precision_step(**SEED_EXAMPLES[0][0], compute="tf32")
    with pytest.raises(ValueError, match="mode: unknown semantics 'xla'; presets: seed, jax_cpu"):
        mixed_precision_step(**SEED_EXAMPLES[0][0], mode="xla")
    with pytest.raises(ValueError, match="mode 'jax_cpu': its orders were fitted for dimensions 1..4, got B=5"):
        mixed_precision_step({"w": np.ones((1, 1)), "b": np.ones(1)}, np.ones((5, 1)), np.ones((5, 1)), 1.0, 0, 0.1, 1,
                             mode="jax_cpu")
    with pytest.raises(ValueError, match="reduce must be one of"):
        StepSemantics("mine", reduce="tree")
    with pytest.raises(ValueError, match="mode 'torch_cpu': fitted and checked for compute bf16, fp16 only, "
                                         "got 'fp8_e4m3fn'"):
        mixed_precision_step(**SEED_EXAMPLES[0][0], compute="fp8_e4m3fn", mode="torch_cpu")
    with pytest.raises(ValueError, match="mode 'jax_cpu': fitted and checked for compute bf16, fp16, fp8_e4m3fn, "
                                         "fp8_e5m2 only, got 'fp32'"):
        mixed_precision_step(**SEED_EXAMPLES[0][0], compute="fp32", mode="jax_cpu")
    with pytest.raises(ValueError, match="mode 'torch_cpu_compiled': fitted and checked for compute bf16 only"):
        mixed_precision_step(**SEED_EXAMPLES[0][0], compute="fp16", mode="torch_cpu_compiled")
    # a custom semantics with one fitted order is held to that order's formats only
    mine = StepSemantics("mine", dot="sequential", reduce="torch_cpu")
    assert mixed_precision_step(**SEED_EXAMPLES[0][0], compute="fp16", mode=mine)["grads_finite"]
    # the compute format goes by its layout, not its name
    as_fp16 = mixed_precision_step(**SEED_EXAMPLES[0][0], compute=Format("bf16", 5, 10, 15))
    assert as_fp16["loss"] == mixed_precision_step(**SEED_EXAMPLES[0][0], compute="fp16")["loss"]


# --- differential tests against the real frameworks ---------------------------------------------

def bits(value):
    return np.asarray(value, np.float32).reshape(-1).view(np.uint32)


def ulps(a, b):
    """Distance in float32 steps between bit patterns (sign-magnitude mapped onto a line)."""
    def line(u):
        u = u.astype(np.int64)
        return np.where(u & 0x80000000, -(u & 0x7FFFFFFF), u)
    return np.abs(line(bits(a)) - line(bits(b)))


def differences(emulated, real) -> list:
    """Every output whose bit pattern differs (NaNs of any payload are equal), with ulp distances."""
    found = []
    for name, a, b in [("loss", emulated["loss"], real["loss"]), ("w", emulated["params"]["w"], real["params"]["w"]),
                       ("b", emulated["params"]["b"], real["params"]["b"]),
                       ("loss_scale", emulated["loss_scale"], real["loss_scale"])]:
        a32, b32 = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
        if not np.all((bits(a32) == bits(b32)) | (np.isnan(a32) & np.isnan(b32))):
            found.append(f"{name}: emulated {a32.tolist()} real {b32.tolist()} ulps {ulps(a32, b32).tolist()}")
    for name in ("good_steps", "grads_finite"):
        if emulated[name] != real[name]:
            found.append(f"{name}: emulated {emulated[name]} real {real[name]}")
    return found


def finite_f32(array):
    with np.errstate(over="ignore"):
        return np.clip(array, -3.4028234e38, 3.4028234e38).astype(np.float32)


def f32_arrays(shape):
    """Arrays whose magnitudes reach float32/bf16 underflow and overflow: small values times
    one power of two per array, or any finite float32 per element."""
    mantissas = arrays(np.float64, shape, elements=st.floats(-8, 8, allow_subnormal=False))
    scaled = st.tuples(mantissas, st.integers(-150, 126)).map(lambda t: finite_f32(t[0] * 2.0 ** t[1]))
    anything = arrays(np.float32, shape, elements=st.floats(width=32, allow_nan=False, allow_infinity=False))
    return st.one_of(scaled, scaled, anything)


@st.composite
def step_cases(draw, shape=None):
    """One step's arguments; ``shape`` (B, D, K) fixed, or drawn with B, D, K in 1..4."""
    batch, dim, out = shape or tuple(draw(st.integers(1, 4)) for _ in range(3))
    interval = draw(st.integers(1, 3))
    scale = draw(st.one_of(st.integers(0, 127).map(lambda e: 2.0 ** e), st.floats(1e-5, 3.2e38)))
    lr = draw(st.one_of(st.floats(1e-6, 1e2), st.floats(1e2, 1e38)))
    return dict(params={"w": draw(f32_arrays((dim, out))), "b": draw(f32_arrays((out,)))},
                x=draw(f32_arrays((batch, dim))), y=draw(f32_arrays((batch, out))), loss_scale=float(np.float32(scale)),
                good_steps=draw(st.integers(0, interval - 1)), lr=float(np.float32(lr)), growth_interval=interval)


needs_jax = pytest.mark.skipif(not available("jmp"), reason="jax not installed")
needs_torch = pytest.mark.skipif(not available("torch"), reason="torch not installed")


XLA_MODES = ("jax_cpu", "jax_cpu_strict")
XLA_COMBOS = [(mode, compute) for mode in XLA_MODES for compute in FITTED_COMPUTE["xla_cpu"]]
# The shape classes of docs/steps.md (which of B, D, K are 1), each with shapes in the order the
# mode x format combinations take them (combination i takes shape i, cycling), rule edges first:
# B, D, K >= 2 starts with the paired dot orders (D or B == 4 with 4 rows or columns), B == 1 with
# the two-output GEMV (K == 2, D >= 3), B >= 2 with D == 1 with the weight gradient's (K == 2, B >= 3).
CLASS_SHAPES = {
    "B,D,K>1": [(2, 4, 4), (4, 4, 2), (4, 2, 4), (3, 4, 4), (4, 4, 3), (4, 3, 4), (4, 4, 4), (2, 3, 2)],
    "B,D>1,K=1": [(2, 2, 1), (4, 3, 1), (3, 4, 1), (4, 4, 1), (2, 3, 1), (3, 2, 1), (4, 2, 1), (3, 3, 1)],
    "B,K>1,D=1": [(3, 1, 2), (4, 1, 2), (2, 1, 3), (4, 1, 4), (2, 1, 2), (3, 1, 3), (2, 1, 4), (4, 1, 3)],
    "B>1,D=K=1": [(2, 1, 1), (3, 1, 1), (4, 1, 1)],
    "D,K>1,B=1": [(1, 3, 2), (1, 4, 2), (1, 2, 3), (1, 4, 4), (1, 2, 2), (1, 3, 4), (1, 4, 3), (1, 3, 3)],
    "D>1,B=K=1": [(1, 2, 1), (1, 3, 1), (1, 4, 1)],
    "K>1,B=D=1": [(1, 1, 2), (1, 1, 3), (1, 1, 4)],
    "B=D=K=1": [(1, 1, 1)],
}
EDGE_CASES_PER_CLASS = 24


def combo_shapes(mode: str, compute: str) -> dict:
    """Each class's shape for one mode x format combination."""
    index = XLA_COMBOS.index((mode, compute))
    return {name: shapes[index % len(shapes)] for name, shapes in CLASS_SHAPES.items()}


def check_with_jax(cases, mode: str, compute: str) -> None:
    """Run the cases under jax.jit (one compiled program per shape) and assert the emulation of
    this CPU's preset matches every one bit for bit."""
    from fpemu.adapters.jax_step import host_semantics, run_jax_steps
    semantics = host_semantics(mode)
    for case, real in zip(cases, run_jax_steps(cases, mode=mode, compute=compute)):
        found = differences(mixed_precision_step(**case, mode=semantics, compute=compute), real)
        assert not found, f"mode {semantics}, {compute}: {found}\ncase {case}"


def class_cases(mode: str, compute: str, shape_class: str) -> list:
    """The seeded edge cases of one class x format x mode (a third probe the dot orders with
    products that overflow, underflow or are signed zeros)."""
    seed = XLA_COMBOS.index((mode, compute)) * 100 + list(CLASS_SHAPES).index(shape_class)
    return edge_cases(combo_shapes(mode, compute)[shape_class], EDGE_CASES_PER_CLASS, seed)


STAGE2 = os.environ.get("FPEMU_TEST_ENVS") == "1"  # (conftest's switch: stage 2 runs the stage2-marked tests)


def _in_default_suite(mode: str, compute: str, name: str) -> bool:
    """A checkerboard over combinations x classes: the default suite runs each class under four of the eight
    mode x format combinations and each combination on four classes; stage 2 runs the other half."""
    return (XLA_COMBOS.index((mode, compute)) + list(CLASS_SHAPES).index(name)) % 2 == 0


def run_shapes(mode: str, compute: str) -> list:
    """The shapes this suite compiles for one combination: its default classes', or every class's in stage 2."""
    return sorted({shape for name, shape in combo_shapes(mode, compute).items()
                   if STAGE2 or _in_default_suite(mode, compute, name)})


def _class_run(mode: str, compute: str, name: str):
    if _in_default_suite(mode, compute, name):
        return pytest.param(mode, compute, name)
    return pytest.param(mode, compute, name, marks=pytest.mark.stage2(
        "test_xla_step_per_shape_class: the same class under the other mode x format combinations"))


# This process's flag mode first: meanwhile the worker compiles the other mode's programs.
CLASS_RUNS = [_class_run(*run) for run in sorted(((mode, compute, name) for mode, compute in XLA_COMBOS
                                                   for name in CLASS_SHAPES), key=lambda run: run[0] != process_mode())]


@pytest.fixture(scope="module")
def other_mode_compiled_meanwhile():
    """The worker (the other flag mode) compiles its shapes on the second core while this process
    runs its own mode's cases."""
    from fpemu.adapters.jax_step import precompile
    for mode, compute in XLA_COMBOS:
        precompile(run_shapes(mode, compute), mode=mode, compute=compute)


@needs_jax
@pytest.mark.parametrize("mode,compute,shape_class", CLASS_RUNS)
def test_xla_step_per_shape_class(mode, compute, shape_class, other_mode_compiled_meanwhile):
    """Every shape class x format x flag mode on fixed seeded edge cases: no hypothesis luck."""
    check_with_jax(class_cases(mode, compute, shape_class), mode, compute)


def _found_2x4x4(w_rows, scale_exp, x):
    """The hypothesis finds of 2x4x4 bf16 (dot products that overflow alone but not fused)."""
    w = np.zeros((4, 4))
    w[:len(w_rows), :len(w_rows[0])] = w_rows
    return dict(params={"w": finite_f32(w * 2.0 ** scale_exp), "b": np.zeros(4, np.float32)},
                x=np.array(x, np.float32), y=np.zeros((2, 4), np.float32), loss_scale=1.0, good_steps=0, lr=1.0,
                growth_interval=1)


FOUND_CASES = [
    # x @ w = 4 * 3 * 2^124 + 4 * -4 * 2^124: XLA's paired, unfused order for B == 2, D == K == 4
    # rounds the second product to -inf (fused from the first it would be -2^126).
    ("jax_cpu", "bf16", _found_2x4x4([[3, 0, 0, 0], [-4, 0, 0, 0]], 124, [[4.0] * 4] * 2)),
    # four products of +-2^128 each: inf + -inf in the unfused order is NaN (fused: inf).
    ("jax_cpu_strict", "bf16", _found_2x4x4(np.ones((4, 4)), 116, [[4096.0, -4096.0, -4096.0, -4096.0],
                                                                    [-4096.0] * 4])),
] + [
    # x[0] @ w[:, 0] = (1 + 2^-11) + 2^-24 + 0 + 2^-24, an f16 tie broken by the last term: AVX2's
    # paired sgemm sums 2^-24 + 2^-24 apart and rounds up to 1 + 2^-10, AVX-512's one chain loses
    # both 2^-24 and ties to 1 (f16 products never overflow, so the edge cases could not tell them apart).
    (mode, "fp16", _found_2x4x4([[1.5], [2.0 ** -12], [0], [2.0 ** -12]], 0,
                                [[683 / 1024, 2.0 ** -12, 1, 2.0 ** -12], [0, 0, 0, 0]])) for mode in XLA_MODES
]


@needs_jax
@pytest.mark.parametrize("mode,compute,case", FOUND_CASES)
def test_xla_found_cases(mode, compute, case):
    check_with_jax([case], mode, compute)


@pytest.mark.parametrize("mode", XLA_MODES)
def test_avx512_sgemm_accumulates_the_found_cases_in_one_fma_chain(mode):
    """oneDNN's AVX-512 sgemm has no paired order: the first found case's x @ w is one FMA chain
    (4 * 1.5 * 2^125 then + 4 * -2^126: -2^126, finite), so its gradients are finite where AVX2's are not."""
    case = FOUND_CASES[0][2]
    paired = mixed_precision_step(**case, mode=mode, compute="bf16")
    chained = mixed_precision_step(**case, mode=f"{mode}_avx512", compute="bf16")
    assert not bool(paired["grads_finite"]) and bool(chained["grads_finite"])
    fp16_case = FOUND_CASES[-1][2]
    losses = [mixed_precision_step(**fp16_case, mode=name, compute="fp16")["loss"] for name in (mode, f"{mode}_avx512")]
    assert losses[0] != losses[1]  # fp16's dots are float32 dots too: the tie breaks on AVX2 only


@needs_jax
def test_xla_cpu_tier_follows_onednn_cap():
    """The tier is read from what XLA computes: ONEDNN_MAX_CPU_ISA=AVX2 gives the AVX2 tier on any x86 CPU."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "XLA_FLAGS": "--xla_cpu_max_isa=AVX2", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", "from fpemu.adapters.jax_step import xla_cpu_tier; print(xla_cpu_tier())"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["avx2"]


# x = w = 1 + 2^-10, b = 2^-11: x * w = 1 + 2^-9 + 2^-20 rounds to 1 + 2^-9 in f16, and adding b
# then ties to even (1 + 2^-9); one f16 FMA rounds the exact 1 + 2^-9 + 2^-11 + 2^-20 up to 1 + 3 * 2^-10.
FP16_D1_CASE = dict(params={"w": [[1 + 2.0 ** -10]], "b": [2.0 ** -11]}, x=[[1 + 2.0 ** -10]], y=[[0.0]],
                    loss_scale=1.0, good_steps=0, lr=1.0, growth_interval=1)


@pytest.mark.parametrize("mode", XLA_MODES)
def test_fp16_bias_add_with_d1_is_one_fma_on_avx512fp16(mode):
    """With D == 1 XLA fuses the dot (a multiply) with the bias add, and on AVX512-FP16 LLVM
    contracts the f16 multiply and add into one vfmadd...sh (read in the optimized IR; llc
    -mcpu=sapphirerapids): the prediction is rounded once."""
    fused = mixed_precision_step(**FP16_D1_CASE, mode=f"{mode}_avx512fp16", compute="fp16")
    rounded = mixed_precision_step(**FP16_D1_CASE, mode=mode, compute="fp16")
    assert fused["loss"] == np.float32((1 + 3 * 2.0 ** -10) ** 2) and rounded["loss"] == np.float32((1 + 2.0 ** -9) ** 2)
    bf16 = {name: mixed_precision_step(**FP16_D1_CASE, mode=name, compute="bf16")["loss"]
            for name in (mode, f"{mode}_avx512fp16")}
    assert len(set(bf16.values())) == 1  # bf16 ops are float32 ops: nothing to fuse in f16


@needs_jax
@pytest.mark.parametrize("mode", XLA_MODES)
def test_xla_fp16_bias_add_with_d1(mode):
    """The live check of the case above: jax.jit rounds once where this CPU has AVX512-FP16."""
    from fpemu.adapters.jax_step import run_jax_steps, xla_cpu_tier
    [real] = run_jax_steps([FP16_D1_CASE], mode=mode, compute="fp16")
    fma = xla_cpu_tier() == "avx512fp16"
    assert real["loss"] == np.float32((1 + 3 * 2.0 ** -10) ** 2 if fma else (1 + 2.0 ** -9) ** 2)
    check_with_jax([FP16_D1_CASE], mode, "fp16")


def test_fp16_fma_result_rounds_the_exact_value_once():
    """Kernel.fma_result against exact rational arithmetic, ties and f16 subnormals included."""
    from fractions import Fraction
    from fpemu.formats import FORMATS
    from fpemu.steps.kernel import Kernel
    k = Kernel(SEMANTICS["jax_cpu_avx512fp16"], FORMATS["fp16"])
    rng = np.random.default_rng(16)
    values = (rng.standard_normal((3, 3000)) * 2.0 ** rng.integers(-14, 8, (3, 3000))).astype(np.float16)
    a, b, c = values.astype(np.float32)
    got = k.fma_result(a, b, c)
    for ai, bi, ci, gi in zip(a, b, c, got):
        exact = Fraction(float(ai)) * Fraction(float(bi)) + Fraction(float(ci))
        near = np.float16(float(exact))  # within one f16 step of the exact value
        steps = [np.nextafter(near, np.float16(-np.inf)), near, np.nextafter(near, np.float16(np.inf))]
        best = min((abs(Fraction(float(v)) - exact), int(v.view(np.uint16)) & 1, float(v))
                   for v in steps if np.isfinite(v))
        assert gi == best[2], (ai, bi, ci, gi, best)


CASES_PER_EXAMPLE = 8


@st.composite
def step_batches(draw, shapes):
    """A list of cases of one shape: each example costs at most one compile."""
    shape = draw(st.sampled_from(shapes))
    return draw(st.lists(step_cases(shape), min_size=CASES_PER_EXAMPLE, max_size=CASES_PER_EXAMPLE))


@needs_jax
@pytest.mark.parametrize("mode,compute", XLA_COMBOS)
@settings(max_examples=profile_examples(20 if STAGE2 else 40), deadline=None)  # (half the batches by default)
@given(data=st.data())
def test_bit_exact_with_jax(mode, compute, data):
    """Hypothesis on the shapes test_xla_step_per_shape_class compiled (so no new compiles).  fp16:
    XLA's excess precision is bf16's alone, so both modes compute it strictly.  fp8: ops computed
    in f16 and the loss fusion's own sum order (docs/steps.md)."""
    cases = data.draw(step_batches(run_shapes(mode, compute)))
    check_with_jax(cases, mode, compute)


@needs_jax
@pytest.mark.parametrize("mode", ["jax_cpu", "jax_cpu_strict"])
def test_xla_rounds_fp8_dot_results_through_fp16(mode):
    """x @ w = 1.0625 + 2**-12: fp8_e4m3fn's midpoint plus less than half an f16 ulp.  Straight to
    fp8 it rounds up to 1.125; XLA rounds it to f16 first (1.0625, a tie) and then to fp8 (1.0)."""
    case = dict(params={"w": np.array([[1.0], [0.0625], [2.0**-6]], np.float32), "b": np.zeros(1, np.float32)},
                x=np.array([[1.0, 1.0, 2.0**-6]], np.float32), y=np.zeros((1, 1), np.float32),
                loss_scale=1.0, good_steps=0, lr=0.5, growth_interval=10)
    from fpemu.adapters.jax_step import run_jax_steps
    [real] = run_jax_steps([case], mode=mode, compute="fp8_e4m3fn")
    assert real["loss"] == 1.0
    assert not differences(mixed_precision_step(**case, mode=mode, compute="fp8_e4m3fn"), real)
    direct = dataclasses.replace(SEMANTICS[mode], fp8_ops_in_fp16=False)
    assert mixed_precision_step(**case, mode=direct, compute="fp8_e4m3fn")["loss"] == 1.125 ** 2


@needs_torch
@pytest.mark.parametrize("compute", FITTED_COMPUTE["torch_cpu"])
@pytest.mark.parametrize("mode,unscale", [("torch_cpu", "divide"), ("torch_cpu_grad_scaler", "reciprocal")])
@settings(max_examples=profile_examples(1 if STAGE2 else 2), deadline=None)  # (half the cases by default)
@given(case=step_cases())
def test_bit_exact_with_torch(mode, unscale, compute, case):
    from fpemu.adapters.torch_step import torch_step
    real = torch_step(**case, unscale=unscale, compute=compute)
    found = differences(mixed_precision_step(**case, mode=mode, compute=compute), real)
    assert not found, f"mode {mode}, {compute}: {found}"


@needs_torch
@pytest.mark.parametrize("n", range(1, 33))
def test_torch_sum_order(n):
    """ATen's CPU sum (4-way ILP, 8-lane vectors, scalar tail first) for 1..32 values, the
    loss's B * K = 6 and 12 included, which no single-level order reproduces."""
    import torch
    from fpemu.steps.kernel import Kernel
    from fpemu.formats import FORMATS
    k = Kernel(SEMANTICS["torch_cpu"], FORMATS["fp32"])
    values = (np.random.default_rng(n).standard_normal((50, n)) * 2.0 ** np.arange(-20, 20, 40 / n)[:n])
    for row in values.astype(np.float32):
        squares = row * row
        assert bits(k.sum_of_squares(row, rows=1, inner=1)) == bits(torch.from_numpy(squares).sum().numpy())


# --- model-driven traces ------------------------------------------------------------------------

def test_fp16_gradients_underflow_without_loss_scaling():
    unscaled = train_trace("mlp", compute="fp16", profile="static", steps=10, target_scale=1e-4)
    scaled = train_trace("mlp", compute="fp16", profile="torch", steps=10, target_scale=1e-4)
    assert unscaled.scales == [1.0] * 10 and scaled.scales[0] == 65536.0
    assert np.all(unscaled.shares("underflow") > 0.6) and np.all(unscaled.shares("subnormal") > 0.2)
    assert scaled.shares("underflow").max() < 0.01 and np.all(scaled.shares("overflow") == 0)
    assert scaled.skipped_updates == 0 and scaled.losses[-1] < scaled.losses[0]


def test_bf16_needs_no_loss_scaling():
    trace = train_trace("mlp", compute="bf16", profile="static", steps=10, target_scale=1e-4)
    assert np.all(trace.shares("underflow") == 0) and np.all(trace.shares("subnormal") == 0)
    assert trace.completed_updates == 10 and trace.losses[-1] < trace.losses[0]


def test_scale_settles_below_overflow():
    trace = train_trace("mlp", compute="fp16", profile="torch", steps=120, target_scale=1e-4,
                        scaler_params=dict(init_scale=2.0 ** 40, growth_interval=10))
    exponents = np.log2(trace.scales)
    first_good = trace.completed_updates and next(i for i, s in enumerate(trace.steps) if not s.skipped)
    assert trace.skipped[:first_good] == list(range(first_good)) and exponents[first_good] < 31
    assert np.all((exponents[first_good:] >= 27) & (exponents[first_good:] <= 31))
    later = np.array(trace.skipped[first_good:])
    assert len(later) >= 3 and np.all(np.diff(later) > 1)  # one overflow per growth, then it backs off
    assert np.nanmax(trace.shares("overflow")) > 0 and trace.attempts == 120
    assert trace.attempts == trace.completed_updates + trace.skipped_updates


def test_fp8_trace_and_linear_model():
    trace = train_trace("linear", compute="fp8_e5m2", profile="jmp", scaler_params=dict(loss_scale=2.0 ** 15),
                        steps=5, target_scale=1e-3)
    assert trace.attempts == 5 and trace.compute == "fp8_e5m2" and trace.profile == "jmp"
    assert trace.final_params[0][0].dtype == np.float32


def test_trace_bad_input():
    with pytest.raises(ValueError, match="model must be one of"):
        train_trace("cnn")
    with pytest.raises(ValueError, match="mode 'jax_cpu' has orders fitted"):
        train_trace(mode="jax_cpu")
    with pytest.raises(ValueError, match="steps must be at least 1"):
        train_trace(steps=0)


def test_docstring_examples():
    import doctest
    for module in (fpemu.steps.step, fpemu.steps.train):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0 and result.attempted > 0


@needs_torch
@pytest.mark.parametrize("mode,unscale", [("torch_cpu", "divide"), ("torch_cpu_grad_scaler", "reciprocal")])
@pytest.mark.parametrize("w,x,y", [
    # x.T @ ct: an underflowing product keeps its sign (fused accumulation from +0)
    ([[-0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], [[7.6293945e-06, 7.6293945e-06]], [[1.83671e-40] * 3]),
    # x @ w: two products of +-2^128 are rounded to +-inf before the sum: NaN, not inf
    ([[-2.0**124], [2.0**124]], [[16.0, 16.0]], [[0.0]]),
    # exact zeros: the matmuls start from +0
    ([[-0.0, -0.0], [-0.0, -0.0]], [[0.0, 0.0]], [[1.0, 1.0]]),
    ([[-0.0]], [[0.0]], [[0.0]]),
    # B == 1 into a vector (K == 1): the underflowing products are rounded, then added to +0
    ([[-0.0], [-0.0]], [[1e-30, 1e-30]], [[1e-20]]),
])
def test_torch_matmul_edges(mode, unscale, w, x, y):
    from fpemu.adapters.torch_step import torch_step
    w = np.array(w, np.float32)
    case = dict(params={"w": w, "b": np.zeros(w.shape[1], np.float32)}, x=np.array(x, np.float32),
                y=np.array(y, np.float32), loss_scale=1.0, good_steps=0, lr=1.0, growth_interval=1)
    assert not differences(mixed_precision_step(**case, mode=mode), torch_step(**case, unscale=unscale))


@needs_torch
@pytest.mark.parametrize("shape", [(2, 3, 2), (3, 1, 2)])
def test_bit_exact_with_torch_compile(shape):
    """torch.compile (inductor, CPU) of the step (5-15 s to compile each shape): the
    torch_cpu_compiled preset.  2x3x2 takes ATen's addmm/mm path (fused addmm bias, butterfly
    loss sum, float32 bias gradient); 3x1x2 the decomposed one (D == 1: a float32 outer
    product with x, w, b unrounded, the loss summed column by column in the vector lanes)."""
    import torch
    from fpemu.adapters.torch_step import torch_step
    torch._dynamo.reset()
    batch, dim, out = shape
    rng = np.random.default_rng(2024 + sum(shape))
    edges = np.array([0.0, -0.0, 1.0, -3.0, 2.0 ** 100, -2.0 ** 120, 2.0 ** -100, -2.0 ** -130], np.float32)

    def draw(*dims):
        normal = (rng.standard_normal(dims) * np.exp2(rng.uniform(-30, 30, dims))).astype(np.float32)
        return np.where(rng.random(dims) < 0.25, rng.choice(edges, dims), normal).astype(np.float32)

    for _ in range(30):
        case = dict(params={"w": draw(dim, out), "b": draw(out)}, x=draw(batch, dim), y=draw(batch, out),
                    loss_scale=float(2.0 ** rng.integers(-10, 100)), good_steps=0, lr=0.01, growth_interval=2)
        emulated, real = mixed_precision_step(**case, mode="torch_cpu_compiled"), torch_step(**case, compiled=True)
        for a, b in [(emulated["loss"], real["loss"]), (emulated["params"]["w"], real["params"]["w"]),
                     (emulated["params"]["b"], real["params"]["b"]), (emulated["loss_scale"], real["loss_scale"])]:
            a, b = np.asarray(a, np.float32).reshape(-1), np.asarray(b, np.float32).reshape(-1)
            assert np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))), (case, a, b)
        assert emulated["grads_finite"] == real["grads_finite"]


def test_torch_compiled_preset_scope():
    """Every B, D, K in 1..4 is modelled (benchmarks/torch_compile_diff.py --all); larger shapes raise."""
    out = mixed_precision_step(**SEED_EXAMPLES[0][0], mode="torch_cpu_compiled")  # 2x2x1
    assert out["grads_finite"] and out["params"]["w"].shape == (2, 1)
    with pytest.raises(ValueError, match="torch_cpu_compiled.*fitted for dimensions 1..4, got B=5"):
        mixed_precision_step({"w": np.ones((1, 1)), "b": np.ones(1)}, np.ones((5, 1)), np.ones((5, 1)), 1.0, 0, 0.1, 1,
                             mode="torch_cpu_compiled")
    with pytest.raises(ValueError, match="inductor_decompositions needs reduce='inductor_cpu'"):
        StepSemantics("mine", inductor_decompositions=True)
