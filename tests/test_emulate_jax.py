"""fpemu.emulate_jax against jax.jit (jax 0.10.2, XLA:CPU, default flags): one-primitive programs bit for
bit in bf16 and fp16, nested jaxprs and gradients, the built-in step against mixed_precision_step, the
telemetry of a flax model, refusals; each on both paths, the interpreter and the compiled program
(compiled=None, which must have been taken wherever compile_refusal allows).  benchmarks/jax_emulate_ops.py
measures the rest (reports/emulate_jax_ops.md).
"""

import os

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from fpemu.emulate import Telemetry, emulate_torch  # noqa: E402
from fpemu.emulate import emulate_jax as _emulate_jax  # noqa: E402
from fpemu.emulate._jax_compiled import compile_refusal  # noqa: E402
from fpemu.emulate._jax_interpreter import parse_name_stack, primitive_table  # noqa: E402
from fpemu.errors import FpemuInputError  # noqa: E402

from jax_op_cases import COMPOSITE, EXCESS, SINGLE, inputs  # noqa: E402
from trace_checks import same_floats  # noqa: E402

# One-primitive programs where XLA:CPU computes otherwise than the interpreter (measured in
# reports/emulate_jax_ops.md): JAX lowers cumsum to a reduce_window adding in the low dtype; XLA's
# float16 expm1 is a kernel of its own.  (integer_pow and logistic agree: the interpreter computes them as JAX
# lowers and XLA expands them, a chain of rounded low-precision ops.)
XLA_COMPUTES_OTHERWISE = {"float16": {"expm1", "cumsum over rows"}, "bfloat16": {"cumsum over rows"}}
# Under the default semantics (reduce="xla_cpu") a low-precision reduce_sum is XLA's own reducer, so
# comparing it with jit would prove nothing; the report measures fpemu's rounded-once sum against it.
XLA_KERNEL_HERE = {"reduce_sum over rows"}


# Both paths in stage 2 (FPEMU_TEST_ENVS=1: XLA compiles each program); the default suite runs the interpreter here
# and tests/test_emulate_jax_compiled.py the compiled path against it.
PATHS = ("interpreted", "compiled") if os.environ.get("FPEMU_TEST_ENVS") == "1" else ("interpreted",)
PATH = {"path": PATHS[0], "made": []}


@pytest.fixture(autouse=True, params=PATHS)
def path(request):
    """Every test on both paths: the interpreter (the reference) and the compiled program.  Every program here
    whose policy and semantics it takes (compile_refusal) must have run compiled, not fallen back."""
    PATH["path"], PATH["made"] = request.param, []
    yield request.param
    for emulation in PATH["made"]:
        if getattr(emulation, "last_path", None) is not None and compile_refusal(emulation.policy, emulation.semantics) is None:
            assert emulation.last_path == "compiled", emulation.refusals
    PATH["path"] = PATHS[0]


def emulate_jax(fn, *args, **kwargs):
    """emulate_jax on this test's path."""
    emulation = _emulate_jax(fn, *args, compiled=None if PATH["path"] == "compiled" else False, **kwargs)
    PATH["made"].append(emulation)
    return emulation


def _wide(value):
    return np.asarray(value).astype(np.float32)


FULL = os.environ.get("FPEMU_TEST_ENVS") == "1"  # every program of the table (stage 2); a sample by default
SAMPLE = ("add", "div", "exp", "logistic", "integer_pow 3", "dot_general (16, n/16) @ (n/16, 16)",
          "convert to float8_e4m3fn")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_primitive_programs_match_jit_bit_for_bit(dtype):
    checked = 0
    for name, (fn, arity) in SINGLE.items():
        if name in XLA_COMPUTES_OTHERWISE[dtype] | XLA_KERNEL_HERE or not (FULL or name in SAMPLE):
            continue
        args = inputs(jnp.dtype(dtype), arity, seed=len(name))
        expected, got = jax.jit(fn)(*args), emulate_jax(fn)(*args)
        assert got.dtype == expected.dtype, name
        assert same_floats(_wide(got), _wide(expected)), name
        checked += 1
    assert checked >= (21 if FULL else len(SAMPLE))


