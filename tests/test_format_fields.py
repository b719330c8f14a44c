"""Formats on orthogonal fields: e8m0, unsigned and zero-less formats, NaN-code policies, fp4 packing; every
quantize path against the rational oracle for every combination of the fields."""

import functools
import itertools
import json
import math
import pathlib
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis_budget import profile_examples

import fpemu
from fpemu import strategies as fst
from fpemu.formats import Format, pack_nibbles, round_to_format, unpack_nibbles
from fpemu.formats._shortcuts import paths
from fpemu.formats.format import past_max
from fpemu.formats.rounding import _SOURCES, _random_draws, _round_array, _round_bits, _rounds_in_float64
from format_digests import digests
from oracle import round_exact
from test_formats import ml_dtypes_e8m0_departs, same_bits

E8M0 = fpemu.get_format("e8m0")
# float32 bit patterns walking every sign, binade and low-bit pattern (2**20 of them)
SWEEP = (np.arange(1 << 20, dtype=np.uint64) * np.uint64(4093) + np.uint64(7)).astype(np.uint32).view(np.float32)


def test_the_rebuild_changed_no_result_of_any_existing_format():
    """Digests of every named format's decode/encode/quantize/round_to_format results (all codes,
    2**16 float32 patterns and float64 inputs, every mode), recorded before the rebuild."""
    golden = json.loads((pathlib.Path(__file__).parent / "data" / "format_digests.json").read_text())
    assert digests() == golden


def test_e8m0_fields_and_codes():
    assert (E8M0.signed, E8M0.has_inf, E8M0.nan_codes, E8M0.has_zero, E8M0.bits) == (False, False, 1, False, 8)
    assert E8M0.special == "fnu" and E8M0.dtype == np.dtype(ml_dtypes.float8_e8m0fnu)
    assert fpemu.decode([0x00, 0x7F, 0xFE], E8M0).tolist() == [2.0**-127, 1.0, 2.0**127]
    assert math.isnan(fpemu.decode(0xFF, E8M0))
    assert fpemu.encode([2.0**-127, 1.0, 2.0**127, math.nan], E8M0).tolist() == [0x00, 0x7F, 0xFE, 0xFF]


def test_e8m0_ties_go_up_as_ml_dtypes_and_torch():
    ties = np.array([1.5, 3.0, 0.75, 1.5 * 2.0**100], np.float32)
    assert fpemu.encode(ties, E8M0).tolist() == [0x80, 0x81, 0x7F, 0xE4]
    assert fpemu.encode(ties, E8M0).tolist() == ties.astype(ml_dtypes.float8_e8m0fnu).view(np.uint8).tolist()
    assert fpemu.encode(np.nextafter(ties, np.float32(0)), E8M0).tolist() == [0x7F, 0x80, 0x7E, 0xE3]


def test_e8m0_matches_ml_dtypes_over_a_large_float32_sweep():
    """0, negatives, inf and above (2 - 2**-1) * 2**127 become NaN in both; below 2**-127 both give
    code 0.  The one departure, before ml_dtypes 0.7.0: it sends the float32 subnormals just above
    2**-127 up."""
    with np.errstate(invalid="ignore", over="ignore"):
        native = SWEEP.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ours = fpemu.quantize(SWEEP, E8M0)
    departs = ml_dtypes_e8m0_departs(SWEEP)
    assert same_bits(ours[~departs], native[~departs])
    assert np.count_nonzero(np.isnan(ours)) > len(SWEEP) // 2  # the negatives


def test_torch_e8m0_cast_departs_on_zero_and_negatives():
    torch = pytest.importorskip("torch")
    x = np.array([0.0, -0.0, -1.0, -3.0, 1.5, 2.0**-130, 3e38], np.float32)
    torch_codes = torch.from_numpy(x).to(torch.float8_e8m0fnu).view(torch.uint8).numpy().tolist()
    assert torch_codes == [0x00, 0x00, 0x7F, 0x81, 0x80, 0x00, 0xFF]  # 0 -> 2**-127, x < 0 -> |x|
    assert fpemu.encode(x, E8M0).tolist() == [0xFF, 0xFF, 0xFF, 0xFF, 0x80, 0x00, 0xFF]
    assert fpemu.encode(np.abs(x[2:]), E8M0).tolist() == torch_codes[2:]


