"""The compiled JAX emulator (fpemu.emulate._jax_compiled, opt-in) against the interpreter, its reference
(jax 0.10.2, XLA:CPU): random programs, loops and branches whose first inf/NaN comes late, outputs and
telemetry bit for bit; what it refuses and where it falls back.  tests/test_emulate_jax.py runs every
emulate_jax test on both paths.
"""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from fpemu.emulate import Telemetry, emulate_jax  # noqa: E402
from fpemu.errors import FpemuInputError  # noqa: E402

from trace_checks import same_floats  # noqa: E402


def _both(fn, args, **kwargs):
    """(outputs, telemetry summary) of fn on each path; the compiled one must have run compiled."""
    results = []
    for compiled in (False, True):
        telemetry = Telemetry()
        emulation = emulate_jax(fn, compiled=compiled, telemetry=telemetry, **kwargs)
        outs = jax.tree_util.tree_leaves(emulation(*args))
        results.append(([np.asarray(o).astype(np.float32) for o in outs], telemetry.summary()))
    return results


def _assert_same(fn, args, **kwargs):
    (reference, expected), (outs, got) = _both(fn, args, **kwargs)
    assert len(outs) == len(reference)
    for a, b in zip(outs, reference):
        assert same_floats(a, b)
    assert got == expected, (got.by_op, expected.by_op, got.first_nonfinite, expected.first_nonfinite)
    return got


UNARY = [jnp.exp, jnp.tanh, jax.nn.sigmoid, jax.nn.gelu, lambda v: v * v, lambda v: v ** 3, jnp.negative,
         lambda v: jnp.sqrt(jnp.abs(v)), lambda v: v * 0.1, lambda v: jnp.maximum(v, 0)]
BINARY = [jnp.add, jnp.subtract, jnp.multiply, lambda a, b: a / (jnp.abs(b) + 1), lambda a, b: a * b + a,
          lambda a, b: jnp.where(a > b, a, b * 2)]


def _random_program(seed: int, dtype):
    """A chain of 8 random ops on two (16, 16) values of ``dtype``: unary, binary, a matmul, a row sum, a
    convert through float32 and back (deterministic: the seed picks them)."""
    rng = np.random.default_rng(seed)
    plan = [(rng.integers(5), int(rng.integers(100))) for _ in range(8)]

    def program(a, b):
        for kind, pick in plan:
            if kind == 0:
                a = UNARY[pick % len(UNARY)](a)
            elif kind == 1:
                a, b = BINARY[pick % len(BINARY)](a, b), a
            elif kind == 2:
                a = (a @ b) * dtype(0.25)
            elif kind == 3:
                a = a + a.sum(axis=-1, keepdims=True).astype(dtype)
            else:
                a = (a.astype(jnp.float32) * 3.0).astype(dtype)
        return a, b
    return program


# By default one bf16 program under strict XLA and one fp16 program under XLA's default; each is compiled
# twice (a few seconds), so the other ten run in stage 2.
DEFAULT_PROGRAMS = {("jax_cpu_strict", 0), ("jax_cpu", 5)}


@pytest.mark.parametrize("semantics,seed", [
    pytest.param(semantics, seed, id=f"{semantics}-{seed}", marks=() if (semantics, seed) in DEFAULT_PROGRAMS else
                 pytest.mark.stage2("random programs jax_cpu_strict-0 (bf16) and jax_cpu-5 (fp16)"))
    for semantics in ("jax_cpu_strict", "jax_cpu") for seed in range(6)])
def test_random_programs_match_the_interpreter(semantics, seed):
    dtype = (jnp.bfloat16, jnp.float16)[seed % 2]
    rng = np.random.default_rng(100 + seed)
    args = [jnp.asarray(rng.standard_normal((16, 16)) * 4, dtype) for _ in range(2)]
    _assert_same(_random_program(seed, dtype), args, semantics=semantics)