@pytest.mark.skipif(not FULL, reason="a check of the exception list: FPEMU_TEST_ENVS=1")
def test_excepted_programs_do_differ():
    """The exceptions above are real: each differs from jit somewhere (else it belongs in the checked set)."""
    for dtype, name in sorted((d, n) for d, names in XLA_COMPUTES_OTHERWISE.items() for n in names):
        fn, arity = SINGLE[name]
        args = inputs(jnp.dtype(dtype), arity, seed=len(name))
        assert not same_floats(_wide(emulate_jax(fn)(*args)), _wide(jax.jit(fn)(*args))), name


def _nested(x, y):
    """jit, scan, cond, while, custom_jvp (relu), custom_vjp, remat: every call primitive, in float16."""
    @jax.custom_vjp
    def triple(v):
        return v * 3

    triple.defvjp(lambda v: (v * 3, None), lambda _, g: (g * 3,))
    inner = jax.jit(lambda v: jnp.tanh(v) * y)
    h = jax.checkpoint(lambda v: jnp.exp(v * 0.1))(inner(x))
    carry, ys = jax.lax.scan(lambda c, v: (c * 0.5 + v, c - v), jnp.zeros_like(h[0]), h)
    z = jax.lax.cond(carry.sum() > 0, lambda v: v * 2, lambda v: v - 1, ys)
    # (reverse mode does not cross a while loop: it runs on a value without a tangent)
    z = z + jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 1.5), (0, jax.lax.stop_gradient(z)))[1]
    return (triple(jax.nn.relu(z)) * x).astype(jnp.float32).sum()


def test_nested_jaxprs_and_gradients_match_jit():
    from fpemu.adapters.jax_step import xla_cpu_tier
    if xla_cpu_tier() == "avx512fp16":
        # Reported from outside on a Sapphire Rapids CPU: jit 38720.168, the interpreter 38720.164.  There LLVM
        # contracts f16 multiply-adds inside a fusion (docs/steps.md, fp16_fma), which an interpreter running
        # one equation per XLA call does not see; not modelled, and not yet run on such a CPU here.
        pytest.skip("XLA's f16 FMA contraction on AVX512-FP16 is not modelled by the jaxpr interpreter")
    # The compiled program once summed the loss's 128 float32 products in another order than XLA's standalone reduce
    # (38720.164 against 38720.168 on an AVX2 host): XLA fused the rounding kernel into the reduce.  Each reduce
    # now runs in a conditional's branch (fpemu.emulate._jax_compiled._standalone), and this test on both paths
    # guards it.
    x, y = (v.reshape(8, 16) for v in inputs(jnp.float16, 2, seed=3, size=128))
    x, y = jnp.nan_to_num(x, posinf=1.0, neginf=-1.0), jnp.nan_to_num(y, posinf=1.0, neginf=-1.0)
    # value_and_grad runs the forward too; FULL adds the plain forward and a gradient over both arguments
    for fn in [jax.value_and_grad(_nested)] + ([_nested, jax.grad(_nested, argnums=(0, 1))] if FULL else []):
        expected, got = jax.jit(fn)(x, y), emulate_jax(fn)(x, y)
        for e, g in zip(jax.tree_util.tree_leaves(expected), jax.tree_util.tree_leaves(got)):
            assert same_floats(_wide(g), _wide(e))


