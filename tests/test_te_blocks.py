"""Transformer Engine's block scaling: fpemu's rules te_nvfp4 (the kernel, from its CUDA source),
te_nvfp4_reference and te_mxfp8_reference (its Python references), by hand, against TE's own Python
reference code run on the CPU (fpemu.adapters.te_block_reference; skipped without TE's source), and
TE's NVFP4 against torchao's on the same tensors."""

import numpy as np
import pytest

from fpemu.blocks import block_quantize
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks
from trace_checks import fp8_code_mismatches, same_floats

F32_MAX = np.finfo(np.float32).max


def nvfp4_probe(kind: str, rows: int = 32, seed: int = 3, block_size: int = 16) -> np.ndarray:
    return probe_blocks(kind, "fp4_e2m1fn", rows=rows, block_size=block_size, seed=seed).reshape(-1, 64)


def test_te_nvfp4_scales_by_448_6_over_tensor_amax_and_keeps_subnormal_scales():
    x = np.zeros((1, 32), np.float32)
    x[0, :4] = [2688.0, 1344.0, -3.0, 1.0]         # tensor amax 2688: S_enc = 1, block 0's scale 2688 / 6 = 448
    x[0, 16] = np.float32(6 * 2.0**-8)             # block 1's scale 2**-8: an e4m3 subnormal (code 2)
    q = block_quantize(x, "fp4_e2m1fn", scale_rule="te_nvfp4")
    assert q.scale_codes.tolist() == [[0x7E, 0x02]] and q.tensor_scale == 1.0
    assert q.element_codes[0, :4].tolist() == [0x7, 0x5, 0x8, 0x0]  # 6, 3, -3/448 -> -0, 1/448 -> 0
    assert q.element_codes[0, 16] == 0x7 and q.values[0, 16] == np.float32(6 * 2.0**-8)
    torchao = block_quantize(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4_2level")
    assert torchao.scale_codes[0, 1] == 0x08                         # torchao clamps the scale to 2**-6


def test_te_nvfp4_zero_scale_saturates_its_elements_and_dequantizes_them_to_zero():
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 16:18] = 2688.0, [2.0**-12, -(2.0**-13)]   # block 1: 2**-12 / 6 rounds to e4m3 zero
    q = block_quantize(x, "fp4_e2m1fn", scale_rule="te_nvfp4")
    assert q.scale_codes[0, 1] == 0 and q.element_codes[0, 16:19].tolist() == [0x7, 0xF, 0x0]  # x * FLT_MAX
    assert not q.values[0, 16:].any()


def test_te_nvfp4_kernel_and_reference_differ_only_at_nan_negative_zero_and_zero_tensors():
    x = nvfp4_probe("random")
    x[0, 3], x[1, 5] = np.nan, -0.0
    kernel, reference = (block_quantize(x, "fp4_e2m1fn", scale_rule=r) for r in ("te_nvfp4", "te_nvfp4_reference"))
    # the kernel's fmaxf amaxes leave NaN out; CUDA's fp4 cvt makes the NaN +6 (0x7) and keeps -0.0's sign
    clean = x.copy()
    clean[0, 3] = 0.0
    assert np.array_equal(kernel.scale_codes, block_quantize(clean, "fp4_e2m1fn", scale_rule="te_nvfp4").scale_codes)
    assert kernel.element_codes[0, 3] == 0x7 and kernel.element_codes[1, 5] == 0x8
    # torch.amax propagates it: the tensor's S_enc is NaN, every scale NaN, every element code 0
    assert (reference.scale_codes & 0x7F == 0x7F).all() and not reference.element_codes.any()
    clean[1, 5] = -0.0
    assert block_quantize(clean, "fp4_e2m1fn", scale_rule="te_nvfp4_reference").element_codes[1, 5] == 0x0
    zeros = np.zeros((1, 16), np.float32)
    assert block_quantize(zeros, "fp4_e2m1fn", scale_rule="te_nvfp4").tensor_scale == 1.0
    assert block_quantize(zeros, "fp4_e2m1fn", scale_rule="te_nvfp4_reference").tensor_scale == float(
        np.float32(1) / F32_MAX)


def test_te_mxfp8_reference_wraps_a_nan_amax_to_byte_0_and_divides_inf_blocks_by_inf():
    x = probe_blocks("random", "fp8_e4m3fn", rows=3, block_size=32, seed=4)
    x[0, 0], x[1, 0] = np.nan, np.inf
    q = block_quantize(x, "fp8_e4m3fn", scale_rule="te_mxfp8_reference")
    kernel = block_quantize(x, "fp8_e4m3fn", scale_rule="te_mxfp8")
    assert q.scale_codes[:2, 0].tolist() == [0, 255] and kernel.scale_codes[:2, 0].tolist()[1] == 254
    # byte 0 multiplies by 2**127: the finite elements saturate to +-448 (torch 2.13's cast saturates)
    assert q.element_codes[0, 0] == 0x7F and set((q.element_codes[0, 1:] & 0x7F).tolist()) == {0x7E}
    # 2**128 = inf: finite x / inf = +-0, inf / inf = NaN
    assert (q.element_codes[1, 1:] & 0x7F == 0).all() and q.element_codes[1, 0] & 0x7F == 0x7F
    assert np.array_equal(q.element_codes[2], kernel.element_codes[2])


