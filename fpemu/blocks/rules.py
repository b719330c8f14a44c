"""Scale rules of block quantization, one row per real implementation.

Each :class:`ScaleRule` says how an implementation turns a block's values into a scale code and the
element codes: how it finds the block's amax, how it picks the scale, how it applies it, how a
NaN becomes an element code, and where its arithmetic departs from exact (measured figures in
``reports/blocks.md``, from ``benchmarks/bench_blocks.py`` and ``benchmarks/blocks_torchao_sweep.py``).
Sources: OCP Microscaling Formats (MX) v1.0 section 6.3; torchao 0.18.0
``prototype/mx_formats/mx_tensor.py`` (``to_mx``, ``_to_mx_rceil``, ``get_fp_scale``) and
``nvfp4_tensor.py`` (``nvfp4_quantize``); Transformer Engine d0067d0 ``common/util/ptx_arch_spec.cuh``
(``float_to_e8m0``) and ``common/util/ptx.cuh`` (``exp2f_rcp``); microxcaling ``mx/mx_ops.py``.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# How a NaN becomes an element code (ScaleRule.nan_element).
NAN_ELEMENTS = {
    "nan": "the element format's NaN code, its sign kept (formats without NaN: the all-ones magnitude)",
    "torchao": "a finite code: torchao's fp4/fp6 bit cast runs on NaN's bits (canonical NaN -> fp4 0x3)",
    "scale": "a NaN block: scale NaN, every element NaN (codes 0)",
    "te_reference": "code 0: TE's reference cast_to_fp4x2 is a chain of comparisons NaN takes none of "
                    "(and -0.0, which x >= 0.0 takes, gets code 0 too)",
    "cuda": "the positive all-ones magnitude, the sign dropped, as CUDA's cvt converts (cuda_fp8.hpp / "
            "cuda_fp4.hpp): e4m3 and e5m2 0x7F, fp4 +6 (0x7)",
}
# How the scale exponent is picked (MX rules, e8m0 scales).
EXPONENTS = {
    "floor": "floor(log2 amax) - emax(element), on the exact amax (OCP, microxcaling)",
    "microxcaling": "microxcaling: floor(log2(amax)) with torch's log2 in x's type (amax 0 taken as 2**-126), "
                    "minus emax(element); above 127 NaN, below -127 -127",
    "torchao_floor": "torchao FLOOR: amax's float32 exponent field minus emax(element)",
    "torchao_ceil": "torchao CEIL: amax's exponent field, plus 1 when its mantissa is not zero, minus emax(element)",
    "torchao_even": "torchao EVEN: amax rounded at the element's mantissa width (half an ulp added to its bits), then FLOOR",
    "torchao_rceil": "torchao RCEIL: ceil(log2(fl32(amax / max))) with float32 log2",
    "te": "Transformer Engine: float_to_e8m0(fl32(amax * fl32(1 / max))): the exponent field, rounded up "
          "when the mantissa is not zero (but not past 0xFE, and not for subnormals <= 0x400000)",
    "nvfp4": "NVFP4: fl32(amax / 6) (divided by the tensor scale with two levels), clamped to "
             "[2**-6, 448] and cast to e4m3",
    "te_nvfp4": "Transformer Engine NVFP4: S_enc = min(fl32(448 * 6 / tensor amax), FLT_MAX) (1 where that "
                "is 0; the kernel also where amax is 0), the block's e4m3(fl32(amax * fl32(S_enc * fl32(1/6)))), "
                "saturating at 448, with no lower clamp (e4m3 subnormals and 0 are scales)",
    "te_nvfp4_reference": "TE's Python NVFP4 reference: as te_nvfp4, but a tensor amax of 0 gives S_enc = "
                          "FLT_MAX (torch.min(2688 / 0, FLT_MAX); only S_enc == 0 becomes 1)",
    "te_reference": "TE's Python MXFP8 reference: float_to_e8m0 of fl32(amax / max) (exact division) in int32 "
                    "arithmetic, the byte taken mod 256: a NaN amax rounds its exponent 255 up to byte 0",
}
# How the scale is applied to the elements.
APPLICATIONS = {
    "exact": "x / 2**X exactly, then rounded once",
    "microxcaling": "microxcaling's _quantize_elemwise_core in x's type (float32, float64, bf16, float16: every "
                    "op rounded to it): y = x / 2**X, e = max(floor(log2 |y|), emin), element "
                    "sign(t) * floor(|t| + 0.5) with t = y / 2**e * 2**m, clamped to +-max; times 2**X",
    "divide": "torchao FLOOR/CEIL/EVEN: fl32(x / max(2**X, 2**-126)), clamped to +-max, then cast",
    "reciprocal": "fl32(x * r), r = 2**-X as a float32 (byte 0: rcp_byte0, 254: 2**-127, 255: NaN), clamped, cast",
    "nvfp4": "fl32(x * fl32(1 / s)) (two levels: fl32(x * fl32(fl32(1 / t) / s))), clamped to +-6, cast",
    "te_nvfp4": "fl32(x * r), r = min(fl32(1 / fl32(s * S_dec)), FLT_MAX), S_dec = fl32(1 / S_enc) (scale 0: "
                "r = FLT_MAX), clamped to +-6, cast; dequantized as TE's dequantize kernel: "
                "fl32(e * fl32(fl32(s * tensor amax) * fl32(1 / 2688)))",
    "te_reference": "fl32(x / 2**X), 2**X = torch.pow(2, code - 127) (255: inf, so finite x become 0), then "
                    "torch's e4m3fn cast (torch 2.13 saturates it: finite and inf to +-448)",
}


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """One implementation's block-scaling arithmetic.

    Attributes:
      name: the rule's name (``block_quantize(..., scale_rule=NAME)``).
      source: the implementation and version it reproduces.
      scale_format: the format of its scales (``"e8m0"`` or ``"fp8_e4m3fn"``).
      block_size: its block size (block_quantize's default).
      elements: the element formats it supports.
      exponent: how the scale is chosen (a key of :data:`EXPONENTS`).
      application: how it is applied (a key of :data:`APPLICATIONS`).
      amax_nan: ``"propagate"`` (a NaN in the block makes amax NaN: torch.amax) or ``"ignore"``
        (fmaxf, Transformer Engine's amax).
      rounding: the elements' rounding mode (microxcaling's "nearest" is nearest_away).
      nan_element: how a NaN becomes an element code (a key of :data:`NAN_ELEMENTS`).
      rcp_byte0: the multiplier for scale byte 0 (``reciprocal`` rules): torchao RCEIL 1.0, TE 2**127.
      levels: NVFP4 scale levels (1: e4m3 block scales; 2: also a float32 tensor scale).
      departs: where its arithmetic departs from exact, and how often (measured, reports/blocks.md).
    """

    name: str
    source: str
    scale_format: str
    block_size: int
    elements: tuple
    exponent: str
    application: str
    amax_nan: str = "propagate"
    rounding: str = "nearest_even"
    nan_element: str = "nan"
    rcp_byte0: Optional[float] = None
    levels: int = 1
    departs: str = ""

    def __post_init__(self):
        for field, table in (("exponent", EXPONENTS), ("application", APPLICATIONS)):
            if getattr(self, field) not in table:
                raise ValueError(f"scale rule {self.name!r}: {field} must be one of {sorted(table)}, "
                                 f"got {getattr(self, field)!r}")
        if self.amax_nan not in ("propagate", "ignore") or self.nan_element not in NAN_ELEMENTS:
            raise ValueError(f"scale rule {self.name!r}: amax_nan must be 'propagate' or 'ignore' and "
                             f"nan_element one of {sorted(NAN_ELEMENTS)}")


MX_ELEMENTS = ("fp8_e4m3fn", "fp8_e5m2", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn")
_TORCHAO = "torchao 0.18.0 to_mx"
_BYTE0 = ("blocks with scale byte 0 (amax < 2**(emax - 127)) are divided by 2**-126 but dequantized "
          "with 2**-127: half their value")
_FLOAT32 = "x / scale rounded to float32 before the element cast"

SCALE_RULES = {rule.name: rule for rule in [
    ScaleRule("ocp", "OCP MX v1.0 section 6.3", "e8m0", 32, MX_ELEMENTS, "floor", "exact",
              nan_element="scale",
              departs="exact arithmetic; a block holding NaN or inf gets scale NaN (0xFF) and NaN elements"),
    ScaleRule("torchao_floor", f"{_TORCHAO}, ScaleCalculationMode.FLOOR", "e8m0", 32, MX_ELEMENTS, "torchao_floor",
              "divide", nan_element="torchao",
              departs=f"{_BYTE0}; an inf in the block gives scale 2**120 (inf's exponent field minus 8 for "
                      f"e4m3), the inf saturates and the rest round to 0; {_FLOAT32}"),
    ScaleRule("torchao_ceil", f"{_TORCHAO}, ScaleCalculationMode.CEIL", "e8m0", 32, MX_ELEMENTS, "torchao_ceil",
              "divide", nan_element="torchao", departs=f"{_BYTE0}; {_FLOAT32}"),
    ScaleRule("torchao_even", f"{_TORCHAO}, ScaleCalculationMode.EVEN", "e8m0", 32, MX_ELEMENTS, "torchao_even",
              "divide", nan_element="torchao", departs=f"{_BYTE0}; {_FLOAT32}"),
    ScaleRule("torchao_rceil", f"{_TORCHAO}, ScaleCalculationMode.RCEIL (eager fallback)", "e8m0", 32,
              MX_ELEMENTS, "torchao_rceil", "reciprocal", nan_element="torchao", rcp_byte0=1.0,
              departs="float32 log2 loses the round-up just above powers of two (the block's max then "
                      "saturates); blocks with scale byte 0 are multiplied by 1.0, flushing them to 0"),
    ScaleRule("te_mxfp8", "Transformer Engine d0067d0 MXFP8 kernel (non-Blackwell float_to_e8m0, exp2f_rcp)",
              "e8m0", 32, ("fp8_e4m3fn", "fp8_e5m2"), "te", "reciprocal", amax_nan="ignore", nan_element="cuda",
              rcp_byte0=2.0**127,
              departs="amax * fl32(1/max) is rounded to float32 before the exponent is taken; NaN is "
                      "left out of amax (fmaxf), and a NaN element is 0x7F whatever its sign (CUDA 13.0's "
                      "cuda_fp8.hpp conversion, run here); byte 0 multiplies by 2**127 (PR #2647; was 1.0)"),
    ScaleRule("te_mxfp8_reference", "Transformer Engine d0067d0 Python MXFP8 reference "
              "(tests/pytorch/test_mxfp8_2d_quantize.py _mxfp8_2d_quantize_reference, _float_to_e8m0; "
              "its tiles are 32 x 32, a 1-D block is a tile with one non-zero row)", "e8m0", 32, ("fp8_e4m3fn",),
              "te_reference", "te_reference",
              departs="the exact quotient fl32(amax / 448) where the kernel multiplies by fl32(1/448): on 1,820 "
                      "amaxes within 3 ulps of 448 * 2**k no scale differs from the kernel row's (1 from exact "
                      "ceil: a subnormal quotient <= 2**-127 is not rounded up), nor on the probes (the same "
                      "departures from OCP as te_mxfp8); they part on specials: a NaN amax (torch.amax keeps "
                      "it) wraps to byte 0, multiplying the block by 2**127 (its finite elements saturate to "
                      "+-448), where the kernel leaves NaN out; an inf amax gives byte 255 and 2**128 = inf "
                      "(finite elements 0, inf NaN), where the kernel gives 254"),
    ScaleRule("microxcaling", "microsoft/microxcaling 7bc4195 mx_ops._quantize_mx, PyTorch path (round='nearest', "
              "shared_exp_method='max')", "e8m0", 32,
              MX_ELEMENTS, "microxcaling", "microxcaling", rounding="nearest_away", nan_element="scale",
              departs="it computes in the input's type: log2 rounds up just below powers of two (float32: "
                      "amax = 2**20 * (1 - 2**-24) gets the scale of 2**20, one too large; bf16 rounds it to 8 "
                      "bits, so far more amaxes and elements do), and on bf16 or float16 every step rounds again "
                      "(|t| + 0.5 too: ties away from zero, and values just under a tie go up); elements rounded "
                      "half away from zero ('nearest'); a scaled value that is zero (-0.0 in x, or x / 2**X "
                      "underflowing) gives +0, torch.sign(-0.0) being +0"),
    ScaleRule("torchao_nvfp4", "torchao 0.18.0 nvfp4_quantize, one level", "fp8_e4m3fn", 16, ("fp4_e2m1fn",),
              "nvfp4", "nvfp4", nan_element="torchao",
              departs="block scales clamped to >= 2**-6 (e4m3's min normal): small tensors underflow "
                      "(randn * 1e-3 quantizes to all zeros); x * fl32(1/s), not x / s"),
    ScaleRule("torchao_nvfp4_2level", "torchao 0.18.0 nvfp4_quantize with per_tensor_scale = amax / (448 * 6)",
              "fp8_e4m3fn", 16, ("fp4_e2m1fn",), "nvfp4", "nvfp4", nan_element="torchao", levels=2,
              departs="x * fl32(fl32(1/t) / s): two float32 roundings where x / (t * s) has none"),
    ScaleRule("te_nvfp4", "Transformer Engine d0067d0 NVFP4 kernel, 1 x 16 blocks, round to nearest, no RHT "
              "(common/cast/nvfp4/core_nvfp4.cuh compute_global_encode_scaling_factor_FP4 and "
              "compute_decoding_scaling_factor; quantize_transpose_nvfp4.cuh block_scale_inverse and "
              "ptx::mul_cvt_fp32_to_fp4_4x: cvt.rn.satfinite.e2m1x2.f32; dequantize_nvfp4.cuh)",
              "fp8_e4m3fn", 16, ("fp4_e2m1fn",), "te_nvfp4", "te_nvfp4", amax_nan="ignore", nan_element="cuda",
              levels=2,
              departs="S_enc = fl32(2688 / amax_t) and fl32(amax_b * fl32(S_enc * fl32(1/6))) round three "
                      "times where amax_b * 448 / amax_t rounds once: off e4m3 ties (168.00002 for an exact 168, "
                      "so up where round-half-even goes down): 123 of 884 blocks within 3 ulps of e4m3 "
                      "midpoints, 0 of the 1,024 finite probe blocks; the element multiplier "
                      "min(fl32(1 / fl32(s * S_dec)), FLT_MAX) loses bits where s * S_dec is a float32 "
                      "subnormal (tensor amax under about 2**-106: 103 of 4,096 'tiny' elements) and moves a "
                      "few fp4 ties (9 of 4,096 bf16-valued randn * 1e-3 elements); no lower clamp: e4m3 "
                      "subnormal scales and scale 0, whose elements are x * FLT_MAX saturated to +-6 (63 "
                      "'wide' and 229 'edges' blocks of 256) and dequantize to 0; an all-zero tensor gets "
                      "S_enc 1; NaN is left out of both amaxes (fmaxf) and a NaN element becomes +6 (code 0x7, "
                      "its sign dropped: CUDA 13.0 cuda_fp4.hpp's conversion, run here; the instruction itself "
                      "is not)"),
    ScaleRule("te_nvfp4_reference", "Transformer Engine d0067d0 Python NVFP4 reference "
              "(pytorch/custom_recipes/reference_nvfp4.py NVFP4QuantizerRef._quantize, quant_tile_shape "
              "(1, 16), with_rht=False; _quantize_blockwise_reference, cast_to_fp4x2)",
              "fp8_e4m3fn", 16, ("fp4_e2m1fn",), "te_nvfp4_reference", "te_nvfp4", nan_element="te_reference",
              levels=2,
              departs="written to match the kernel: its scales and finite elements are te_nvfp4's (the same "
                      "123 of 884 midpoint blocks and 103 'tiny' elements off exact); it parts from the kernel "
                      "where torch.amax keeps NaN (S_enc NaN: every scale NaN, every element code 0: 256 scales "
                      "and 3,965 of 4,096 codes of the 'nan' probe), where cast_to_fp4x2 gives -0.0 code 0 "
                      "(546 of 4,096 'wide' and 72 'tiny' codes), and for an all-zero tensor (S_enc = FLT_MAX, "
                      "seen only in tensor_scale: its codes, scales and amax are the kernel's zeros)"),
]}