def test_float32_divides_by_a_broadcast_divisor_as_xla_does():
    """XLA rewrites A / broadcast(B) into A * broadcast(1 / B) (and contracts that multiply with an add reading it):
    a float32 array over a runtime scalar or a (rows, 1) divisor, and optax Adam's bias corrections, match jit bit
    for bit; a same-shape divisor divides.  (The interpreter divided: 48,572 of 100,000 quotients over a scalar and
    19 of 4,096 Adam parameters differed from jit.)"""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 256)).astype(np.float32)
    rows = (np.abs(rng.standard_normal((64, 1))) + 0.5).astype(np.float32)
    runs = [(lambda a, b: a / b, (x, np.float32(0.0297))), (lambda a, b: a / b + a, (x, rows)),
            (lambda a, b: a / b, (x, x + 3))]
    optax = pytest.importorskip("optax")
    adam = optax.adam(3e-3)
    params, grads = {"w": x[0]}, {"w": x[1] * 1e-2}
    state = adam.update(grads, adam.init(params), params)[1]  # a count of 1: the corrections divide by 1 - b**2
    runs.append((lambda p, s, g: optax.apply_updates(p, adam.update(g, s, p)[0]), (params, state, grads)))
    for fn, args in runs:
        expected, got = (jax.tree_util.tree_leaves(f(*args)) for f in (jax.jit(fn), emulate_jax(fn)))
        for e, g in zip(expected, got):
            assert same_floats(_wide(g), _wide(e))