# --- TE's own Python reference code, run from its source ----------------------------------------

def test_te_block_reference_is_a_blocks_row_of_the_adapter_table():
    from fpemu.adapters import BLOCKS, get_adapter
    from fpemu.adapters import te_block_reference
    from fpemu.errors import FpemuInputError
    adapter = get_adapter("te_block_reference")
    assert adapter.kind == BLOCKS and adapter.function() is te_block_reference.te_block_quantize
    with pytest.raises(FpemuInputError, match="scale_rule: TE's references drive"):
        te_block_reference.te_block_quantize(np.ones((1, 32), np.float32), "fp8_e4m3fn", "te_mxfp8")
    with pytest.raises(FpemuInputError, match="element_format: te_mxfp8_reference takes fp8_e4m3fn"):
        te_block_reference.te_block_quantize(np.ones((1, 32), np.float32), "fp8_e5m2", "te_mxfp8_reference")


def _te():
    from fpemu.adapters import te_block_reference
    reason = te_block_reference.te_reference_unavailable()
    if reason:
        pytest.skip(reason)
    pytest.importorskip("torch")
    return te_block_reference


@pytest.mark.parametrize("kind", PROBE_KINDS)
def test_te_reference_rules_match_te_python_code_bit_for_bit(kind):
    te = _te()
    # 16-value probe blocks (a NaN or inf in every NVFP4 block) and 32-value ones (in every other one)
    for x in (nvfp4_probe(kind), nvfp4_probe(kind, rows=16, block_size=32)):
        ours = block_quantize(x, "fp4_e2m1fn", scale_rule="te_nvfp4_reference")
        for tile_rows in (1, 16):  # TE's 1 x 16 tiles, and its 16 x 16 tiles holding one block each
            theirs, _ = te.te_nvfp4_reference(x, tile_rows)
            # (NaN scales NaN-aware: torch.min's vector loop makes NaN 0xFFFFFFFF, its scalar tail 0x7FC00000)
            assert fp8_code_mismatches(ours.scale_codes, theirs.scale_codes, "fp8_e4m3fn") == 0, (kind, tile_rows)
            assert np.array_equal(ours.element_codes, theirs.element_codes), (kind, tile_rows)
            assert same_floats(ours.values, theirs.values) and same_floats(ours.scales, theirs.scales), kind
            assert np.float32(ours.tensor_scale).view(np.uint32) == np.float32(theirs.tensor_scale).view(np.uint32)
    x = probe_blocks(kind, "fp8_e4m3fn", rows=16, block_size=32, seed=3).reshape(8, 64)
    theirs = te.te_block_quantize(x, "fp8_e4m3fn", "te_mxfp8_reference")  # (the blocks adapter's entry)
    ours = block_quantize(x, "fp8_e4m3fn", scale_rule="te_mxfp8_reference")
    for field in ("scale_codes", "element_codes"):
        assert np.array_equal(getattr(ours, field), getattr(theirs, field)), (kind, field)
    assert same_floats(ours.values, theirs.values), kind


def test_te_reference_element_cast_is_cast_to_fp4x2_bit_for_bit():
    """fpemu's te_reference element codes against TE's own cast_to_fp4x2 (after the reference's clamp to
    +-6) on 3M float32 patterns: 0 mismatches (NaN and -0.0 give code 0)."""
    te = _te()
    import torch
    import fpemu
    import fpemu.blocks.quantize as implementation
    clamped = np.clip(_float32_sample(), np.float32(-6), np.float32(6)).reshape(-1, 2)
    packed = te._nvfp4_reference()["cast_to_fp4x2"](torch.from_numpy(clamped)).numpy()
    with np.errstate(invalid="ignore"):
        ours = implementation._te_fp4_codes(clamped, fpemu.get_format("fp4_e2m1fn"),
                                            fpemu.SCALE_RULES["te_nvfp4_reference"])
    assert np.count_nonzero(ours != te.unpack_nibbles(packed)) == 0


def test_te_kernel_rule_departs_from_te_reference_code_only_in_nan_and_negative_zero():
    te = _te()
    for kind in PROBE_KINDS:
        x = nvfp4_probe(kind, rows=64)
        reference, _ = te.te_nvfp4_reference(x)
        kernel = block_quantize(x, "fp4_e2m1fn", scale_rule="te_nvfp4")
        if kind == "nan":
            assert (reference.scale_codes & 0x7F == 0x7F).all() and not reference.element_codes.any()
            continue
        differ = kernel.element_codes != reference.element_codes
        assert np.array_equal(kernel.scale_codes, reference.scale_codes), kind
        assert (kernel.element_codes[differ] == 0x8).all() and (reference.element_codes[differ] == 0).all(), kind


