"""Block quantization (MX, NVFP4) as the real implementations compute it, scale rule by scale rule.

Every rule of :data:`fpemu.blocks.SCALE_RULES` is reproduced step for step: the exact rules
(``ocp``, ``microxcaling``) in float64, the others in float32 in their own order of operations
(torchao rounds x / scale to float32 before the element cast, NVFP4 multiplies by fl32(1/s)).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import ml_dtypes
import numpy as np

from fpemu.blocks.log2 import ceil_log2, floor_log2
from fpemu.blocks.rules import SCALE_RULES, ScaleRule
from fpemu.errors import FpemuInputError
from fpemu.formats.kernels import KERNELS
from fpemu.formats.format import Format, get_format
from fpemu.formats.packing import pack_nibbles
from fpemu.formats.rounding import as_float_array, codes_of_values, decode, encode, quantize

_F32 = np.float32
_E8M0_BIAS, _E8M0_NAN = 127, 255
_OWN_TYPES = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))  # the 16-bit types microxcaling computes in


@dataclasses.dataclass(frozen=True, eq=False)
class BlockQuantized:
    """The result of :func:`block_quantize`.

    Attributes:
      rule: the scale rule's name.
      element_format, scale_format: the formats of the element and scale codes.
      block_size: values per scale; axis: the axis the blocks run along (non-negative).
      scale_codes: one code per block (x's shape, the axis divided by block_size).
      scales: the block scales' values (float32; NaN for a NaN scale).
      element_codes: one code per value (x's shape; 4-bit codes one per byte, see packed_codes).
      values: the dequantized values, as the implementation computes them (float32).
      tensor_scale: the float32 tensor scale of two-level NVFP4, else None.
    """

    rule: str
    element_format: Format
    scale_format: Format
    block_size: int
    axis: int
    scale_codes: np.ndarray
    scales: np.ndarray
    element_codes: np.ndarray
    values: np.ndarray
    tensor_scale: Optional[float] = None

    @property
    def packed_codes(self) -> np.ndarray:
        """4-bit element codes two per byte along the last axis, torchao's order (fp4 only)."""
        if self.element_format.bits != 4:
            raise ValueError(f"packed_codes: {self.element_format.name} codes are not 4 bits wide")
        return pack_nibbles(self.element_codes)


def block_quantize(x, element_format="fp8_e4m3fn", block_size: Optional[int] = None,
                   scale_format: Optional[str] = None, scale_rule: str = "ocp", axis: int = -1,
                   torch_threads: int = 1) -> BlockQuantized:
    """Quantize ``x`` in blocks of ``block_size`` values along ``axis``, one scale per block.

    Args:
      x: float array (float32 or bf16 for the float32 rules; float64 too for ``ocp``; ``microxcaling``
        computes in x's own float32, float64, bf16 or float16, as microxcaling's torch code does).
      element_format: the elements' format, one the rule supports (``SCALE_RULES[rule].elements``).
      block_size: values per scale; defaults to the rule's (32 for MX, 16 for NVFP4).
      scale_format: the scales' format; defaults to the rule's (``"e8m0"`` or ``"fp8_e4m3fn"``),
        the only one its arithmetic defines.
      scale_rule: a name in :data:`fpemu.blocks.SCALE_RULES` (``ocp``, ``torchao_floor``,
        ``torchao_rceil``, ``te_mxfp8``, ``microxcaling``, ``torchao_nvfp4``, ...).
      axis: the axis the blocks run along; its length must be a multiple of block_size.
      torch_threads: torch's intra-op threads (torch.get_num_threads()) in the run modelled: two-level
        NVFP4's tensor amax of more than 32,768 values holding a NaN has other NaN bits with more than
        one (:func:`torch_max_all_nan_bits`), and torchao's element codes follow them.

    Returns:
      A :class:`BlockQuantized`.

    Example:
      >>> q = block_quantize([1.0, -3.0, 500.0, 0.25], "fp8_e4m3fn", block_size=4)
      >>> int(q.scale_codes[0]), q.values.tolist()           # 500 saturates: floor(log2 500) = emax
      (127, [1.0, -3.0, 448.0, 0.25])
    """
    rule = _rule(scale_rule)
    elem = get_format(element_format)
    if elem.name not in rule.elements:
        raise FpemuInputError(f"element_format: rule {rule.name!r} supports {', '.join(rule.elements)}, "
                              f"got {elem.name}")
    scale_fmt = get_format(scale_format if scale_format is not None else rule.scale_format)
    if scale_fmt != get_format(rule.scale_format):
        raise FpemuInputError(f"scale_format: rule {rule.name!r} defines its arithmetic for "
                              f"{rule.scale_format} scales, got {scale_fmt.name}")
    block_size = rule.block_size if block_size is None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise FpemuInputError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(torch_threads, bool) or not isinstance(torch_threads, (int, np.integer)) or torch_threads < 1:
        raise FpemuInputError(f"torch_threads must be a positive int, got {torch_threads!r}")
    arr = _operand(x, rule)
    if not isinstance(axis, (int, np.integer)) or not -arr.ndim <= axis < arr.ndim:
        raise FpemuInputError(f"axis must be an int in [{-arr.ndim}, {arr.ndim - 1}] for x of shape "
                              f"{arr.shape}, got {axis!r}")
    axis = int(axis) % arr.ndim
    moved = np.moveaxis(arr, axis, -1)
    if moved.shape[-1] % block_size:
        raise FpemuInputError(f"x: axis {axis} has length {moved.shape[-1]}, not a multiple of "
                              f"block_size={block_size}")
    blocks = moved.reshape(*moved.shape[:-1], moved.shape[-1] // block_size, block_size)
    scale_codes, scales, codes, values, tensor_scale = _in_chunks(blocks, elem, rule,
                                                                  torch_threads=int(torch_threads))

    def back(a):  # blocks back to x's layout
        return np.moveaxis(a.reshape(moved.shape), -1, axis)

    return BlockQuantized(rule.name, elem, scale_fmt, int(block_size), axis, np.moveaxis(scale_codes, -1, axis),
                          np.moveaxis(scales, -1, axis), back(codes), back(values), tensor_scale)


def _rule(name) -> ScaleRule:
    if isinstance(name, ScaleRule):
        return name
    if name not in SCALE_RULES:
        raise FpemuInputError(f"scale_rule: unknown rule {name!r}; known: {', '.join(SCALE_RULES)}")
    return SCALE_RULES[name]


def _operand(x, rule: ScaleRule) -> np.ndarray:
    """x in the type the rule computes in: float32 (float64 input only where it holds float32 values,
    so no rounding is hidden), or x's own float32 or float64 for the exact rules (x / 2**X is exact
    in float32 too, but where it lands among float32's subnormals, far below any element's least
    value, so the elements are the same); microxcaling computes in x's own type, bf16 and float16
    included."""
    if rule.application == "microxcaling" and np.asarray(x).dtype in _OWN_TYPES:
        return np.asarray(x)
    arr = as_float_array(x)
    if rule.application in ("exact", "microxcaling"):
        return arr
    if arr.dtype == np.float64:
        narrow = arr.astype(_F32)
        if not np.array_equal(narrow.astype(np.float64), arr, equal_nan=True):
            raise FpemuInputError(f"x: rule {rule.name!r} computes in float32 and x holds float64 values "
                                  "that are not float32 values; pass float32 or bf16")
        return narrow
    return arr


_short_paths = True  # (off inside _rules_own_arithmetic)


@contextlib.contextmanager
def _rules_own_arithmetic():
    """block_quantize by each rule's own arithmetic alone, in this thread's calls and every other's: no
    compiled pass, no integer element path (the reference both are checked against in tests/test_blocks.py
    and benchmarks/exhaustive_blocks.py)."""
    global _short_paths
    _short_paths = False
    try:
        yield
    finally:
        _short_paths = True


# Values per chunk: few enough (256K) that a chunk and its scratch stay in L2-L3 through the passes,
# enough that the per-call costs of quantize stay small (measured best of 32K..all).
_CHUNK_VALUES = 1 << 18


def _in_chunks(blocks: np.ndarray, elem: Format, rule: ScaleRule, compiled: bool = True, torch_threads: int = 1):
    """The rule's arithmetic chunk by chunk (each block's result depends only on itself and, for
    two-level NVFP4, the tensor's amax, taken first: :func:`_tensor_amax`), or in one compiled pass
    where :func:`_compiled_blocks` takes the rule (``compiled``)."""
    flat = blocks.reshape(-1, blocks.shape[-1])
    if compiled and _short_paths and _compiled_blocks_take(flat, rule):
        scale_codes, scales, codes, values = _compiled_blocks(np.ascontiguousarray(flat), elem, rule)
        return (scale_codes.reshape(blocks.shape[:-1]), scales.reshape(blocks.shape[:-1]), codes.reshape(blocks.shape),
                values.reshape(blocks.shape), None)
    tensor_amax = _tensor_amax(flat, rule, torch_threads) if rule.levels == 2 else None
    compute = _BLOCK_ARITHMETIC.get(rule.exponent, _mx)
    step = max(1, _CHUNK_VALUES // flat.shape[1])
    scale_codes, scales = np.empty(len(flat), np.uint8), np.empty(len(flat), _F32)
    codes, values = np.empty(flat.shape, np.uint8), np.empty(flat.shape, _F32)
    tensor_scale = None
    for start in range(0, len(flat), step):
        rows = slice(start, start + step)
        scale_codes[rows], scales[rows], codes[rows], _, tensor_scale = compute(flat[rows], elem, rule, tensor_amax,
                                                                                 values[rows])
    if tensor_amax is not None and not len(flat):
        tensor_scale = compute(flat, elem, rule, tensor_amax, values)[4]
    shape = blocks.shape[:-1]
    return (scale_codes.reshape(shape), scales.reshape(shape), codes.reshape(blocks.shape),
            values.reshape(blocks.shape), tensor_scale)


# at::internal::GRAIN_SIZE (ATen/Parallel.h): at::parallel_reduce splits a reduction across threads only past it.
TORCH_GRAIN_SIZE = 32768
_QUIET_NAN, _ALL_ONES, _QUIET_BIT = 0x7FC00000, 0xFFFFFFFF, 0x00400000


def _tensor_amax(flat: np.ndarray, rule: ScaleRule, torch_threads: int):
    """Two-level NVFP4's float32 tensor amax, max |x| (0 for an empty tensor); a NaN in x makes it NaN, with
    :func:`torch_max_all_nan_bits` (its bits reach torchao's element codes), unless the rule's amax ignores
    NaN (fmaxf from 0, as TE's amax kernel)."""
    if not flat.size:
        return _F32(0)
    magnitude = np.abs(flat)
    with np.errstate(invalid="ignore"):
        amax = _F32(magnitude.max())
    if not np.isnan(amax):
        return amax
    if rule.amax_nan == "ignore":
        return _F32(magnitude[~np.isnan(magnitude)].max(initial=0))
    if magnitude.size == 1:  # no maximum is taken: the NaN comes back through fill_'s double Scalar, quieted
        return (magnitude.reshape(-1).view(np.uint32) | np.uint32(_QUIET_BIT)).view(_F32)[0]
    return np.array(torch_max_all_nan_bits(magnitude.size, torch_threads), np.uint32).view(_F32)[()]


def torch_max_all_nan_bits(size: int, threads: int) -> int:
    """The float32 bits of ``torch.max(t)`` (no dim: ATen's max_all kernel) for a float32 CPU tensor t of
    ``size`` (at least 2) values holding a NaN, with torch's intra-op pool at ``threads``
    (torch.get_num_threads()).

    ATen's reduce_all_impl_vec (native/cpu/ReduceAllOpsKernel.cpp) hands at::parallel_reduce a vector
    fold whose ``maximum`` (AVX2 and AVX512 tiers) ORs an all-ones mask into the lanes where the operands
    are unordered: 0xFFFFFFFF, whatever the NaN's sign, payload or position.  Past GRAIN_SIZE values with
    more than one thread, parallel_reduce folds the threads' partial results with the scalar max_impl,
    which returns quiet_NaN: 0x7FC00000.  (Measured on torch 2.13 at 1 and 2 threads, on the AVX512 tier
    and ATEN_CPU_CAPABILITY=avx2, sizes 2 to 2**20, the NaN first, second, in the middle and last, quiet
    and signalling NaNs of both signs; the ``default`` tier's scalar maximum keeps a NaN's own bits
    instead, and is not modelled.)

    Example:
      >>> [hex(torch_max_all_nan_bits(size, threads)) for size, threads in ((32768, 2), (32769, 2), (32769, 1))]
      ['0xffffffff', '0x7fc00000', '0xffffffff']
    """
    return _QUIET_NAN if size > TORCH_GRAIN_SIZE and threads > 1 else _ALL_ONES


# The exponent rules fpemu_mx_blocks computes itself, in the order of its enum (fpemu/formats/_ckernels.c);
# the enum's next value takes the scale codes given (the rules with float32 log2, computed here).
_COMPILED_EXPONENTS = ("floor", "torchao_floor", "torchao_ceil", "torchao_even", "te", "te_reference")
_GIVEN_CODES = len(_COMPILED_EXPONENTS)


def _compiled_blocks_take(flat: np.ndarray, rule: ScaleRule) -> bool:
    return (KERNELS is not None and flat.dtype == _F32 and flat.size > 0 and rule.rounding == "nearest_even"
            and rule.scale_format == "e8m0")


def _compiled_blocks(flat: np.ndarray, elem: Format, rule: ScaleRule) -> tuple:
    """:func:`_mx` for C-contiguous float32 blocks in one compiled pass (fpemu_mx_blocks): each block's
    peak, the rule's scale code (the C twin of its :data:`_EXPONENT_RULES` function for the blocks the
    pass takes: a normal peak below :func:`_peak_bound`; the float32-log2 rules' codes are computed here
    first and given) and :func:`_fast_elements`' element pass, which rounds the elements below min
    normal itself; all-zero blocks are written in the pass.  The blocks it leaves (NaN, inf, tiny or
    huge scales) get :func:`_mx` itself: (scale codes, scales, element codes, values)."""
    count, width = flat.shape
    scale_codes, scales = np.empty(count, np.uint8), np.empty(count, _F32)
    codes, values = np.empty(flat.shape, np.uint8), np.empty(flat.shape, _F32)
    slow = np.empty(count, np.int64)
    span, past_max = _code_bounds(elem)
    exponent = _GIVEN_CODES
    if rule.exponent in _COMPILED_EXPONENTS:
        exponent = _COMPILED_EXPONENTS.index(rule.exponent)
    else:
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            amax = _block_amax(flat, _block_peak(flat), rule.amax_nan)
            scale_codes[:] = _EXPONENT_RULES[rule.exponent](amax, elem)
    left = KERNELS.fpemu_mx_blocks(flat.reshape(-1), count, width, exponent,
                                   elem.mantissa_bits, elem.bits, elem.bias, elem.emin, elem.emax, _peak_bound(elem),
                                   span, past_max, elem.max_finite_code, elem.max_finite, scale_codes, scales,
                                   values.reshape(-1), codes.reshape(-1), slow)
    if left:
        slow = slow[:left]
        scale_codes[slow], scales[slow], codes[slow], values[slow], _ = _in_chunks(flat[slow], elem, rule,
                                                                                   compiled=False)
    return scale_codes, scales, codes, values


def _mx(blocks: np.ndarray, elem: Format, rule: ScaleRule, tensor_amax, values: np.ndarray):
    """e8m0-scaled blocks: (scale codes, scale values, element codes, dequantized values, None); the
    dequantized values are written into ``values``."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        peak = _block_peak(blocks)
        amax = _block_amax(blocks, peak, rule.amax_nan)
        codes = _EXPONENT_RULES[rule.exponent](amax, elem).astype(np.uint8)
        scales = _e8m0_values(codes)
        if _short_paths and blocks.dtype == _F32 and rule.rounding == "nearest_even":
            elements = _fast_elements(blocks, peak, codes, scales, elem, rule, values)
        else:
            # (with a NaN-propagating amax a NaN can only be in a block whose amax is NaN, or made where an
            # inf amax gives a NaN or infinite scale: inf / inf)
            may_hold_nan = rule.amax_nan != "propagate" or not bool(np.isfinite(amax).all())
            elements = _scaled_elements(blocks, codes, scales, elem, rule, values, may_hold_nan)
    return codes, scales, elements, values, None


def _scaled_elements(blocks, codes, scales, elem: Format, rule: ScaleRule, values: np.ndarray,
                     may_hold_nan: bool = True) -> np.ndarray:
    """The rule's own arithmetic: x scaled as the rule applies its scale, rounded to elem with
    saturation, encoded, and multiplied back by the scale into ``values``; the element codes."""
    scaled = _APPLY[rule.application](blocks, codes, elem, rule)
    elements, rounded = _element_codes(scaled, elem, rule, may_hold_nan)
    np.multiply(rounded, scales[..., None], out=values, casting="same_kind")
    return elements


# Values per pass of the integer element path: its scratch arrays stay in L2 (measured best of 8K..256K).
_ELEMENT_VALUES = 1 << 16


def _fast_elements(blocks, peak, codes, scales, elem: Format, rule: ScaleRule, values: np.ndarray) -> np.ndarray:
    """:func:`_scaled_elements` for float32 blocks and nearest even, for the most part without scaling:
    the element codes.

    For a scale 2**X with every quantity a float32 normal, each rule's scaling (x / 2**X,
    x * 2**-X) is exact and only subtracts X from the exponent field, and so the scaling back
    adds it: rounding y = x / 2**X to elem's m mantissa bits is rounding x itself to m bits, and
    the dequantized value is that.  Veltkamp's split does it in three float passes, the sign and
    -0 kept: c = x * (2**(23 - m) + 1), hi = c - (c - x) is x rounded to m + 1 significant bits,
    ties to even (checked on every float32 significand).  The element code is hi's bits shifted
    down to sign, exponent and m mantissa bits (16 bits), less a per-block offset, with the sign
    (then at bit 8 + m) moved to the code's top bit: a dozen passes, most on 16-bit integers.
    One compare finds the elements whose code falls outside elem's normal codes: those rounded
    past max (the block's largest, under a floor scale) saturate here, to max's code and
    max * 2**X; those below min normal (elem's subnormals, zero, float32's subnormals: their code
    wraps) are rounded onto elem's subnormals (:func:`_subnormal_elements`).  Whole blocks with a NaN
    or inf, a peak of :func:`_peak_bound` or more (where c would overflow) or a scale code outside
    [1 - emin, 253] (torchao's 2**-126 clamp, byte 0's rules, NaN: zero blocks too) take the rule's own
    arithmetic here, block by block.
    """
    m, uint, u16 = elem.mantissa_bits, np.uint32, np.uint16
    lowest = 1 << m                                                    # min normal's code
    below = 8 + m                                                      # bits below the sign after the shift
    # code - lowest = (hi's bits >> (23 - m)) - offset, offset = ((X + 127 - bias) << m) + lowest and
    # X = scale code - 127.  Below the sign bit, codes past max reach at most 2**(emax + 1)'s, and a
    # code under min normal's wraps above that, as long as offset + that stays below 2**below
    # (always so under the peak bound).
    span, past_max = _code_bounds(elem)
    offsets = ((codes.astype(np.int64) - elem.bias) << m) + lowest
    fast_block = ((peak < uint(_peak_bound(elem))) & (codes >= 1 - elem.emin) & (codes <= 253)
                  & (offsets + past_max < (1 << below)))
    offsets = np.where(fast_block, offsets, 0).astype(u16)
    elements = np.empty(blocks.shape, np.uint8)
    width = blocks.shape[1]
    flat_values, flat_blocks, flat_elements = values.reshape(-1), blocks.reshape(-1), elements.reshape(-1)
    if KERNELS is not None and blocks.flags.c_contiguous and values.flags.c_contiguous:
        past_max_at, below_min = _compiled_element_pass(blocks, offsets, scales, elem, span, past_max, values,
                                                        elements)
    else:
        past_max_at, below_min = _numpy_element_pass(blocks, offsets, elem, span, past_max, values, elements)
    if past_max_at.size:
        _saturate(past_max_at, flat_blocks, flat_values, flat_elements, scales, width, elem)
    if not fast_block.all():  # whole blocks by the rule's own arithmetic (their codes above are meaningless)
        slow = np.flatnonzero(~fast_block)
        own = np.empty((len(slow), width), _F32)
        elements[slow] = _scaled_elements(blocks[slow], codes[slow], scales[slow], elem, rule, own)
        values[slow] = own
        below_min = below_min[fast_block[below_min // width]]
    if below_min.size:
        _subnormal_elements(below_min, flat_blocks, flat_values, flat_elements, scales, width, elem)
    return elements


def _peak_bound(elem: Format) -> int:
    """The bits of 2**(104 + m), the bound on a block's peak below which Veltkamp's c = x * (2**(23 - m) + 1)
    stays finite (a bound of 2**107 for every format let c overflow for m < 3: hi became NaN, whose code
    was caught only where the block's offset made it wrap)."""
    return (127 + 104 + elem.mantissa_bits) << 23


def _code_bounds(elem: Format) -> tuple:
    """The element pass's code bounds, less min normal's code: max finite's, and 2**(emax + 1)'s (the
    codes rounded past max reach)."""
    lowest = 1 << elem.mantissa_bits
    return elem.max_finite_code - lowest, ((elem.emax + 1 + elem.bias) << elem.mantissa_bits) - lowest


def _numpy_element_pass(blocks, offsets, elem: Format, span: int, past_max: int, values, elements) -> tuple:
    """:func:`_fast_elements`' per-element arithmetic (``offsets``: one per block) in numpy passes over 64K
    values at a time: writes
    ``values`` (hi) and ``elements`` (the codes); (flat indices rounded past max, flat indices below min
    normal)."""
    m, uint, u16 = elem.mantissa_bits, np.uint32, np.uint16
    lowest, below = 1 << m, 8 + m
    split = np.float32(2.0 ** (23 - m) + 1)
    width = blocks.shape[1]
    step = max(1, _ELEMENT_VALUES // width)
    size = min(step, len(blocks)) * width
    scratch, low, off = np.empty(size, _F32), np.empty(size, u16), np.empty(size, bool)
    offsets = np.repeat(offsets, width)  # one per element: a flat subtract is 4x one broadcast over 32-value rows
    below_min, past_max_at = [], []
    for start in range(0, len(blocks), step):
        rows = slice(start, start + step)
        k = min(step, len(blocks) - start) * width
        x, c, q, z = blocks[rows], scratch[:k].reshape(-1, width), low[:k], off[:k]
        hi = values[rows]
        np.multiply(x, split, out=c)
        np.subtract(c, x, out=hi)
        np.subtract(c, hi, out=hi)                                     # x rounded to m + 1 bits
        np.right_shift(hi.view(uint), uint(23 - m), out=q.reshape(-1, width), casting="unsafe")
        np.subtract(q, offsets[start * width:start * width + k], out=q)
        magnitude_code = c.view(u16).reshape(-1)[:k]                   # (c is free again)
        np.bitwise_and(q, u16((1 << below) - 1), out=magnitude_code)
        np.greater(magnitude_code, u16(span), out=z)                   # past max, or below min normal
        outside = np.flatnonzero(z) if z.any() else None
        past = None if outside is None else magnitude_code[outside] <= u16(past_max)
        np.add(magnitude_code, u16(lowest), out=magnitude_code)
        np.right_shift(q, u16(below - (elem.bits - 1)), out=q)         # the sign to the code's top bit
        np.bitwise_and(q, u16(1 << (elem.bits - 1)), out=q)
        np.bitwise_or(magnitude_code, q, out=magnitude_code)
        np.copyto(elements[rows].reshape(-1), magnitude_code, casting="unsafe")
        if outside is not None:
            outside += start * width
            past_max_at.append(outside[past])
            below_min.append(outside[~past])
    empty = np.empty(0, np.intp)
    return (np.concatenate(past_max_at) if past_max_at else empty, np.concatenate(below_min) if below_min else empty)


def _compiled_element_pass(blocks, offsets, scales, elem: Format, span: int, past_max: int, values,
                           elements) -> tuple:
    """:func:`_numpy_element_pass`, :func:`_saturate` and the elements below min normal in one compiled pass
    (fpemu_mx_elements, fpemu/formats/_ckernels.c): (no indices past max, none below min normal)."""
    KERNELS.fpemu_mx_elements(blocks.reshape(-1), offsets, np.ascontiguousarray(scales, _F32), len(blocks),
                              blocks.shape[1], elem.mantissa_bits, elem.bits, elem.emin, span, past_max,
                              elem.max_finite_code, elem.max_finite, values.reshape(-1), elements.reshape(-1))
    empty = np.empty(0, np.intp)
    return empty, empty


def _subnormal_elements(at, flat_blocks, flat_values, flat_elements, scales, width: int, elem: Format) -> None:
    """The elements at flat indices ``at`` below elem's min normal, as the compiled element pass rounds them
    (fpemu/formats/_ckernels.c element_block): y = |x| * 2**-X (exact, or a float32 subnormal far below
    elem's least value, which rounds to 0 either way) plus t = 2**(emin - m + 23), whose float32 ulp is
    elem's least value, rounds to it, ties to even; y's bits less t's are the code's magnitude and
    ((y + t) - t) * 2**X the value (exact), x's sign on both."""
    scale = scales[at // width]
    inverse = (np.uint32(254 << 23) - scale.view(np.uint32)).view(_F32)   # 2**-X: scale's mantissa is 0
    t = _F32(2.0 ** (elem.emin - elem.mantissa_bits + 23))
    x = flat_blocks[at]
    y = np.abs(x) * inverse + t
    sign = np.where(np.signbit(x), np.uint32(1 << (elem.bits - 1)), np.uint32(0))
    flat_elements[at] = (y.view(np.uint32) - t.view(np.uint32)) | sign
    flat_values[at] = np.copysign((y - t) * scale, x)


def _saturate(at, flat_blocks, flat_values, flat_elements, scales, width: int, elem: Format) -> None:
    """The elements at flat indices ``at`` rounded past max: max's code and max * scale, x's sign."""
    negative = np.signbit(flat_blocks[at])
    flat_elements[at] = np.where(negative, elem.max_finite_code | (1 << (elem.bits - 1)), elem.max_finite_code)
    peak_value = _F32(elem.max_finite) * scales[at // width]
    flat_values[at] = np.where(negative, -peak_value, peak_value)


def _magnitude_bits(blocks: np.ndarray) -> np.ndarray:
    """|x|'s bit patterns (the sign bit cleared): they order as the magnitudes, NaN above inf."""
    uint = np.dtype(f"uint{8 * blocks.dtype.itemsize}").type
    return np.bitwise_and(blocks.view(uint), uint(np.iinfo(uint).max >> 1))


def _block_peak(blocks: np.ndarray) -> np.ndarray:
    """The integer max of each block's (last axis) :func:`_magnitude_bits`: one compiled pass
    (fpemu_block_peak) for C-contiguous float32 blocks where the compiled loops were built; else a
    power-of-two block is folded in neighbouring pairs along the flat array, one long strided pass per
    halving: twice the speed of numpy's reduction along a short axis, which loops per block (an integer
    max is exact in any order).
    """
    if KERNELS is not None and blocks.dtype == _F32 and blocks.flags.c_contiguous and blocks.size:
        peak = np.empty(blocks.shape[:-1], np.uint32)
        KERNELS.fpemu_block_peak(blocks.reshape(-1), peak.size, blocks.shape[-1], peak.reshape(-1))
        return peak
    magnitude = _magnitude_bits(blocks)
    width = magnitude.shape[-1]
    if width & (width - 1) or not magnitude.flags.c_contiguous:
        return magnitude.max(axis=-1)
    folded = magnitude.reshape(-1)
    while width > 1:
        folded = np.maximum(folded[0::2], folded[1::2])
        width //= 2
    return folded.reshape(magnitude.shape[:-1])


def _block_amax(blocks: np.ndarray, peak: np.ndarray, nan: str) -> np.ndarray:
    """max |x| per block (last axis) from ``peak``, the integer max of its :func:`_magnitude_bits`
    (one reduction, twice the speed of a float max, which branches on NaN), NaN as rule.amax_nan says:
    ``"propagate"`` (a NaN in the block makes amax NaN, as torch.amax) or ``"ignore"`` (fmaxf: NaN is
    left out, NaN only for all-NaN blocks; the rare blocks with NaN are redone with NaN's bits set to
    0: numpy 2.4's np.fmax.reduce is no fmaxf fold, it can skip values next to a NaN)."""
    amax = peak.view(blocks.dtype)
    if nan == "ignore":
        with_nan = np.isnan(amax)
        if with_nan.any():
            bits = _magnitude_bits(blocks[with_nan])
            is_nan = bits > np.array(np.inf, blocks.dtype).view(bits.dtype)
            bits[is_nan] = 0
            amax = amax.copy()
            amax[with_nan] = np.where(is_nan.all(axis=-1), np.nan, bits.max(axis=-1).view(blocks.dtype))
    return amax


def _e8m0_values(codes: np.ndarray) -> np.ndarray:
    """2**(code - 127) in float32 (2**-127 is a float32 subnormal), NaN for 0xFF (torchao's get_fp_scale)."""
    values = (codes.astype(np.uint32) << np.uint32(23)).view(_F32)   # 2**(code - 127) for codes 1..254
    values = np.where(codes == 0, _F32(2.0**-127), values)
    return np.where(codes == _E8M0_NAN, _F32(np.nan), values)


def _biased(unbiased: np.ndarray, amax: np.ndarray, clamp_high: int) -> np.ndarray:
    """Clamp an exponent to e8m0's range, bias it, and give NaN amax the NaN code."""
    biased = np.clip(unbiased, -_E8M0_BIAS, clamp_high) + _E8M0_BIAS
    return np.where(np.isnan(amax), _E8M0_NAN, biased)


def _exact_floor(amax: np.ndarray, elem: Format) -> np.ndarray:
    finite = np.isfinite(amax) & (amax > 0)
    exponent = np.frexp(np.where(finite, amax, 1.0))[1] - 1 - elem.emax
    biased = np.where(finite, np.clip(exponent, -_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS, 0)
    return np.where(np.isfinite(amax), biased, _E8M0_NAN)


def _field_exponent(amax: np.ndarray) -> tuple:
    bits = amax.astype(_F32).view(np.int32)
    return ((bits >> 23) & 0xFF) - 127, bits


def _torchao_floor(amax, elem):
    exponent, _ = _field_exponent(amax)
    return _biased(exponent - elem.emax, amax, _E8M0_BIAS + 1)  # (+1: torchao's room for NaN)


def _torchao_ceil(amax, elem):
    exponent, bits = _field_exponent(amax)
    return _biased(exponent + ((bits & 0x7FFFFF) > 0) - elem.emax, amax, _E8M0_BIAS + 1)


def _torchao_even(amax, elem):
    bits = amax.astype(_F32).view(np.uint32)
    rounded = ((bits + np.uint32(1 << (23 - elem.mantissa_bits - 1))) & np.uint32(0x1FF << 23)).view(_F32)
    return _torchao_floor(np.where(np.isnan(amax), _F32(np.nan), rounded), elem)


def _torchao_rceil(amax, elem):
    descale = amax.astype(_F32) / _F32(elem.max_finite)
    exponent = ceil_log2(descale)                             # torch's float32 log2, ceiled
    biased = np.clip(np.nan_to_num(exponent, posinf=0, neginf=-_E8M0_BIAS), -_E8M0_BIAS, _E8M0_BIAS) + _E8M0_BIAS
    biased = np.where(np.isinf(descale), 254, biased)
    return np.where(np.isnan(descale), _E8M0_NAN, biased).astype(np.int64)


def _te_float_to_e8m0(amax, elem):
    value = amax.astype(_F32) * _F32(1.0 / _F32(elem.max_finite))
    bits = value.view(np.uint32)
    exponent = (bits >> np.uint32(23)).astype(np.int64)
    mantissa = bits & np.uint32(0x7FFFFF)
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    codes = exponent + up
    codes = np.where(value == 0, 0, codes)
    codes = np.where(np.isinf(value), 0xFE, codes)
    return np.where(np.isnan(value), 0xFF, codes)


def _te_reference_e8m0(amax, elem):
    """TE's reference ``_float_to_e8m0``: :func:`_te_float_to_e8m0`'s rounding on fl32(amax / max), in int32
    with no inf or NaN case: inf keeps exponent 255 and NaN's 255 rounds up to 256, byte 0 once cast to uint8."""
    value = amax.astype(_F32) / _F32(elem.max_finite)
    bits = value.view(np.uint32)
    exponent = (bits >> np.uint32(23)).astype(np.int64) & 0xFF
    mantissa = bits & np.uint32(0x7FFFFF)
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    return np.where(value == 0, 0, (exponent + up) & 0xFF)


_EXPONENT_RULES = {"floor": _exact_floor, "torchao_floor": _torchao_floor, "torchao_ceil": _torchao_ceil,
                   "torchao_even": _torchao_even, "torchao_rceil": _torchao_rceil, "te": _te_float_to_e8m0,
                   "te_reference": _te_reference_e8m0}


def _apply_exact(blocks, codes, elem, rule):
    return blocks / _e8m0_values(codes).astype(blocks.dtype)[..., None]  # (0xFF: NaN)


def _apply_divide(blocks, codes, elem, rule):
    scale = (codes.astype(np.int32) << 23).view(_F32)      # 0xFF: inf
    scale = np.maximum(scale, _F32(2.0**-126))             # torchao's clamp to F32_MIN_NORMAL
    return blocks / scale[..., None]  # (torchao's clamp to +-max: the saturating element rounding)


def _apply_reciprocal(blocks, codes, elem, rule):
    rcp = ((254 - codes.astype(np.int32)).clip(0) << 23).view(_F32)
    rcp = np.where(codes == 254, _F32(2.0**-127), rcp)
    rcp = np.where(codes == 0, _F32(rule.rcp_byte0), rcp)
    rcp = np.where(codes == _E8M0_NAN, _F32(np.nan), rcp)
    return _times(blocks, rcp)  # (the clamp to +-max: the saturating element rounding)


def _times(blocks: np.ndarray, multiplier: np.ndarray) -> np.ndarray:
    """fl32(x * m) per block, as torch's CPU multiply: a NaN multiplier's own NaN comes out whatever x
    is (numpy's multiply would keep a NaN x's instead)."""
    product = blocks * multiplier[..., None]
    return np.where(np.isnan(multiplier)[..., None], multiplier[..., None], product)


def _apply_te_reference(blocks, codes, elem, rule):
    """x / torch.pow(2, code - 127) in float32: code 255 divides by inf (x's saturating cast follows:
    torch 2.13's e4m3fn cast saturates finite values and inf to 448, as the rule's rounding does)."""
    scale = np.where(codes == _E8M0_NAN, _F32(np.inf), _e8m0_values(codes))
    return blocks / scale[..., None]


_APPLY = {"exact": _apply_exact, "divide": _apply_divide, "reciprocal": _apply_reciprocal,
          "te_reference": _apply_te_reference}


def _nvfp4(blocks: np.ndarray, elem: Format, rule: ScaleRule, tensor_amax, values: np.ndarray):
    """e4m3-scaled fp4 blocks, torchao's nvfp4_quantize (one or two levels); :func:`_mx`'s tuple."""
    e4m3 = get_format("fp8_e4m3fn")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        amax = _block_peak(blocks).view(blocks.dtype)  # (NaN if the block holds one)
        block_scale = amax / _F32(elem.max_finite)
        tensor_scale = None
        if rule.levels == 2:
            tensor_scale = tensor_amax / _F32(e4m3.max_finite * elem.max_finite)
            block_scale = block_scale / tensor_scale
        clamped = np.clip(block_scale, _F32(e4m3.min_normal), _F32(e4m3.max_finite))
        codes = encode(clamped, e4m3, nan=0x7F).astype(np.uint8)
        scales = _torch_e4m3_values(codes)
        reciprocal = _F32(1.0) / scales if rule.levels == 1 else (_F32(1.0) / tensor_scale) / scales
        data = np.clip(_times(blocks, reciprocal), -_F32(elem.max_finite), _F32(elem.max_finite))
        dequant_scale = scales if rule.levels == 1 else tensor_scale * scales
        elements, _ = _element_codes(data, elem, rule)
        # (from the codes: a NaN-born code is a finite value, which a zero tensor scale keeps finite)
        np.multiply(decode(elements, elem, dtype=_F32), dequant_scale[..., None], out=values)
    return codes, scales, elements, values, None if tensor_scale is None else float(tensor_scale)


def _torch_e4m3_values(codes: np.ndarray) -> np.ndarray:
    """e4m3fn codes as torch widens them to float32: its NaN is 0x7FFFFFFF (0xFFFFFFFF for 0xFF),
    whose bits torchao's fp4 cast later turns into code 0x4 (0xC)."""
    values = decode(codes, "fp8_e4m3fn", dtype=_F32)
    nan_bits = np.where(codes & 0x80, np.uint32(0xFFFFFFFF), np.uint32(0x7FFFFFFF)).view(_F32)
    return np.where(np.isnan(values), nan_bits, values)


def _element_codes(data: np.ndarray, elem: Format, rule: ScaleRule, may_hold_nan: bool = True) -> tuple:
    """Element codes of the scaled values, rounded with saturation (torchao's clamp to +-max before
    its cast, CUDA's satfinite), and the element values they stand for (NaN where the code came
    from a NaN)."""
    rounded = quantize(data, elem, rounding=rule.rounding, overflow="saturate")
    codes = codes_of_values(rounded, elem)
    nan = np.isnan(data) if may_hold_nan else None
    if nan is not None and nan.any():
        if rule.nan_element == "torchao" and not elem.has_nan:
            fixed = _torchao_nan_codes(data, elem)
        elif rule.nan_element == "scale":
            fixed = 0
        elif rule.nan_element == "cuda":  # CUDA's cvt: the all-ones magnitude, the sign dropped
            fixed = _nan_code(elem)
        else:  # its NaN code, with the NaN's sign
            fixed = (_nan_code(elem) | np.where(np.signbit(data), 1 << (elem.bits - 1), 0)).astype(codes.dtype)
        codes = np.where(nan, fixed, codes).astype(np.uint8)
    return codes.astype(np.uint8, copy=False), rounded


def _nan_code(elem: Format) -> int:
    """The all-ones magnitude: torch's fp8 casts give NaN 0x7F in e4m3fn and e5m2 alike (not e5m2's
    quiet NaN 0x7E), keeping its sign; CUDA's cvt gives it without the sign (nan_element ``cuda``)."""
    return (1 << (elem.bits - 1)) - 1


def _torchao_nan_codes(data: np.ndarray, elem: Format) -> np.ndarray:
    """What torchao's _f32_to_floatx_unpacked makes of NaN: neither its saturate nor its denormal
    branch takes NaN, so the normal branch's integer arithmetic runs on NaN's bits (canonical
    NaN: fp4 0x3, fp6_e2m3 0xC, fp6_e3m2 0xE; the sign bit is kept)."""
    ebits, mbits = elem.exponent_bits, elem.mantissa_bits
    bits = data.astype(_F32).view(np.int32).astype(np.int64)
    sign = bits & 0x80000000
    magnitude = (bits ^ sign) & 0xFFFFFFFF
    shift = 23 - mbits
    add = ((((1 << (ebits - 1)) - 1) - 127) << 23) + (1 << (shift - 1)) - 1
    normal = ((magnitude + add + ((magnitude >> shift) & 1)) & 0xFFFFFFFF) >> shift
    sign_bit = np.where(sign != 0, 1 << (ebits + mbits), 0)
    return ((normal & 0xFF) | sign_bit).astype(np.uint8)


def _te_nvfp4(blocks: np.ndarray, elem: Format, rule: ScaleRule, tensor_amax, values: np.ndarray):
    """Transformer Engine's NVFP4 (kernel or Python reference, as the rule's fields say): :func:`_mx`'s tuple.

    Both compute in float32 in the same order (the reference was written to match the kernel bit for
    bit); they differ where the kernel's fmaxf and its fp4 cvt meet NaN and -0.0, and in S_enc for an
    all-zero tensor (see the rules' ``departs``).
    """
    e4m3 = get_format("fp8_e4m3fn")
    flt_max = _F32(np.finfo(_F32).max)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        encode_tensor = np.minimum(_F32(e4m3.max_finite * elem.max_finite) / tensor_amax, flt_max)
        if encode_tensor == 0 or (tensor_amax == 0 and rule.exponent == "te_nvfp4"):
            encode_tensor = _F32(1.0)
        if np.isnan(encode_tensor):  # (the reference's: torch.min of one value gives the canonical NaN)
            encode_tensor = np.array(0x7FC00000, np.uint32).view(_F32)[()]
        decode_tensor = _F32(1.0) / encode_tensor
        amax = _block_amax(blocks, _block_peak(blocks), rule.amax_nan)
        block_scale = np.minimum(amax * (encode_tensor * (_F32(1.0) / _F32(elem.max_finite))), flt_max)
        codes = _te_e4m3_codes(block_scale)
        scales = decode(codes, e4m3, dtype=_F32)
        reciprocal = np.minimum(_F32(1.0) / (scales * decode_tensor), flt_max)
        data = np.clip(blocks * reciprocal[..., None], -_F32(elem.max_finite), _F32(elem.max_finite))
        elements = _te_fp4_codes(data, elem, rule)
        dequantize = (scales * tensor_amax) * (_F32(1.0) / _F32(e4m3.max_finite * elem.max_finite))
        np.multiply(decode(elements, elem, dtype=_F32), dequantize[..., None], out=values)
    return codes, scales, elements, values, float(decode_tensor)


def _te_e4m3_codes(block_scale: np.ndarray) -> np.ndarray:
    """e4m3 codes of TE's block scales: the kernel's satfinite cast (finite and inf saturate to 448) and
    the reference's clamp to +-448 and torch cast alike (NaN, which only the reference meets: 0x7F with
    its sign, as torch's cast gives it)."""
    e4m3 = get_format("fp8_e4m3fn")
    return encode(np.clip(block_scale, -_F32(e4m3.max_finite), _F32(e4m3.max_finite)), e4m3, nan=0x7F).astype(np.uint8)


def _te_fp4_codes(data: np.ndarray, elem: Format, rule: ScaleRule) -> np.ndarray:
    """fp4 codes of TE's scaled, clamped elements: the kernel's cvt.rn.satfinite.e2m1x2 (``cuda``: NaN
    becomes +6, code 0x7) or the reference's cast_to_fp4x2 (``te_reference``: NaN and -0.0, which
    ``x >= 0.0`` takes, become code 0)."""
    codes, _ = _element_codes(data, elem, rule)
    if rule.nan_element == "te_reference":
        codes[np.isnan(data) | ((data == 0) & np.signbit(data))] = 0
    return codes


def _microxcaling(blocks: np.ndarray, elem: Format, rule: ScaleRule, tensor_amax, values: np.ndarray):
    """microxcaling's _quantize_mx (PyTorch path, shared_exp_method 'max', round 'nearest') step by step in
    the blocks' own type, as torch computes it there (:class:`_OwnType`): :func:`_mx`'s tuple.

    X = floor(log2(amax, 0 taken as 2**-126)) - emax (above 127 NaN, below -127 -127), y = x / 2**X,
    the element from y (:func:`_microxcaling_elements`), the value element * 2**X.
    """
    own = _OwnType(blocks.dtype)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        x = blocks.astype(own.wide)
        amax = np.abs(x).max(axis=-1)                                       # (NaN propagates)
        shared = own.rounded(own.floor_log2(amax, np.ldexp(1.0, -126)) - elem.emax)
        shared = np.where(shared > _E8M0_BIAS, np.nan, np.maximum(shared, -_E8M0_BIAS))
        scale = own.power(shared)[..., None]
        element = _microxcaling_elements(own.rounded(x / scale), elem, own)
        values[...] = own.rounded(element * scale)
    codes = np.where(np.isnan(shared), _E8M0_NAN, np.nan_to_num(shared) + _E8M0_BIAS).astype(np.uint8)
    elements, _ = _element_codes(element, elem, rule)
    return codes, _e8m0_values(codes), elements, values, None


def _microxcaling_elements(y: np.ndarray, elem: Format, own) -> np.ndarray:
    """microxcaling's _quantize_elemwise_core on y (saturating, subnormals kept, round 'nearest') in own's
    type: e = max(floor(log2(|y|, 0 taken as 1)), emin), t = y / 2**e * 2**m (m mantissa bits), the element
    sign(t) * floor(|t| + 0.5) / 2**m * 2**e (|t| + 0.5 rounds in the type: t just under a half can go up;
    torch.sign(-0.0) is +0, so a zero t gives +0), clamped to +-max, y's infinities kept."""
    exponent = own.floor_log2(np.abs(y), 1.0)
    unit = own.power(np.maximum(exponent, elem.emin))                      # (NaN stays)
    shift = np.ldexp(own.wide(1), elem.mantissa_bits)
    t = own.rounded(own.rounded(y / unit) * shift)
    whole = np.floor(own.rounded(np.abs(t) + own.wide(0.5)))
    signed = np.where(t == 0, own.wide(0), np.copysign(whole, t))          # sign(t) * whole
    element = own.rounded(own.rounded(signed / shift) * unit)
    element = np.clip(element, -own.wide(elem.max_finite), own.wide(elem.max_finite))
    return np.where(np.isinf(y), y, element)


@dataclasses.dataclass(frozen=True)
class _OwnType:
    """torch's arithmetic in a tensor's type ``kind``: float32 and float64 ops in the type itself, bf16 and
    float16 ops in float32, each result rounded back; their log2 likewise.  Values are held in ``wide``
    (the arithmetic's type), each rounded to ``kind`` where torch rounds."""

    kind: np.dtype

    @property
    def wide(self):
        return np.float64 if self.kind == np.float64 else _F32

    def rounded(self, result) -> np.ndarray:
        return np.asarray(result).astype(self.kind, copy=False).astype(self.wide, copy=False)

    def power(self, exponent: np.ndarray) -> np.ndarray:
        """torch.pow(2, exponent) in the type: the exact power of two (in the arithmetic's type, which holds
        every one the exponents here reach), rounded into it."""
        finite = np.isfinite(exponent)
        exact = np.ldexp(self.wide(1), np.where(finite, exponent, 0).astype(np.int32))
        if not finite.all():  # 2**inf = inf, 2**-inf = 0, NaN
            exact = np.where(finite, exact, np.where(np.isnan(exponent), np.nan, np.where(exponent > 0, np.inf, 0)))
        return self.rounded(exact)

    def floor_log2(self, magnitude: np.ndarray, zero_as: float) -> np.ndarray:
        """torch.floor(torch.log2(m + zero_as * (m == 0))) in the type (zero_as rounded into it first)."""
        taken = np.where(magnitude == 0, self.rounded(zero_as), magnitude).astype(self.kind)
        return floor_log2(taken).astype(self.wide)


_BLOCK_ARITHMETIC = {"nvfp4": _nvfp4, "te_nvfp4": _te_nvfp4, "te_nvfp4_reference": _te_nvfp4,
                     "microxcaling": _microxcaling}