UNSIGNED = [
    Format("ue4m3", 4, 3, 7, signed=False, has_inf=False, nan_codes=1),           # e4m3fn without a sign
    Format("ue5m2", 5, 2, 15, signed=False),                                         # IEEE without a sign
    Format("ue3m2", 3, 2, 3, signed=False, has_inf=False, nan_codes=0),              # finite, no NaN
    Format("e4m2_nozero", 4, 2, 7, has_inf=False, nan_codes=1, has_zero=False),    # signed, no zero
]


@pytest.mark.parametrize("fmt", UNSIGNED, ids=str)
def test_sign_and_zero_less_formats_round_trip_every_code(fmt):
    codes = np.arange(1 << fmt.bits, dtype=np.uint64)
    values = fpemu.decode(codes, fmt)
    number = ~np.isnan(values)
    assert np.count_nonzero(~number) == fmt.nan_codes * (2 if fmt.signed else 1)
    assert np.array_equal(fpemu.encode(values[number], fmt).astype(np.uint64), codes[number])
    assert same_bits(fpemu.quantize(values, fmt), values)
    assert (values[number] >= 0).all() or fmt.signed
    assert (values[number] != 0).all() or fmt.has_zero


@settings(max_examples=profile_examples(4))
@given(fmt=st.sampled_from(UNSIGNED + [E8M0]), data=st.data(),
       rounding=st.sampled_from(["nearest_even", "nearest_away", "toward_zero", "up", "down"]),
       overflow=st.sampled_from(fpemu.OVERFLOW_MODES))
def test_sign_and_zero_less_formats_match_the_rational_oracle(fmt, data, rounding, overflow):
    arr = np.array(data.draw(st.lists(fst.probe_floats(fmt, np.float64), min_size=1, max_size=8)))
    got = round_to_format(arr, fmt, rounding, overflow).values
    expected = np.array([round_exact(float(v), fmt, rounding, overflow) for v in arr])
    assert same_bits(got, expected)


def test_nan_policies_for_formats_without_nan():
    x = np.array([1.0, math.nan, -math.nan], np.float32)
    with pytest.raises(ValueError, match="fp4_e2m1fn cannot encode: the format has no NaN code"):
        fpemu.encode(x, "fp4_e2m1fn")
    with pytest.raises(ValueError, match="cannot encode: nan='raise'"):
        fpemu.encode(x, "fp8_e4m3fn", nan="raise")
    assert fpemu.encode(x, "fp8_e4m3fn").tolist() == [0x38, 0x7F, 0x7F]            # its own NaN code
    assert fpemu.encode(x, "fp4_e2m1fn", nan=0x3).tolist() == [0x2, 0x3, 0xB]       # torchao's finite code
    assert fpemu.encode(x, "fp6_e2m3fn", nan=0xC).tolist() == [0x08, 0xC, 0x2C]
    with pytest.raises(ValueError, match="nan must be 'code', 'raise' or a code of the 4-bit format"):
        fpemu.encode(x, "fp4_e2m1fn", nan=16)


def test_torchao_gives_canonical_nan_the_finite_codes_the_policy_names():
    pytest.importorskip("torchao")
    import torch
    from torchao.prototype.mx_formats.kernels import (f32_to_f4_unpacked, f32_to_f6_e2m3_unpacked,
                                                      f32_to_f6_e3m2_unpacked)
    x = torch.tensor([1.0, math.nan, -math.nan])
    for cast, name, code in [(f32_to_f4_unpacked, "fp4_e2m1fn", 0x3), (f32_to_f6_e2m3_unpacked, "fp6_e2m3fn", 0xC),
                             (f32_to_f6_e3m2_unpacked, "fp6_e3m2fn", 0xE)]:
        assert cast(x).tolist() == fpemu.encode(x.numpy(), name, nan=code).tolist(), name