def test_te_nvfp4_and_torchao_differ_in_scales_only_where_torchao_clamps_to_2_minus_6():
    """On the finite probes TE's kernel and torchao's two-level NVFP4 choose the same scale wherever
    TE's is at least 2**-6 (e4m3's min normal, torchao's clamp), and then the same element codes;
    their values differ anyway: TE dequantizes by fl32(fl32(s * amax) / 2688), torchao by t * s."""
    pytest.importorskip("torchao")
    from fpemu.adapters.torchao_blocks import torchao_block_quantize
    for kind in ("random", "wide", "edges", "tiny"):  # (zeros: torchao's 0 / 0 tensor scale gives NaN scales)
        x = nvfp4_probe(kind, rows=64)
        te = block_quantize(x, "fp4_e2m1fn", scale_rule="te_nvfp4")
        torchao = torchao_block_quantize(x, "fp4_e2m1fn", "torchao_nvfp4_2level")
        differ = te.scale_codes != torchao.scale_codes
        assert (te.scale_codes[differ] < 0x08).all() and (torchao.scale_codes[differ] == 0x08).all(), kind
        same = np.repeat(~differ, 16, axis=-1)
        assert np.array_equal(te.element_codes[same], torchao.element_codes[same]), kind


# --- NVIDIA's own conversions (CUDA's headers, compiled for the host) --------------------------

def _float32_sample() -> np.ndarray:
    """Every float32 whose low 12 bits are 0, 0x7FF or 0x800 (both signs, every exponent; the ties
    and their neighbours of every narrow format), and the specials."""
    high = np.arange(1 << 20, dtype=np.uint32) << np.uint32(12)
    return (high[:, None] | np.array([0, 0x7FF, 0x800], np.uint32)).ravel().view(np.float32)


@pytest.mark.parametrize("rule,elem", [("te_nvfp4", "fp4_e2m1fn"), ("te_mxfp8", "fp8_e4m3fn"),
                                       ("te_mxfp8", "fp8_e5m2")])
def test_te_kernel_casts_are_cudas_conversions_bit_for_bit(rule, elem):
    """The kernels' element casts (cvt.rn.satfinite.{e2m1x2,e4m3x2,e5m2x2}.f32, here the CUDA headers'
    conversions) and the NVFP4 block-scale cast (satfinite e4m3) against NVIDIA's code on 3M float32
    patterns: 0 mismatches (NaN: the positive all-ones magnitude)."""
    import fpemu
    import fpemu.blocks.quantize as implementation
    from fpemu.adapters import cuda_host_casts
    reason = cuda_host_casts.cuda_casts_unavailable()
    if reason:
        pytest.skip(reason)
    x, rule, fmt = _float32_sample(), fpemu.SCALE_RULES[rule], fpemu.get_format(elem)
    with np.errstate(invalid="ignore"):
        if rule.name == "te_nvfp4":
            ours = implementation._te_fp4_codes(np.clip(x, np.float32(-6), np.float32(6)), fmt, rule)
        else:
            ours = implementation._element_codes(x, fmt, rule)[0]
    assert np.count_nonzero(ours != cuda_host_casts.cuda_cast_codes(x, elem)) == 0
    if rule.name == "te_nvfp4":
        scales = np.abs(x[~np.isnan(x)])  # (the kernel's block scales: >= 0, inf possible, never NaN)
        assert np.count_nonzero(implementation._te_e4m3_codes(scales)
                                != cuda_host_casts.cuda_cast_codes(scales, "fp8_e4m3fn")) == 0


def test_te_mxfp8_integer_e8m0_is_blackwells_ue8m0_cvt():
    """TE's float_to_e8m0 has two paths: an integer round-up (the te_mxfp8 rule) and, on Blackwell,
    cvt.rp.satfinite.ue8m0x2.f32, here CUDA's __nv_cvt_float_to_e8m0: the same byte for every
    sampled amax * fl32(1/max), both element formats (NaN 0xFF, inf 0xFE, subnormals)."""
    import fpemu
    import fpemu.blocks.quantize as implementation
    from fpemu.adapters import cuda_host_casts
    reason = cuda_host_casts.cuda_casts_unavailable()
    if reason:
        pytest.skip(reason)
    amax = np.abs(_float32_sample())
    for elem in ("fp8_e4m3fn", "fp8_e5m2"):
        fmt = fpemu.get_format(elem)
        with np.errstate(invalid="ignore", over="ignore"):
            ours = implementation._EXPONENT_RULES["te"](amax, fmt).astype(np.uint8)
            value = amax * np.float32(1 / np.float32(fmt.max_finite))    # the kernel's multiply, IEEE
        assert np.count_nonzero(ours != cuda_host_casts.cuda_cast_codes(value, "e8m0")) == 0, elem