def test_late_overflow_in_a_loop_is_the_first_nonfinite_as_interpreted():
    """A scan whose first site (a multiply) overflows on its last step and whose second (a convert) from step 1
    on: the first non-finite result is the convert's, as the interpreter meets it (not the first site's); a cond
    branch and a while loop after it."""
    def program(x):
        def body(c, v):
            grown = c * v                                              # 45000 * 300 on step 4
            early = (v.astype(jnp.float32) * 7e4).astype(jnp.float16)  # 70000 from step 1 on
            return grown, early
        carry, ys = jax.lax.scan(body, jnp.ones(4, jnp.float16), x)
        branch = jax.lax.cond(carry.sum() > 0, lambda v: v * 2, lambda v: v - 1, ys)
        looped = jax.lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * jnp.float16(100)),
                                    (0, branch[0]))[1]
        return looped.astype(jnp.float32).sum()
    x = jnp.asarray(np.array([[0.5] * 4, [1.0] * 4, [300.0] * 4, [300.0] * 4, [300.0] * 4]), jnp.float16)
    summary = _assert_same(program, [x])
    event = summary.first_nonfinite["forward"]
    assert (event.op, event.produced) == ("convert_element_type", "overflow")
    assert summary.by_op[("forward", "mul")][3] >= 4  # the scan's last step


def test_the_scan_and_while_run_no_times():
    def program(x):
        _, ys = jax.lax.scan(lambda c, v: (c, (v * 3).astype(jnp.bfloat16)), jnp.zeros(()), x[:0])
        return jax.lax.while_loop(lambda s: s[0] < 0, lambda s: (s[0] + 1, s[1] * 2), (0, x))[1], ys
    _assert_same(program, [jnp.ones(4, jnp.bfloat16)])


@pytest.mark.parametrize("seed", range(4))
def test_a_sum_of_rounded_values_is_xlas_standalone_reduce(seed):
    """Low-precision products summed in float32 and in their own dtype, as the interpreter sums them (XLA's reduce
    alone): fused with the rounding kernel, XLA:CPU summed 41 of 60 such 8x16 operands in another order."""
    rng = np.random.default_rng(seed)
    x, y = (jnp.asarray((rng.standard_normal((8, 16)) * 10.0 ** rng.uniform(-2, 2, (8, 16))).astype(np.float16))
            for _ in range(2))
    _assert_same(lambda a, b: ((a * b).astype(jnp.float32).sum(), (a * b).sum(axis=1), (a * b)[:0].sum()), [x, y])


def test_refusals_and_fallback_name_why():
    fn = lambda v: v * 3  # noqa: E731
    x = jnp.ones(4, jnp.bfloat16)
    with pytest.raises(FpemuInputError, match="compiled=True.*semantics seed: flush_subnormals=False"):
        emulate_jax(fn, semantics="seed", compiled=True)
    with pytest.raises(FpemuInputError, match="stochastic rounding"):
        emulate_jax(fn, rounding="stochastic", compiled=True)
    with pytest.raises(FpemuInputError, match="compiled must be None, True or False"):
        emulate_jax(fn, compiled="yes")
    fallback = emulate_jax(fn, rounding="stochastic", compiled=None)
    fallback(x)
    assert fallback.last_path == "interpreted"
    # a low-precision reduce_sum under a rounding XLA's reducer does not make: the interpreter's float64 sum
    row_sum = lambda v: jax.lax.reduce_sum_p.bind(v, axes=(0,), out_sharding=None)  # noqa: E731
    with pytest.raises(FpemuInputError, match="cannot compile this program: a low-precision reduce_sum"):
        emulate_jax(row_sum, rounding="up", compiled=True)(x)
    chosen = emulate_jax(row_sum, rounding="up", compiled=None)
    assert float(chosen(x)) == 4.0 and chosen.last_path == "interpreted"
    compiled = emulate_jax(fn, compiled=None)
    compiled(x)
    assert compiled.last_path == "compiled"


def test_policy_modes_and_saturation_compile():
    a = jnp.asarray(np.linspace(-65504, 65504, 64), jnp.float16)
    for overrides in ({"rounding": "up"}, {"rounding": "toward_zero", "subnormals": False}, {"overflow": "saturate"}):
        _assert_same(lambda v: (v.astype(jnp.float32) * 1.5).astype(jnp.float16) * v, [a], **overrides)