def test_pack_nibbles_matches_torchao_pack_uint4():
    pytest.importorskip("torchao")
    import torch
    from torchao.prototype.mx_formats.kernels import pack_uint4, unpack_uint4
    codes = np.random.default_rng(0).integers(0, 16, size=(3, 8), dtype=np.uint8)
    packed = pack_uint4(torch.from_numpy(codes)).numpy()
    assert np.array_equal(pack_nibbles(codes), packed)
    assert np.array_equal(unpack_nibbles(packed), codes)
    assert np.array_equal(unpack_uint4(torch.from_numpy(packed)).numpy(), codes)
    assert pack_nibbles([0x1, 0xA]).tolist() == [0xA1]  # the first code in the low nibble


@pytest.mark.parametrize("call,error,words", [
    (lambda: pack_nibbles([1, 2, 3]), ValueError, "last axis must have even length"),
    (lambda: pack_nibbles([1, 16]), ValueError, "codes must be 4-bit codes"),
    (lambda: pack_nibbles([1.0, 2.0]), TypeError, "codes must be an integer array"),
    (lambda: Format("x", 4, 3, 7, signed=False, nan_at_negative_zero=True), ValueError,
     "nan_at_negative_zero needs a sign bit and a zero"),
    (lambda: Format("x", 2, 1, 1, nan_codes=6), ValueError, "leaves no normal binade"),
    (lambda: Format("x", 4, 3, 7, signed="no"), TypeError, "signed must be True or False"),
    (lambda: Format("x", 4, 3, 7, nan_codes=-1), TypeError, "nan_codes must be a non-negative int"),
])
def test_bad_format_fields_and_packing_input_name_the_argument(call, error, words):
    with pytest.raises(error, match=words):
        call()


# Every combination of Format's fields on small layouts, every quantize path, every mode, against the
# rational oracle.  The bias picks the kernel for float32 inputs: the default keeps the format inside
# float32's range; +125 puts its least values on float32's subnormals; +140 puts it below them (float32
# inputs are rounded in float64); -126 puts max finite past float32's (the generic bit kernel); -130
# puts min normal past it (float64 again).
FIELD_LAYOUTS = {(1, 1): (0, 125, 140, -130), (1, 2): (0,), (2, 0): (0, -126), (2, 1): (0,)}
SIGN_AND_ZERO = [  # (signed, has_zero, nan_at_negative_zero)
    (True, True, False), (True, True, True), (True, False, False), (False, True, False), (False, False, False)]
STOCHASTIC_SEED = 5


def _field_formats() -> list:
    formats = []
    for (e, m), shifts in FIELD_LAYOUTS.items():
        for bias, (signed, has_zero, nan_at_negative_zero), has_inf, nan_codes in itertools.product(
                [(1 << (e - 1)) - 1 + shift for shift in shifts], SIGN_AND_ZERO, (False, True),
                sorted({0, 1, (1 << m) - 1, 1 << m, (1 << m) + 1})):
            try:
                fmt = Format(f"e{e}m{m}", e, m, bias, signed=signed, has_inf=has_inf, nan_codes=nan_codes,
                             nan_at_negative_zero=nan_at_negative_zero, has_zero=has_zero)
            except ValueError:  # no normal binade left
                continue
            formats.append(fmt)
    return formats


FIELD_FORMATS = _field_formats()


def _field_id(fmt) -> str:
    return f"e{fmt.exponent_bits}m{fmt.mantissa_bits}b{fmt.bias}-{fmt.special or 'no specials'}".replace(", ", "-")


