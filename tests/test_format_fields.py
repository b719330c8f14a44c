"""Formats on orthogonal fields: e8m0, unsigned and zero-less formats, NaN-code policies, fp4 packing."""

import json
import math
import pathlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis_budget import profile_examples

import fpemu
from fpemu import strategies as fst
from fpemu.formats import Format, pack_nibbles, round_to_format, unpack_nibbles
from format_digests import digests
from oracle import round_exact
from test_formats import native_rounds_up_above_e8m0_min, same_bits

E8M0 = fpemu.get_format("e8m0")
# float32 bit patterns walking every sign, binade and low-bit pattern (2**20 of them)
SWEEP = (np.arange(1 << 20, dtype=np.uint64) * np.uint64(4093) + np.uint64(7)).astype(np.uint32).view(np.float32)


def test_the_rebuild_changed_no_result_of_any_existing_format():
    """Digests of every named format's decode/encode/quantize/round_to_format results (all codes,
    2**16 float32 patterns and float64 inputs, every mode), recorded before the rebuild."""
    golden = json.loads((pathlib.Path(__file__).parent / "golden" / "format_digests.json").read_text())
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
    code 0.  The one departure: ml_dtypes sends the float32 subnormals just above 2**-127 up."""
    with np.errstate(invalid="ignore", over="ignore"):
        native = SWEEP.astype(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ours = fpemu.quantize(SWEEP, E8M0)
    departs = native_rounds_up_above_e8m0_min(SWEEP)
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