def test_convolutions_and_typed_prng_keys_match_jit():
    """conv_general_dilated (XLA's float32 convolution, rounded once) and its gradient; with FULL, a
    typed PRNG key (an extended dtype the interpreter passes through) feeding random bits bitcast to
    float16 (threefry's integer program: many small XLA calls)."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 3, 16)).astype(np.float16), rng.standard_normal((4, 3, 3)).astype(np.float16)
    conv = lambda v, k: jax.lax.conv_general_dilated(v, k, (1,), "SAME")  # noqa: E731
    kernel_grad = jax.grad(lambda k: conv(x, k).astype(jnp.float32).sum())
    noise = lambda key, v: v * jax.random.uniform(key, v.shape, dtype=jnp.float16)  # noqa: E731
    runs = [(conv, (x, w)), (kernel_grad, (w,))] + ([(noise, (jax.random.key(0), x))] if FULL else [])
    for fn, args in runs:
        assert same_floats(_wide(emulate_jax(fn)(*args)), _wide(jax.jit(fn)(*args)))


def _step_case(case):
    f32 = np.float32
    return ({"w": np.asarray(case["params"]["w"], f32), "b": np.asarray(case["params"]["b"], f32)},
            np.asarray(case["x"], f32), np.asarray(case["y"], f32), f32(case["loss_scale"]),
            np.int32(case["good_steps"]), f32(case["lr"]), np.int32(case["growth_interval"]))


STEP_RUNS = ([(c, m) for c in ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2") for m in ("jax_cpu_strict", "seed", "jax_cpu")]
             if FULL else [("bf16", "jax_cpu_strict"), ("bf16", "jax_cpu")])
# Under jax_cpu (default flags) the unrounded bias add feeds the float32 loss, whose square XLA contracts
# into its reduce as FMAs (kernel._xla_cpu_sum_of_squares); the interpreter squares, then runs XLA's
# reduce: the loss differs by 1 ulp in these edge cases (shape, case index), the parameters do not.
LOSS_SUMMED_OTHERWISE = {("bf16", "jax_cpu"): {((3, 1, 2), 7), ((1, 4, 2), 10)}}


@pytest.mark.parametrize("compute,mode", STEP_RUNS)
def test_builtin_step_jaxpr_reproduces_mixed_precision_step(compute, mode):
    """The jitted step's jaxpr, interpreted, against fpemu's model of the step in the same semantics
    (which reproduces jax.jit under strict flags: reports/jax_step.md)."""
    from fpemu.adapters.jax_step import _JAX_DTYPES, _jitted
    from fpemu.steps import mixed_precision_step
    from fpemu.steps.probes import edge_cases
    emulated = emulate_jax(_jitted(_JAX_DTYPES[compute]), semantics=mode)
    # (1, 4, 2)'s third case needs the update's FMA
    for shape in ((1, 1, 1), (2, 3, 4), (1, 4, 2), (4, 1, 4)) if FULL else ((1, 4, 2),):
        for index, case in enumerate(edge_cases(shape, 12 if FULL else 3, seed=0)):
            got, want = emulated(*_step_case(case)), mixed_precision_step(**case, compute=compute, mode=mode)
            # both paths sum these losses otherwise than jit, which fuses the square into the reduce (the compiled
            # program's reduce is XLA's reduce alone, as the interpreter's: fpemu.emulate._jax_compiled._standalone)
            summed_otherwise = (shape, index) in LOSS_SUMMED_OTHERWISE.get((compute, mode), ())
            for key in ("loss", "loss_scale", "good_steps", "grads_finite"):
                same = same_floats(np.asarray(got[key], np.float64), np.asarray(want[key], np.float64))
                assert same != (key == "loss" and summed_otherwise), (shape, index, key)
            for key in ("w", "b"):
                assert same_floats(got["params"][key], want["params"][key]), (shape, key)


@pytest.mark.parametrize("name", sorted(EXCESS) + ["gelu (erf)", "layer norm over rows"]
                         + (sorted(set(COMPOSITE) - {"gelu (erf)", "layer norm over rows"}) if FULL else []))
def test_excess_precision_matches_jit_under_default_flags(name):
    """semantics jax_cpu keeps in float32 what XLA's excess precision keeps (this process runs XLA's default
    flags); where it keeps something, jax_cpu_strict (every rounding) differs from jit."""
    fn, arity = {**COMPOSITE, **EXCESS}[name]
    args = inputs(jnp.bfloat16, arity, seed=len(name))
    expected = _wide(jax.jit(fn)(*args))
    assert same_floats(_wide(emulate_jax(fn, semantics="jax_cpu")(*args)), expected), name
    keeps = name in EXCESS and "reshaped" not in name or name in ("gelu (erf)", "layer norm over rows")
    assert same_floats(_wide(emulate_jax(fn)(*args)), expected) != keeps, name


def test_excess_precision_counts_only_the_roundings_made():
    """gelu (erf): the multiply feeding erfc is read in float32 only, so it is neither rounded nor counted."""
    fn, _ = COMPOSITE["gelu (erf)"]
    x, = inputs(jnp.bfloat16, 1, seed=0)
    counts = {}
    for semantics in ("jax_cpu_strict", "jax_cpu"):
        telemetry = Telemetry()
        emulate_jax(fn, semantics=semantics, telemetry=telemetry)(x)
        counts[semantics] = telemetry.summary().by_op[("forward", "mul")][0]
    assert counts == {"jax_cpu_strict": 3 * x.size, "jax_cpu": 2 * x.size}
    recorded = primitive_table("jax_cpu")["semantics"]  # what a trace's op_table says was applied
    assert recorded["applied"]["excess_precision"] and "excess_precision" not in recorded["not_applied"]


def test_float32_multiply_add_is_contracted_as_xla_does():
    """XLA:CPU lets LLVM fuse a float32 multiply into the add that reads it (StepSemantics.fma)."""
    x, y, z = (np.random.default_rng(seed).standard_normal(1024).astype(np.float32) for seed in range(3))
    for fn in (lambda a, b, c: a * b + c, lambda a, b, c: c - a * b, lambda a, b, c: a * b - 0.3):
        expected = np.asarray(jax.jit(fn)(x, y, z))
        assert same_floats(np.asarray(emulate_jax(fn)(x, y, z)), expected)
        assert not same_floats(np.asarray(emulate_jax(fn, semantics="seed")(x, y, z)), expected)  # two roundings


def _flax_model():
    flax = pytest.importorskip("flax")
    nn = flax.linen

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8, dtype=jnp.float16, name="fc")(jax.nn.gelu(nn.Dense(8, dtype=jnp.float16)(x)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return Block(name="block")(x).astype(jnp.float32)

    return Model()


def test_flax_telemetry_names_modules_passes_and_the_first_overflow():
    model = _flax_model()
    x = jnp.ones((4, 8), jnp.float32) * 3
    params = model.init(jax.random.PRNGKey(0), x)

    def scaled_grads(p, scale):
        return jax.grad(lambda q: model.apply(q, x).sum() * scale)(p)

    telemetry = Telemetry()
    emulated = emulate_jax(scaled_grads, telemetry=telemetry)
    emulated(params, jnp.float32(1.0))
    clean = telemetry.summary()
    modules = {module for _, module in clean.by_module}
    assert {"Model/block/fc", "Model/block/Dense_0", "Model/block"} <= modules
    assert {direction for direction, _ in clean.by_op} == {"forward", "backward"}
    assert not clean.first_nonfinite
    # fp16 matmuls both ways, the tanh of gelu; the loss's float32 tail (the cast up, the sum, the scale) listed
    assert {("forward", "dot_general"), ("backward", "dot_general"), ("forward", "tanh")} <= set(clean.by_op)
    assert clean.by_op[("forward", "dot_general")][0] == 2 * 4 * 8  # two Dense layers of 4 x 8 outputs
    assert clean.float32_ops == ("convert_element_type", "mul", "reduce_sum")
    emulated(params, jnp.float32(2.0 ** 16))  # fp16 cotangents beyond 65504
    event = telemetry.summary().first_nonfinite["backward"]
    # the scaled cotangent overflows where the program casts it back to float16, at the model's output
    assert (event.op, event.module, event.produced) == ("convert_element_type", "Model", "overflow")
    assert telemetry.summary().totals("backward")[3] > 0


def test_policy_modes_apply_to_every_rounding():
    fn = lambda a, b: a * b  # noqa: E731
    a = jnp.full(4, 1.0 + 3 * 2 ** -10, jnp.float16)  # a * a = 1 + 6 * 2^-10 + 9 * 2^-20
    nearest, up = emulate_jax(fn)(a, a), emulate_jax(fn, rounding="up")(a, a)
    assert float(nearest[0]) == 1.0 + 6 * 2 ** -10 and float(up[0]) == 1.0 + 7 * 2 ** -10
    # XLA's own float16 scatter-add rounds to nearest; under another rounding it runs in float32, rounded once
    scatter = lambda e, i: e.at[i].add(e[:2] * 2 ** -11)  # noqa: E731
    base, rows = jnp.ones(4, jnp.float16), jnp.array([0, 0])
    assert float(emulate_jax(scatter)(base, rows)[0]) == 1.0  # each add of 2^-11 ties to even: stays 1
    assert float(emulate_jax(scatter, rounding="up")(base, rows)[0]) == 1.0 + 2 ** -10  # 1 + 2^-10 exactly
    telemetry = Telemetry()
    tiny = jnp.full(4, 2.0 ** -12, jnp.float16)
    flushed = emulate_jax(fn, subnormals=False, telemetry=telemetry)(tiny, tiny)
    assert float(jnp.abs(flushed).max()) == 0.0
    assert telemetry.summary().by_op[("forward", "mul")][1] == 4  # all four underflowed


def test_name_stack_reading():
    assert parse_name_stack("transpose(jvp(Model))/block/fc") == ("backward", "Model/block/fc")
    assert parse_name_stack("jvp()") == ("forward", "<root>")
    assert parse_name_stack("transpose(jvp())/rematted_computation") == ("backward", "<root>")
    assert parse_name_stack("jvp(M)/attn/...qhd,...khd->...hqk") == ("forward", "M/attn")


def test_refusals_name_what_is_wrong():
    from jax.extend.core import Primitive
    mystery = Primitive("mystery_op")
    mystery.def_impl(lambda v: v)
    mystery.def_abstract_eval(lambda v: v)
    with pytest.raises(FpemuInputError, match="mystery_op"):
        emulate_jax(lambda v: mystery.bind(v * 2))(jnp.ones(3, jnp.bfloat16))
    with pytest.raises(FpemuInputError, match="placement autocast is not one jax emulates"):
        emulate_jax(lambda v: v, "cuda_autocast_fp16")
    with pytest.raises(FpemuInputError, match="dot order 'torch_cpu'"):
        emulate_jax(lambda v: v, semantics="torch_cpu")
    pytest.importorskip("torch")
    with pytest.raises(FpemuInputError, match="placement program is not one torch emulates"):
        with emulate_torch("program"):
            pass