def _field_probes(fmt, codes=None) -> tuple:
    """float64 inputs: NaN, then those float32 holds, then the rest (and how many come before the rest).

    Every value of fmt (of ``codes``, default all), the midpoints between neighbouring values and their
    float32 and float64 neighbours, past max finite (the midpoint above it, 2**(emax + 1), float32's
    largest, 1e300), below the least value, zeros and infinities, both signs."""
    with np.errstate(invalid="ignore"):
        values = fpemu.decode(np.arange(1 << fmt.bits, dtype=np.uint64) if codes is None else codes, fmt)
    grid = np.unique(np.abs(values[np.isfinite(values)]))
    above = past_max(fmt)  # the value the code after max finite's would have
    grid = np.append(grid, above)
    mids = (grid[:-1] + grid[1:]) / 2
    with np.errstate(over="ignore", under="ignore"):
        narrow = mids.astype(np.float32)
        near = np.concatenate([np.nextafter(narrow, np.float32(s)) for s in (-np.inf, np.inf)]).astype(np.float64)
    wide = np.concatenate([np.nextafter(mids, s) for s in (-np.inf, np.inf)])
    edges = [0.0, math.ldexp(grid[grid > 0][0], -2), 2.0**-149, 1e-300, 2 * above,
             float(np.finfo(np.float32).max), 1e300, math.inf]
    magnitudes = np.unique(np.concatenate([grid, mids, near, wide, edges]))
    probes = np.concatenate([magnitudes, -magnitudes])
    with np.errstate(over="ignore"):
        in_float32 = probes.astype(np.float32).astype(np.float64) == probes
    held = 1 + int(np.count_nonzero(in_float32))
    return np.concatenate([[math.nan], probes[in_float32], probes[~in_float32]]), held


