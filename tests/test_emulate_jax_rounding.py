"""fpemu's rounding kernel in jax integer ops (fpemu.emulate._jax_rounding) against the numpy kernel
(fpemu.quantize) bit for bit, under jax.jit on XLA:CPU (jax 0.10.2): every named format it takes, every
rounding mode (stochastic from the draws quantize consumes), both overflow modes, subnormals kept and
flushed, on an edge-dense sample of float32 bit patterns; custom formats against the rational oracle.
FPEMU_TEST_EXHAUSTIVE=1: all 2**32 float32 inputs for fp16, bf16 and the fp8 formats.
"""

import os
import time
from fractions import Fraction

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from fpemu.emulate._jax_rounding import round_to_format_jax, stochastic_draws, supported  # noqa: E402
from fpemu.formats import FORMATS, ROUNDING_MODES, make_format, quantize  # noqa: E402

from oracle import round_exact  # noqa: E402

SEED = 11


def _edge_bits() -> np.ndarray:
    """Every float32 exponent field with the mantissas that sit at each possible rounding position (all
    ones below bit k, bit k alone, bit k plus one, their complements), both signs, and 4096 random
    patterns: every binade of every format's range, its subnormals, the ties and the carries."""
    mantissas = sorted({m for k in range(24) for m in ((1 << k) - 1, 1 << k, (1 << k) + 1,
                                                        ((1 << k) - 1) ^ 0x7FFFFF, (1 << k) ^ 0x7FFFFF)
                        if 0 <= m < 1 << 23})
    exponents = np.arange(256, dtype=np.uint32) << np.uint32(23)
    bits = (exponents[:, None] | np.array(mantissas, np.uint32)[None, :]).ravel()
    random = np.random.default_rng(0).integers(0, 1 << 32, 4096, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([bits, bits | np.uint32(0x80000000), random])


EDGES = _edge_bits().view(np.float32)
# Per format: every mode with IEEE overflow and subnormals, and saturation with flushing.
SETTINGS = [(mode, "inf", True) for mode in ROUNDING_MODES] + [(mode, "saturate", False) for mode in ROUNDING_MODES]


def _same(got, want) -> np.ndarray:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def _jax_round(x, fmt, rounding, overflow, subnormals, seed=SEED):
    draws = stochastic_draws(seed, x.shape, fmt, overflow=overflow, subnormals=subnormals) \
        if rounding == "stochastic" else {}
    run = jax.jit(lambda v, d: round_to_format_jax(v, fmt, rounding=rounding, overflow=overflow,
                                                   subnormals=subnormals, **d))
    return np.asarray(run(x, draws))


def _quantize(x, fmt, rounding, overflow, subnormals, seed=SEED):
    return quantize(x, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals,
                    seed=seed if rounding == "stochastic" else None)


def _by_default(names, covered_by):
    """Each format compiles a program per setting (about 2 s a format): ``names`` run by default, the
    rest in stage 2; the default ones span IEEE inf/NaN, fn, fnuz and sub-byte encodings."""
    def param(name):
        return pytest.param(name, id=name, marks=() if name in names else pytest.mark.stage2(covered_by))
    return param


DEFAULT_NAMED = ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2fnuz", "fp4_e2m1fn")
named = _by_default(DEFAULT_NAMED, "named formats " + ", ".join(DEFAULT_NAMED))


@pytest.mark.parametrize("name", [named(name) for name, fmt in FORMATS.items() if supported(fmt)])
def test_named_formats_round_as_the_numpy_kernel(name):
    fmt = FORMATS[name]
    for rounding, overflow, subnormals in SETTINGS:
        got = _jax_round(EDGES, fmt, rounding, overflow, subnormals)
        want = _quantize(EDGES, fmt, rounding, overflow, subnormals)
        same = _same(got, want)
        assert same.all(), (name, rounding, overflow, subnormals,
                            [hex(b) for b in EDGES[~same][:4].view(np.uint32)])


@pytest.mark.parametrize("name", [_by_default(("bf16", "fp8_e4m3fnuz"), "bf16 and fp8_e4m3fnuz")(name)
                                  for name in ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz")])
def test_remaining_settings_on_the_formats_jax_programs_hold(name):
    """Saturation with subnormals and IEEE overflow with flushing, for the dtypes a jaxpr carries."""
    for rounding in ROUNDING_MODES:
        for overflow, subnormals in (("saturate", True), ("inf", False)):
            same = _same(_jax_round(EDGES, FORMATS[name], rounding, overflow, subnormals),
                         _quantize(EDGES, FORMATS[name], rounding, overflow, subnormals))
            assert same.all(), (name, rounding, overflow, subnormals)


CUSTOM = [make_format(exponent_bits=3, mantissa_bits=2), make_format(exponent_bits=6, mantissa_bits=9),
          make_format(exponent_bits=5, mantissa_bits=6, special="fn"),
          make_format(exponent_bits=2, mantissa_bits=5, special="fnuz"),
          make_format(exponent_bits=4, mantissa_bits=1, special="finite"),
          make_format(exponent_bits=5, mantissa_bits=1, special="fnu")]


DEFAULT_CUSTOM = ("e3m2", "e5m6fn", "e2m5fnuz")


@pytest.mark.parametrize("fmt", [pytest.param(fmt, id=fmt.name, marks=() if fmt.name in DEFAULT_CUSTOM else
                                              pytest.mark.stage2("custom formats " + ", ".join(DEFAULT_CUSTOM)))
                                 for fmt in CUSTOM])
def test_custom_formats_match_the_rational_oracle(fmt):
    """Against the exact oracle, independent of both kernels: a sample of the edges (the oracle is
    Python per element), every deterministic mode; stochastic with the draws made explicit."""
    x = EDGES[::23]
    draws = stochastic_draws(SEED, x.shape, fmt)["draws"]
    for rounding in ROUNDING_MODES:
        got = _jax_round(x, fmt, rounding, "inf", True)
        if rounding == "stochastic":
            want = [round_exact(float(v), fmt, rounding, u=Fraction(int(d), 1 << 32), resolution=32)
                    for v, d in zip(x, draws)]
        else:
            want = [round_exact(float(v), fmt, rounding) for v in x]
        same = _same(got, np.array(want, np.float64).astype(np.float32))
        assert same.all(), (fmt.name, rounding, [hex(b) for b in x[~same][:4].view(np.uint32)])
        assert _same(got, _quantize(x, fmt, rounding, "inf", True)).all(), (fmt.name, rounding)


def test_stochastic_draws_follow_quantizes_stream():
    """The same seed, the same bits: a value halfway between two fp16 neighbours rounds up for about half the
    draws, element for element as quantize does; another seed gives other choices."""
    x = np.full(4096, 1 + 2.0 ** -11, np.float32)
    for name in ("fp16", "bf16"):
        got = _jax_round(x, FORMATS[name], "stochastic", "inf", True, seed=3)
        assert _same(got, quantize(x, name, rounding="stochastic", seed=3)).all(), name
    other = _jax_round(x, FORMATS["fp16"], "stochastic", "inf", True, seed=4)
    assert not _same(other, _jax_round(x, FORMATS["fp16"], "stochastic", "inf", True, seed=3)).all()
    assert 0.4 < float(np.mean(other > 1)) < 0.6


def test_bad_arguments_are_named():
    x = jnp.ones(3, jnp.float32)
    with pytest.raises(ValueError, match="format e8m0 .* float64"):
        round_to_format_jax(x, "e8m0")
    with pytest.raises(ValueError, match="needs draws"):
        round_to_format_jax(x, "fp16", rounding="stochastic")
    with pytest.raises(ValueError, match=r"draws must have x's shape \(3,\)"):
        round_to_format_jax(x, "fp16", rounding="stochastic", draws=np.zeros(4, np.uint32))
    with pytest.raises(ValueError, match="rounding must be one of"):
        round_to_format_jax(x, "fp16", rounding="odd")
    with pytest.raises(ValueError, match="x must be float32"):
        round_to_format_jax(jnp.ones(3, jnp.int32), "fp16")


EXHAUSTIVE_CHUNK = 1 << 24
EXHAUSTIVE = [("fp16", "nearest_even"), ("bf16", "nearest_even"), ("fp8_e4m3fn", "nearest_even"),
              ("fp8_e5m2", "nearest_even"), ("fp8_e4m3fnuz", "nearest_even"), ("fp8_e5m2fnuz", "nearest_even"),
              ("fp16", "toward_zero"), ("bf16", "stochastic"), ("fp8_e4m3fn", "stochastic")]


@pytest.mark.skipif(os.environ.get("FPEMU_TEST_EXHAUSTIVE") != "1", reason="all 2**32 inputs: FPEMU_TEST_EXHAUSTIVE=1")
@pytest.mark.parametrize("name, rounding", EXHAUSTIVE)
def test_every_float32_rounds_as_the_numpy_kernel(name, rounding, capsys):
    """All 2**32 float32 patterns in 256 chunks (stochastic: each chunk with its own seed, the chunk index)."""
    fmt = FORMATS[name]
    run = jax.jit(lambda v, d: round_to_format_jax(v, fmt, rounding=rounding, **d))
    began = time.perf_counter()
    for index, start in enumerate(range(0, 1 << 32, EXHAUSTIVE_CHUNK), 1):
        values = np.arange(start, start + EXHAUSTIVE_CHUNK, dtype=np.uint32).view(np.float32)
        seed = index if rounding == "stochastic" else None
        draws = stochastic_draws(seed, values.shape, fmt) if seed is not None else {}
        same = _same(run(values, draws), quantize(values, fmt, rounding=rounding, seed=seed))
        assert same.all(), (name, rounding, [hex(v) for v in values[~same][:5].view(np.uint32)])
        if index % 64 == 0:
            with capsys.disabled():
                print(f"\n{name} {rounding}: {index}/256 chunks, {time.perf_counter() - began:.0f} s", flush=True)