def _oracle(fmt, probes: np.ndarray, rounding: str, overflow: str, subnormals: bool, draws: str = "kernel"):
    """The rational oracle's results; stochastic rounding takes the draws fpemu makes for an array of
    probes' length with STOCHASTIC_SEED: the kernel's 32 bits per element, or (``draws="bf16"``) the
    float32 -> bf16 path's 16, which it adds below bf16's last bit (up when r >= 2**16 - the dropped
    bits, so u = (2**16 - 1 - r) / 2**16)."""
    if rounding != "stochastic":
        return np.array([round_exact(float(x), fmt, rounding, overflow, subnormals) for x in probes])
    if draws == "bf16":
        raw = np.random.SFC64(STOCHASTIC_SEED).random_raw((probes.size + 3) // 4).view(np.uint16)[:probes.size]
        us = [Fraction(0xFFFF - int(r), 1 << 16) for r in raw]
    else:
        us = [Fraction(int(d), 1 << 32) for d in _random_draws(probes.size, STOCHASTIC_SEED)]
    return np.array([round_exact(float(x), fmt, rounding, overflow, subnormals, u=u, resolution=32)
                     for x, u in zip(probes, us)])


def _quantize_paths(fmt, rounding: str, subnormals: bool, dtype) -> list:
    """(name, run(x, overflow)) for every path that rounds x of dtype onto fmt in this mode."""
    seed = STOCHASTIC_SEED if rounding == "stochastic" else None
    found = [
        ("quantize", lambda x, ov: fpemu.quantize(x, fmt, rounding=rounding, overflow=ov, subnormals=subnormals,
                                                  seed=seed)),
        ("round_to_format", lambda x, ov: round_to_format(x, fmt, rounding, ov, subnormals, seed).values),
    ]
    short = paths(fmt, rounding, subnormals) if dtype == np.float32 else []
    if short or fmt.dtype is not None:  # quantize takes another path first: the kernel it would take without
        found.append(("kernel",
                      lambda x, ov: _round_array(x, fmt, rounding, ov, subnormals, seed, flags=False).values))
    source = _SOURCES[np.dtype(dtype)]
    if fmt.signed and fmt.has_zero and not (dtype == np.float32 and _rounds_in_float64(fmt)):  # its domain
        def bits(x, ov):
            # (its caller makes formats with neither inf nor NaN saturate)
            ov = ov if fmt.has_inf or fmt.has_nan else "saturate"
            draws = _random_draws(x.size, seed) if seed is not None else None
            return _round_bits(x, fmt, source, rounding, ov, subnormals, draws).values
        found.append(("bit kernel", bits))
    found += [(path.run.__name__, functools.partial(lambda run, x, ov: run(x, fmt, ov, subnormals), path.run))
              for path in short]
    return found


def _sweep(fmt, probes: np.ndarray, held: int) -> list:
    """Each path on the probes as float64 and, those float32 holds, as float32, every mode; bits compared,
    NaN equal to NaN.  quantize's paths also without the NaN: a block without NaN takes the fast
    kernel's bulk overflow fixes (round_to_format and the bit kernel treat every element alike)."""
    mismatches = []
    with np.errstate(all="ignore"):
        for rounding, overflow, subnormals in itertools.product(fpemu.ROUNDING_MODES, fpemu.OVERFLOW_MODES,
                                                                (True, False)):
            expected = {"kernel": _oracle(fmt, probes, rounding, overflow, subnormals)}
            if rounding == "stochastic" and subnormals:  # (the draws go by position)
                expected["kernel", "clean"] = _oracle(fmt, probes[1:], rounding, overflow, subnormals)
            for dtype, clean in itertools.product((np.float64, np.float32), (False, True)):
                x = probes[int(clean):held if dtype == np.float32 else probes.size].astype(dtype)
                for name, run in _quantize_paths(fmt, rounding, subnormals, dtype):
                    if clean and (name in ("round_to_format", "bit kernel") or not subnormals):
                        continue  # (the bulk overflow fixes come after the flush)
                    draws = "bf16" if name == "quantize" and _takes_stochastic_bf16(fmt, rounding, overflow,
                                                                                    subnormals, dtype) else "kernel"
                    want = _expected(expected, fmt, probes, draws, clean, rounding, overflow, subnormals)
                    want = want[:x.size].astype(dtype)
                    got = run(x, overflow)
                    wrong = ~((got.view(f"u{got.itemsize}") == want.view(f"u{got.itemsize}"))
                              | (np.isnan(got) & np.isnan(want)))
                    if wrong.any():
                        mismatches.append((name, np.dtype(dtype).name, x.size, rounding, overflow, subnormals,
                                           int(wrong.sum()), x[wrong][:3].tolist(), got[wrong][:3].tolist(),
                                           want[wrong][:3].tolist()))
    return mismatches


def _takes_stochastic_bf16(fmt, rounding, overflow, subnormals, dtype) -> bool:
    """Whether quantize takes its float32 -> bf16 stochastic path (16 random bits of its own stream)."""
    return (fmt.dtype == np.dtype(ml_dtypes.bfloat16) and rounding == "stochastic" and overflow == "inf"
            and subnormals and dtype == np.float32)


def _expected(cache: dict, fmt, probes, draws: str, clean: bool, rounding, overflow, subnormals) -> np.ndarray:
    """The oracle's results for the probes (without the leading NaN where clean) and that stream of draws."""
    key = (draws, "clean") if clean else draws
    if key not in cache:
        if rounding != "stochastic" or (clean and not subnormals):
            return cache["kernel"][int(clean):]
        cache[key] = _oracle(fmt, probes[int(clean):], rounding, overflow, subnormals, draws)
    return cache[key]


@pytest.mark.parametrize("fmt", FIELD_FORMATS, ids=_field_id)
def test_every_quantize_path_matches_the_oracle_for_every_field_combination(fmt):
    probes, held = _field_probes(fmt)
    mismatches = _sweep(fmt, probes, held)
    assert not mismatches, mismatches


def _code_sample(fmt) -> np.ndarray:
    """Runs of 48 neighbouring codes: from zero, around 1.0, around min normal, and up to max finite."""
    one = int(fpemu.encode(1.0, fmt))
    starts = [0, one - 24, (1 << fmt.mantissa_bits) - 24, fmt.max_finite_code - 47]
    return np.unique(np.concatenate([np.arange(max(start, 0), max(start, 0) + 48) for start in starts])
                     ).astype(np.uint64)


@pytest.mark.parametrize("name", ["fp32", "tf32", "bf16", "fp16", "fp8_e4m3fn", "e8m0"])
def test_every_quantize_path_of_the_named_layouts_matches_the_oracle(name):
    """The paths only these layouts take (fp32's identity, tf32's leading bits, bf16's native cast and
    stochastic path, e8m0's, the compiled and numpy paths at fp16's and fp8's sizes), on runs of codes."""
    fmt = fpemu.get_format(name)
    probes, held = _field_probes(fmt, _code_sample(fmt))
    mismatches = _sweep(fmt, probes, held)
    assert not mismatches, mismatches


P3109_E4M3 = Format("p3109_e4m3", 4, 3, 8, has_inf=True, nan_codes=0, nan_at_negative_zero=True)  # inf on 0x7F


# What the sweep found, pinned: (format, input, dtype, rounding, overflow, subnormals, expected)
FOUND = [
    # inf on the top code: past 224 (halfway to 240, the next value were 0x7F finite) is inf, not 240
    (P3109_E4M3, 236.0, np.float32, "nearest_even", "inf", True, math.inf),
    (P3109_E4M3, 236.0, np.float64, "nearest_away", "inf", True, math.inf),
    (P3109_E4M3, -232.0 - 2.0**-20, np.float64, "nearest_even", "inf", True, -math.inf),
    (P3109_E4M3, 232.0, np.float32, "nearest_even", "inf", True, 224.0),           # the tie goes to even 224
    # max finite 2**-124: no float32 is the numpy short path's overflow threshold (it failed an assert)
    (Format("e1m1b125fn", 1, 1, 125, has_inf=False, nan_codes=1), 1.5 * 2.0**-124, np.float32, "nearest_even",
     "inf", True, math.nan),
    # min normal past float32's range: every positive float32 rounds up to it, inf in float32 (not NaN)
    (Format("e2m0b-129", 2, 0, -129, signed=False, has_inf=False, nan_codes=1, has_zero=False), 1.0,
     np.float32, "nearest_even", "inf", True, math.inf),
    # ... and flushing its subnormal 2**130 gives 0, not inf
    (Format("e1m1b-130", 1, 1, -130, has_inf=False, nan_codes=1, nan_at_negative_zero=True), 2.0**-149,
     np.float32, "up", "inf", False, 0.0),
    # an input whose scaling onto units of 2**130 underflows float64 still rounds up to 2**130
    (Format("e1m1b-130", 1, 1, -130, has_inf=False, nan_codes=1), 1e-300, np.float64, "up", "inf", True, 2.0**130),
]


@pytest.mark.parametrize("fmt, x, dtype, rounding, overflow, subnormals, expected", FOUND)
def test_cases_the_field_sweep_found(fmt, x, dtype, rounding, overflow, subnormals, expected):
    arr = np.array([x], dtype)
    got = fpemu.quantize(arr, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals)
    want = np.array([expected], dtype)
    assert same_bits(got, want), (got, want)
    with np.errstate(over="ignore"):  # (a value past float32's range is inf in a float32 result)
        oracle = np.array([round_exact(float(arr[0]), fmt, rounding, overflow, subnormals)], dtype)
    assert same_bits(want, oracle)
    for path in paths(fmt, rounding, subnormals) if dtype == np.float32 else []:
        assert same_bits(path.run(arr, fmt, overflow, subnormals), want), path.run.__name__


def test_p3109_top_code_is_inf_in_quantize_and_encode_alike():
    x = np.array([220.0, 228.0, 236.0, 1e6, -236.0], np.float32)
    assert fpemu.quantize(x, P3109_E4M3).tolist() == [224.0, 224.0, math.inf, math.inf, -math.inf]
    assert fpemu.encode(x, P3109_E4M3).tolist() == [0x7E, 0x7E, 0x7F, 0x7F, 0xFF]
    assert math.isnan(fpemu.decode(0x80, P3109_E4M3))
