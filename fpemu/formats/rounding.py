"""Bit-exact rounding of float32 / float64 arrays onto any :class:`Format`.

The kernel works on the integer bit patterns of the input (and, below the
format's min normal, on magnitudes scaled exactly to units of its quantum), so
every rounding mode is exact and the result is rounded once, directly from the
input: no double rounding through an intermediate type.  Nearest even, where
the source type has the range for it, lets one float add do the rounding.  Where a native cast is both
correctly rounded and faster (float32 -> bf16, float64 -> float32) the default
mode uses it; the exhaustive sweep in ``benchmarks/exhaustive_float32.py``
checks the kernel against the native casts on all 2**32 float32 inputs.
"""

from __future__ import annotations

import functools
import math
import os
import queue
import threading

from typing import NamedTuple, Optional

import ml_dtypes
import numpy as np

from fpemu.formats._shortcuts import shortcut
from fpemu.formats.format import Format, get_format, max_ends_binade

ROUNDING_MODES = ("nearest_even", "nearest_away", "toward_zero", "up", "down", "stochastic")
OVERFLOW_MODES = ("inf", "saturate")

# Stochastic rounding compares the discarded fraction, in 32-bit fixed point,
# with 32 random bits: probabilities are exact to 2**-32.
_RANDOM_BITS = 32


class _Source(NamedTuple):
    """Bit layout of the array being rounded."""
    uint: type
    mantissa_bits: int
    bias: int
    exponent_mask: int


_SOURCES = {
    np.dtype(np.float32): _Source(np.uint32, 23, 127, 0xFF),
    np.dtype(np.float64): _Source(np.uint64, 52, 1023, 0x7FF),
}

# Native casts used for the default mode: each is correctly rounded (checked
# against the bit kernel on all 2**32 float32 inputs by the exhaustive sweep)
# and measured faster than the kernel (reports/bench_quantize.md).  numpy's
# float32 -> float16 cast is ~20x slower than the kernel here, and ml_dtypes
# before 0.7.0 rounds float64 -> bf16/fp8 twice (through float32; 0.7.0 rounds
# once), so neither is used.
_FAST_NATIVE_CASTS = {
    (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)),
    (np.dtype(np.float64), np.dtype(np.float32)),
}


def _check_modes(rounding: str, overflow: str, seed, subnormals=True) -> None:
    if not isinstance(subnormals, (bool, np.bool_)):
        raise TypeError(f"subnormals must be True or False, got {subnormals!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer))):
        raise TypeError(f"seed must be a non-negative int or None, got {type(seed).__name__} {seed!r}")
    if seed is not None and seed < 0:
        raise ValueError(f"seed must be a non-negative int or None, got {seed!r}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    if seed is not None and rounding != "stochastic":
        raise ValueError(f"seed is only used with rounding='stochastic', got rounding={rounding!r}")


def as_float_array(x, argument: str = "x") -> np.ndarray:
    """x as a float32 or float64 array.

    float32 and float64 arrays pass through; float16, bf16 and fp8 arrays are
    widened exactly to float32; Python numbers and lists become float64.

    Raises:
      TypeError: integer, bool, complex or object arrays.
    """
    arr = np.asarray(x)
    if arr.dtype == np.float32 or arr.dtype == np.float64:
        return arr
    if arr.dtype.kind == "f" or arr.dtype in _WIDENABLE:
        return arr.astype(np.float32)
    if arr.dtype.kind in "iu" and not isinstance(x, (np.ndarray, np.generic)):
        return arr.astype(np.float64)
    raise TypeError(
        f"{argument} must hold floating-point values (a float32 or float64 array, or Python "
        f"numbers); got dtype {arr.dtype}")


_WIDENABLE = {np.dtype(getattr(ml_dtypes, name)) for name in dir(ml_dtypes)
              if name.startswith(("bfloat16", "float8", "float6", "float4"))}


def quantize(x, fmt, *, rounding: str = "nearest_even", overflow: str = "inf",
             subnormals: bool = True, seed: Optional[int] = None) -> np.ndarray:
    """Round every element of ``x`` to a value of ``fmt``.

    Args:
      x: float32 or float64 array, or Python floats; float16/bf16/fp8 arrays are
        widened to float32 first (exactly).
      fmt: a :class:`Format` or a format name such as ``"bf16"``.
      rounding: ``nearest_even`` (IEEE default), ``nearest_away``, ``toward_zero``,
        ``up`` (toward +inf), ``down`` (toward -inf) or ``stochastic`` (rounds up
        with probability proportional to the distance from the lower neighbour).
      overflow: ``inf``: IEEE overflow (for fn/fnuz formats, which have no
        infinity, the format's NaN, as ml_dtypes does); directed modes give the
        largest finite value where IEEE says so.  ``saturate``: clamp to
        +-max finite, infinities included (as CUDA's SATFINITE conversions).
        Formats with neither infinity nor NaN (``finite``) always saturate.
      subnormals: False flushes results below the smallest normal to signed zero.
      seed: seed of the stochastic rounding; None draws fresh entropy.

    Returns:
      An array of x's dtype (float32 or float64; float64 for Python numbers)
      holding the rounded values.  A value of a format wider than float32
      that lies beyond float32's range is inf in a float32 result.

    Example:
      >>> quantize([65519.996, 65520.0], "fp16").tolist()
      [65504.0, inf]
    """
    fmt = get_format(fmt)
    _check_modes(rounding, overflow, seed, subnormals)
    arr = as_float_array(x)
    if _use_native_cast(arr.dtype, fmt, rounding, overflow, subnormals):
        with np.errstate(over="ignore", invalid="ignore"):
            return arr.astype(fmt.dtype).astype(arr.dtype)
    if (rounding == "stochastic" and overflow == "inf" and subnormals and arr.dtype == np.float32
            and fmt.dtype == np.dtype(ml_dtypes.bfloat16)):
        return _stochastic_bf16(arr, seed)
    short = shortcut(arr, fmt, rounding, overflow, subnormals)
    if short is not None:
        return short
    return _round_array(arr, fmt, rounding, overflow, subnormals, seed, flags=False).values


# Elements per block of the stochastic bf16 path: large enough that handing each block's draws
# over from the worker thread costs little next to drawing them.
_STOCHASTIC_BLOCK = 1 << 19


def _stochastic_bf16(arr: np.ndarray, seed) -> np.ndarray:
    """Stochastic rounding of float32 to bf16: add 16 random bits below bf16's last bit, truncate.

    bf16 is float32's top 16 bits, so its values are evenly spaced in float32's bit patterns
    across every binade and the subnormals: adding r uniform in [0, 2**16) to the magnitude's
    bits and clearing the low 16 rounds up with probability remainder / 2**16, exactly (the
    remainder has 16 bits).  A carry crosses binades and reaches inf past max finite, as
    rounding up should; infinities stay infinite.  NaN inputs are restored afterwards (a
    low-payload NaN could otherwise turn into inf).  Draws come from SFC64, 16 bits each;
    a worker thread draws the next block's and looks for NaN in it while this one is rounded.
    """
    flat = arr.reshape(-1)
    bits = flat.view(np.uint32)
    out = np.empty_like(bits)
    generator = np.random.SFC64(seed)
    mask = np.uint32(0xFFFF0000)
    blocks = [slice(start, min(start + _STOCHASTIC_BLOCK, flat.size))
              for start in range(0, flat.size, _STOCHASTIC_BLOCK)]

    def draw(block: slice):
        count = block.stop - block.start
        peak = flat[block].max()  # NaN if any element is NaN (and the block is now in cache)
        return generator.random_raw((count + 3) // 4).view(np.uint16)[:count], peak != peak

    for block, (draws, has_nan) in zip(blocks, _prefetched(draw, blocks)):
        rounded = out[block]
        np.add(bits[block], draws, out=rounded)
        np.bitwise_and(rounded, mask, out=rounded)
        if has_nan:
            nan = np.isnan(flat[block])
            rounded[nan] = bits[block][nan] | np.uint32(0x7FC00000)
    return out.view(np.float32).reshape(arr.shape)


def _prefetched(produce, items):
    """Yield ``produce(item)`` for each item in turn, the next ones made on a worker thread
    while the caller works on the current one.

    numpy's bit generators and ufuncs release the GIL, so drawing random bits overlaps the
    rounding on a second core.  The calls run one after another in order, so the results
    are those of a plain loop: a seeded stream does not depend on the threading.  The worker
    stays at most two items ahead and lives for this call only (a thread left running would
    make every later fork, such as a DataLoader's, warn); with one usable CPU or one item
    there is none.
    """
    if len(items) < 2 or _usable_cpus() < 2:
        yield from (produce(item) for item in items)
        return
    made = queue.SimpleQueue()
    room = threading.Semaphore(2)
    abandoned = threading.Event()

    def work():
        for item in items:
            room.acquire()
            if abandoned.is_set():
                return
            try:
                made.put((produce(item), None))
            except BaseException as error:  # handed to the caller, which raises it
                made.put((None, error))
                return

    worker = threading.Thread(target=work, name="fpemu-draws", daemon=True)
    worker.start()
    try:
        for _ in items:
            value, error = made.get()
            if error is not None:
                raise error
            room.release()
            yield value
    finally:
        abandoned.set()
        room.release()  # wakes a worker waiting for room, which then sees it is abandoned
        worker.join()


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _use_native_cast(dtype, fmt: Format, rounding, overflow, subnormals) -> bool:
    return (rounding == "nearest_even" and overflow == "inf" and subnormals
            and (dtype, fmt.dtype) in _FAST_NATIVE_CASTS)


class Rounded(NamedTuple):
    """Result of :func:`round_to_format`: the values and which elements overflowed.

    ``overflowed`` follows IEEE: the rounded magnitude, with the exponent range
    unbounded, exceeds max finite (whatever the overflow mode then returns),
    or the input was infinite.
    """
    values: np.ndarray
    overflowed: np.ndarray


def round_to_format(arr: np.ndarray, fmt: Format, rounding: str = "nearest_even",
                    overflow: str = "inf", subnormals: bool = True,
                    seed: Optional[int] = None) -> Rounded:
    """The generic bit-level kernel behind :func:`quantize` (never a native cast)."""
    _check_modes(rounding, overflow, seed, subnormals)
    return _round_array(arr, fmt, rounding, overflow, subnormals, seed, flags=True)


def _round_array(arr: np.ndarray, fmt: Format, rounding, overflow, subnormals, seed,
                 flags: bool) -> Rounded:
    """:func:`round_to_format`; with flags False the overflow flags may be left out (None)."""
    if arr.dtype == np.float32 and _rounds_in_float64(fmt):
        with np.errstate(invalid="ignore"):  # (a signalling NaN's widening flags invalid: it stays NaN)
            widened = arr.astype(np.float64)
        wide = _round_array(widened, fmt, rounding, overflow, subnormals, seed, flags)
        with np.errstate(over="ignore"):  # a value of fmt beyond float32's range is inf in the float32 result
            return Rounded(wide.values.astype(np.float32), wide.overflowed)
    if not (fmt.signed and fmt.has_zero):
        return _round_onto_positive(arr, fmt, rounding, overflow, subnormals, seed, flags)
    return _round_signed(arr, fmt, rounding, overflow, subnormals, seed, flags)


def _rounds_in_float64(fmt: Format) -> bool:
    """Formats float32 inputs are rounded onto in float64 (which holds every float32 exactly): those
    reaching below float32's normal range or keeping all its bits, and those whose min normal is
    beyond float32's range (float32 arithmetic would take their values, all inf in float32, for one)."""
    source = _SOURCES[np.dtype(np.float32)]
    return (fmt.emin + source.bias < 1 or fmt.mantissa_bits >= source.mantissa_bits
            or fmt.emin > source.bias)


def _round_onto_positive(arr: np.ndarray, fmt: Format, rounding, overflow, subnormals, seed,
                         flags: bool) -> Rounded:
    """Formats without a sign bit or without a zero: the kernel rounds the input (its magnitude in
    an unsigned format, raised to min normal where there is no zero: it is the nearest value, and
    the only one beyond it in every mode), then values no code holds become NaN: negative inputs in an unsigned format, and
    zeros in a format without zero (as ml_dtypes' float8_e8m0fnu; torch's e8m0 cast maps 0 to code
    0 and x < 0 to |x|'s code instead)."""
    with np.errstate(invalid="ignore"):
        operand = arr if fmt.signed else np.abs(arr)
        if not fmt.has_zero:  # (NaN stays NaN)
            lowest = np.copysign(arr.dtype.type(fmt.min_normal), operand)
            operand = np.where(np.abs(operand) < fmt.min_normal, lowest, operand)
        rounded = _round_signed(operand, fmt, rounding, overflow, subnormals, seed, flags)
        no_code = arr < 0 if not fmt.signed else np.zeros(arr.shape, bool)
        if not fmt.has_zero:
            no_code |= arr == 0
    values = rounded.values
    if no_code.any():
        values = np.where(no_code, values.dtype.type(np.nan), values)
    overflowed = None if rounded.overflowed is None else rounded.overflowed & ~no_code
    return Rounded(values, overflowed)


def _round_signed(arr: np.ndarray, fmt: Format, rounding, overflow, subnormals, seed,
                  flags: bool) -> Rounded:
    """The kernel proper, on formats with a sign bit and a zero (and on magnitudes for others)."""
    if not (fmt.has_inf or fmt.has_nan):
        overflow = "saturate"  # max finite is the only result beyond it (and ml_dtypes' choice)
    source = _SOURCES[arr.dtype]  # (float32 only for formats inside its range: _round_array)
    flat = arr.reshape(-1)
    if _max_finite_fits(arr.dtype, fmt):  # else the general kernel, _round_bits
        # Draws made block by block: the same stream as _random_draws, never all in memory.
        bits = np.random.default_rng(seed).bit_generator if rounding == "stochastic" else None
        values, overflowed = _round_fast(flat, fmt, rounding, overflow, subnormals, bits, flags)
        return Rounded(values.reshape(arr.shape),
                       None if overflowed is None else overflowed.reshape(arr.shape))
    draws = _random_draws(flat.size, seed) if rounding == "stochastic" else None
    values = np.empty_like(flat)
    overflowed = np.empty(flat.shape, dtype=bool)
    # Blocks that stay in cache make the ~25 elementwise passes about twice as fast.
    for start in range(0, flat.size, _BLOCK):
        block = slice(start, start + _BLOCK)
        out = _round_bits(flat[block], fmt, source, rounding, overflow, subnormals,
                          None if draws is None else draws[block])
        values[block], overflowed[block] = out
    return Rounded(values.reshape(arr.shape), overflowed.reshape(arr.shape))


_BLOCK = 1 << 16


def _random_draws(size: int, seed) -> np.ndarray:
    """``size`` independent uniform 32-bit draws (uint32), two from each 64-bit PCG64 output."""
    raw = np.random.default_rng(seed).bit_generator.random_raw((size + 1) // 2)
    return raw.view(np.uint32)[:size]


def _max_finite_fits(dtype, fmt: Format) -> bool:
    """Whether fmt's max finite is finite in ``dtype``.  The fast kernel needs it (infinite inputs
    must compare above max finite), and so do float results that hold all of fmt's values."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.array(fmt.max_finite, dtype=dtype)))


# Elements per block of the fast kernel: its few scratch arrays stay in L2.
_FAST_BLOCK = 1 << 16


def _constant_row(value) -> np.ndarray:
    """A read-only block-sized array of the numpy scalar ``value``, made once per value and type."""
    return _cached_row(value.dtype.str, value.item())


@functools.lru_cache(maxsize=64)
def _cached_row(dtype: str, value) -> np.ndarray:
    row = np.full(_FAST_BLOCK, value, dtype=dtype)
    row.flags.writeable = False
    return row


_THREAD_SCRATCH = threading.local()


def _scratch_buffers(dtype: np.dtype) -> tuple:
    """The fast kernel's block-sized scratch arrays for source type dtype, made once per thread.

    Reusing them keeps a quantize call down to one allocation, its result: fresh scratch
    (1.1 MB for float32) raises every caller's peak memory and, when glibc trims the heap
    between calls, costs page faults each time.
    """
    buffers = _THREAD_SCRATCH.__dict__.setdefault("buffers", {})
    if dtype not in buffers:
        uint = _SOURCES[dtype].uint
        buffers[dtype] = (np.empty(_FAST_BLOCK, dtype), np.empty(_FAST_BLOCK, dtype), np.empty(_FAST_BLOCK, dtype),
                          np.empty(_FAST_BLOCK, uint), np.empty(_FAST_BLOCK, bool))
    return buffers[dtype]


class _Plan(NamedTuple):
    """What :func:`_round_fast` needs of one (source type, format, modes) case (immutable, cached)."""
    ftype: type
    uint: type
    sint: type
    width: int
    m: int
    drop: int
    rounding: str
    overflow: str
    by_addition: bool             # nearest even by one float add (_round_block_by_addition)
    directed: bool
    stochastic: bool
    signed_sub: bool              # the subnormal part keeps the sign (rint, trunc, ceil, floor of x)
    integer_round: object
    low_mask: object
    keep_mask: object
    sign_bit: object
    magnitude_mask: object
    max_bits: object
    nan_bits: object
    min_normal: object
    min_normal_bits: object
    max_finite: object
    q: object                     # fmt's min subnormal
    ne_bias: object
    half_step: object
    scales: tuple                 # 1/q = 2**(m - emin) in factors the source type can hold
    least: object                 # where 1/q < 1: the source's least value, for what it takes to 0
    clamp: object                 # by_addition: 2**(emax + 1), a magnitude that overflows anyway
    exponent_field: object
    to_quantum: object            # by_addition: 2**drop
    to_fixed: object              # stochastic: 2**32
    shift_left: object
    shift_right: object
    overflow_fix: Optional[str]   # how a block without NaN overflows, without flags
    scale_up: object
    scale_down: object
    # block-long constant rows: numpy's minimum / maximum are several times faster against an
    # array than against a scalar
    min_normal_row: np.ndarray
    neg_min_normal_row: np.ndarray
    min_normal_bits_row: np.ndarray
    clamp_row: Optional[np.ndarray]


@functools.lru_cache(maxsize=64)
def _plan(dtype: np.dtype, fmt: Format, rounding: str, overflow: str) -> _Plan:
    """The constants of :func:`_round_fast` for source type ``dtype``, ``fmt`` and the modes.

    Made once per case (cached): making it costs more than rounding a few hundred values.
    """
    ftype = dtype.type
    source = _SOURCES[dtype]
    uint = source.uint
    width = 8 * dtype.itemsize
    m = fmt.mantissa_bits
    drop = source.mantissa_bits - m
    max_exponent = int(np.finfo(dtype).maxexp) - 1
    scales, exponent = [], m - fmt.emin
    while exponent > max_exponent:
        scales.append(ftype(math.ldexp(1.0, max_exponent)))
        exponent -= max_exponent
    scales.append(ftype(math.ldexp(1.0, exponent)))
    overflow_fix, scale_up, scale_down = None, None, None
    if overflow == "saturate":
        overflow_fix = "clip"
    elif rounding == "toward_zero":
        overflow_fix = "clip_finite"                         # infinite inputs stay infinite
    elif rounding in ("nearest_even", "nearest_away", "stochastic"):
        if not fmt.has_inf:
            overflow_fix = "nan"
        elif max_exponent - fmt.emax <= max_exponent and max_ends_binade(fmt):
            # (the scaling overflows from 2**(emax + 1) on: right only where max finite ends its binade)
            overflow_fix = "scale"
            scale_up = ftype(math.ldexp(1.0, max_exponent - fmt.emax))
            scale_down = ftype(math.ldexp(1.0, fmt.emax - max_exponent))
    # C = 2**(E + drop) in _round_block_by_addition must stay finite up to the clamp at 2**(emax + 1).
    by_addition = rounding == "nearest_even" and fmt.emax + 1 + drop <= max_exponent
    clamp = ftype(math.ldexp(1.0, fmt.emax + 1)) if by_addition else None
    min_normal, min_normal_bits = ftype(fmt.min_normal), uint(_bits_of(fmt.min_normal, dtype))
    return _Plan(
        ftype=ftype, uint=uint, sint=np.dtype(f"int{width}").type, width=width, m=m, drop=drop,
        rounding=rounding, overflow=overflow, by_addition=by_addition, directed=rounding in ("up", "down"),
        stochastic=rounding == "stochastic", signed_sub=rounding in ("nearest_even", "toward_zero", "up", "down"),
        integer_round={"nearest_even": np.rint, "toward_zero": np.trunc, "nearest_away": np.trunc,
                       "stochastic": np.floor, "up": np.ceil, "down": np.floor}[rounding],
        low_mask=uint((1 << drop) - 1), keep_mask=uint(((1 << width) - 1) ^ ((1 << drop) - 1)),
        sign_bit=uint(1 << (width - 1)), magnitude_mask=uint((1 << (width - 1)) - 1),
        max_bits=uint(_bits_of(fmt.max_finite, dtype)), nan_bits=uint(_bits_of(np.nan, dtype)),
        min_normal=min_normal, min_normal_bits=min_normal_bits,
        max_finite=ftype(fmt.max_finite), q=ftype(_subnormal_quantum(fmt)),
        ne_bias=uint((1 << (drop - 1)) - 1), half_step=uint(1 << (drop - 1)), scales=tuple(scales),
        least=ftype(np.finfo(dtype).smallest_subnormal) if m < fmt.emin else None,
        clamp=clamp,
        exponent_field=uint(source.exponent_mask << source.mantissa_bits), to_quantum=ftype(math.ldexp(1.0, drop)),
        to_fixed=ftype(math.ldexp(1.0, _RANDOM_BITS)), shift_left=uint(max(_RANDOM_BITS - drop, 0)),
        shift_right=uint(max(drop - _RANDOM_BITS, 0)),
        overflow_fix=overflow_fix, scale_up=scale_up, scale_down=scale_down,
        min_normal_row=_constant_row(min_normal), neg_min_normal_row=_constant_row(-min_normal),
        min_normal_bits_row=_constant_row(min_normal_bits),
        clamp_row=_constant_row(clamp) if by_addition else None)


class _Block(NamedTuple):
    """One block's input x and result r, with block-long scratch."""
    x: np.ndarray
    r: np.ndarray
    a: np.ndarray                 # |x|
    t: np.ndarray
    y: np.ndarray
    u: np.ndarray                 # unsigned scratch
    g: np.ndarray                 # bool scratch
    d: Optional[np.ndarray]       # 32-bit random draws (stochastic)


def _round_fast(flat: np.ndarray, fmt: Format, rounding, overflow, subnormals, random_bits,
                flags: bool = True):
    """The kernel for the common cases: a dozen cache-resident passes per block, no np.where.

    Each block is rounded by :func:`_round_block_by_addition` (nearest even, where the format's
    range allows: fp16, fp8, e6m9, not bf16) or by :func:`_round_block_bits` (any mode); then
    :func:`_finish_block` puts the sign back and handles flush-to-zero, -0 in fnuz formats, NaN
    and overflow, only in blocks that have them.  Without flags (quantize) the overflowed array
    is not formed (None).
    """
    plan = _plan(flat.dtype, fmt, rounding, overflow)
    n = flat.size
    values = np.empty_like(flat)
    overflowed = np.zeros(n, dtype=bool) if flags else None
    size = max(min(_FAST_BLOCK, n), 1)                      # even, but for a lone last block
    scratch = _scratch_buffers(flat.dtype)
    with np.errstate(all="ignore"):
        for start in range(0, n, size):
            stop = min(start + size, n)
            k = stop - start
            draws = random_bits.random_raw((k + 1) // 2).view(np.uint32)[:k] if plan.stochastic else None
            a, t, y, u, g = scratch
            block = _Block(flat[start:stop], values[start:stop], a[:k], t[:k], y[:k], u[:k], g[:k], draws)
            np.abs(block.x, out=block.a)
            highest = block.a.max()                          # NaN if any element is NaN
            has_nan = highest != highest
            if plan.by_addition:
                _round_block_by_addition(plan, block, clamp=not highest < plan.clamp)  # (NaN: clamp)
                signed = False
            else:
                signed = _round_block_bits(plan, block, has_nan)
            _finish_block(plan, fmt, block, signed, subnormals, has_nan, highest, flags, overflowed, start)
    return values, overflowed


def _round_block_by_addition(plan: _Plan, block: _Block, clamp: bool) -> None:
    """Nearest even by the hardware's own rounding, on the magnitudes: for |x| whose quantum in
    fmt is 2**E (E = max(exponent of x, emin) - m), adding C = 2**(E + drop) leaves a sum whose
    float ulp is that quantum, so the float add rounds |x| to nearest even in fmt; subtracting C
    is exact.  The sign is left off."""
    a, r, k = block.a, block.r, len(block.a)
    big_r = r.view(plan.uint)
    if clamp:
        np.minimum(a, plan.clamp_row[:k], out=a)             # keeps C finite; still overflows
    # C = 2**(max(exponent of a, emin) + drop), from a's exponent field
    np.bitwise_and(a.view(plan.uint), plan.exponent_field, out=big_r)
    np.maximum(big_r, plan.min_normal_bits_row[:k], out=big_r)
    r *= plan.to_quantum                                     # exact: a power of two
    np.add(a, r, out=block.t)                                # one rounding, to a multiple of C's ulp
    np.subtract(block.t, r, out=r)                           # exact


def _round_block_bits(plan: _Plan, block: _Block, has_nan: bool) -> bool:
    """Any mode, on bit patterns.

    Magnitudes at or above fmt's min normal are rounded on their integer bit patterns at bit
    ``drop`` (a carry into the exponent field is the binade crossing).  Below it the quantum is
    fixed, fmt's min subnormal q: the magnitude, clamped to at most min normal, is scaled by
    1/q (exact), rounded to an integer by numpy's trunc / rint / floor / ceil, and scaled back.
    The normal part rounds max(magnitude, min normal) instead, so each element's result is the
    sum of the two bit patterns less min normal's: one of them is always min normal itself.

    Returns:
      Whether the result already carries the input's sign.
    """
    x, r, a, t, y, u, g, d = block
    k, uint, rounding = len(x), plan.uint, plan.rounding
    big_r, big_x = r.view(uint), x.view(uint)
    split = has_nan or a.min() < plan.min_normal             # some elements below min normal
    if split:
        # The normal part sees min normal for them, which every mode keeps.
        np.maximum(a.view(uint), plan.min_normal_bits_row[:k], out=big_r)
        normal = big_r
    else:
        normal = big_x                                       # the sign bit rides along
    if plan.directed:
        # away: all ones where the magnitude rounds away from zero when inexact.
        away = y.view(uint)
        np.right_shift(big_x.view(plan.sint), plan.sint(plan.width - 1), out=away.view(plan.sint))
        if rounding == "up":
            np.invert(away, out=away)

    # Normal range: round the bit patterns at bit `drop`.
    if rounding == "nearest_even" and plan.m > 0:
        np.right_shift(normal, uint(plan.drop), out=u)
        np.bitwise_and(u, uint(1), out=u)
        np.add(u, plan.ne_bias, out=u)
        np.add(normal, u, out=big_r)
        np.bitwise_and(big_r, plan.keep_mask, out=big_r)
    elif rounding == "toward_zero":
        np.bitwise_and(normal, plan.keep_mask, out=big_r)
    elif rounding in ("nearest_away", "nearest_even"):
        # (With no mantissa bits every normal significand is 1, odd: ties go up.)
        np.add(normal, plan.half_step, out=big_r)
        np.bitwise_and(big_r, plan.keep_mask, out=big_r)
    elif plan.directed:
        np.bitwise_and(away, plan.low_mask, out=u)
        np.add(normal, u, out=big_r)
        np.bitwise_and(big_r, plan.keep_mask, out=big_r)
    else:  # stochastic: up with probability (dropped bits) / 2**drop, to 32 bits
        np.bitwise_and(normal, plan.low_mask, out=u)
        if plan.shift_left:
            np.left_shift(u, plan.shift_left, out=u)
        if plan.shift_right:
            np.right_shift(u, plan.shift_right, out=u)
        np.less(d, u, out=g)
        # (bits | low) + 1 carries into bit `drop`: a masked add, without a slow where=.
        np.bitwise_or(normal, plan.low_mask, out=big_r)
        np.add(big_r, g, out=big_r)
        np.bitwise_and(big_r, plan.keep_mask, out=big_r)

    # Below fmt's min normal: multiples of q, in units of q.
    if split:
        if plan.signed_sub:
            # rint and trunc are odd, ceil / floor round up / down: the sign comes along, and
            # the clamp leaves +-min normal, whose bits add the sign bit.
            np.minimum(x, plan.min_normal_row[:k], out=y)
            np.maximum(y, plan.neg_min_normal_row[:k], out=y)
        else:
            np.minimum(a, plan.min_normal_row[:k], out=y)
        for scale in plan.scales:
            y *= scale                                       # exact: powers of two, |y| <= 2**m
        if plan.least is not None:
            # (or 0 for inputs below 2**(emin - m) times the source's least value, far below half a
            # unit, where every mode rounds as on that least value, which stands in, with their sign)
            np.equal(y, 0, out=g)
            g &= a != 0
            y[g] = np.copysign(plan.least, y[g])
        plan.integer_round(y, out=t)
        if rounding == "nearest_away":
            np.subtract(y, t, out=y)                         # the fraction, exact
            np.greater_equal(y, plan.ftype(0.5), out=g)
            np.add(t, g, out=t)
        elif plan.stochastic:
            np.subtract(y, t, out=y)                         # the fraction, exact
            y *= plan.to_fixed                               # exact, below 2**32
            np.floor(y, out=y)
            np.less(d, y, out=g)
            np.add(t, g, out=t)
        t *= plan.q                                          # exact
        np.add(big_r, t.view(uint), out=big_r)
        np.subtract(big_r, plan.min_normal_bits, out=big_r)
    return not split or plan.signed_sub


def _finish_block(plan: _Plan, fmt: Format, block: _Block, signed: bool, subnormals: bool, has_nan: bool,
                  highest, flags: bool, overflowed, start: int) -> None:
    """Flush-to-zero, the sign, fnuz's lone zero, then NaN and overflow, in the blocks that have them.

    Without flags, overflow in a block without NaN is resolved in bulk: a clip, or for IEEE
    formats in the nearest modes a scaling up and back down by 2**(emax_source - emax), which
    turns exactly the magnitudes >= 2**(emax + 1) into infinities.
    """
    x, r, a, t, y, u, g, d = block
    big_r = r.view(plan.uint)
    if not subnormals:
        np.abs(r, out=t)
        np.greater_equal(t, plan.min_normal, out=g)
        np.multiply(r, g, out=r)                             # flush to signed zero (NaN: redone)
    if not signed:
        np.bitwise_and(x.view(plan.uint), plan.sign_bit, out=u)
        np.bitwise_or(big_r, u, out=big_r)
    if not fmt.has_negative_zero:
        r += plan.ftype(0)                                   # -0 + 0 = +0
    stop = start + len(x)
    if has_nan:
        nan_in = np.isnan(a)
        over = (np.abs(r) > plan.max_finite) & ~nan_in
        _fix_overflow(r, x, over, fmt, plan.rounding, plan.overflow, overflowed, start, stop)
        r[nan_in] = plan.ftype(np.nan)
        return
    if not highest > plan.max_finite:                        # nothing can overflow
        return
    fix = None if flags else plan.overflow_fix
    if fix == "clip" or (fix == "clip_finite" and highest != np.inf):
        np.clip(r, -plan.max_finite, plan.max_finite, out=r)
    elif fix == "scale":
        r *= plan.scale_up                                   # >= 2**(emax + 1): +-inf
        r *= plan.scale_down                                 # exact for the others
    elif fix == "nan":
        # All ones where |r| > max finite (the sign of max_bits - |r| bits), and there
        # r ^= r ^ NaN: a branch-free select, several times a putmask's speed.
        sint = plan.sint
        np.bitwise_and(big_r, plan.magnitude_mask, out=u)
        np.subtract(plan.max_bits, u, out=u)
        np.right_shift(u.view(sint), sint(plan.width - 1), out=u.view(sint))
        big_t = t.view(plan.uint)
        np.bitwise_xor(big_r, plan.nan_bits, out=big_t)
        np.bitwise_and(big_t, u, out=big_t)
        np.bitwise_xor(big_r, big_t, out=big_r)
    else:
        over = np.abs(r) > plan.max_finite
        _fix_overflow(r, x, over, fmt, plan.rounding, plan.overflow, overflowed, start, stop)


def _fix_overflow(r, x, over, fmt, rounding, overflow, overflowed, start, stop) -> None:
    """Give the elements of block r flagged in over their overflow results; record the flags."""
    if not over.any():
        return
    if overflowed is not None:
        overflowed[start:stop] = over
    where = np.flatnonzero(over)
    r[where] = _overflow_values(fmt, rounding, overflow, x[where])


def _overflow_values(fmt: Format, rounding, overflow, x: np.ndarray) -> np.ndarray:
    """Results of the overflowing elements x: finite ones per IEEE 754 section 7.4, and infinities."""
    beyond = np.inf if fmt.has_inf else np.nan
    negative = np.signbit(x)
    if overflow == "saturate" or rounding == "toward_zero":
        magnitude = np.full(x.shape, fmt.max_finite)
    elif rounding == "up":
        magnitude = np.where(negative, fmt.max_finite, beyond)
    elif rounding == "down":
        magnitude = np.where(negative, beyond, fmt.max_finite)
    else:
        magnitude = np.full(x.shape, beyond)
    if overflow != "saturate":
        magnitude[np.isinf(x)] = beyond
    magnitude = magnitude.astype(x.dtype)
    # NaN results (fn/fnuz overflow) carry no sign: one canonical NaN.
    return np.where(np.isnan(magnitude), magnitude, np.copysign(magnitude, x))


def _round_bits(arr, fmt: Format, source: _Source, rounding, overflow, subnormals, draws) -> Rounded:
    uint = source.uint
    big_m = source.mantissa_bits
    drop_normal = big_m - fmt.mantissa_bits
    min_normal_field = fmt.emin + source.bias          # source exponent field of fmt's min normal

    bits = arr.view(uint)
    sign_bit = uint(1 << (8 * bits.itemsize - 1))
    sign = bits & sign_bit
    magnitude = bits ^ sign
    field = magnitude >> uint(big_m)
    significand = magnitude & uint((1 << big_m) - 1)
    significand |= np.minimum(field, uint(1)) << uint(big_m)
    effective_field = np.maximum(field, uint(1))

    # Bits below the format's quantum.  Inputs under fmt's min normal have a
    # fixed quantum (fmt's min subnormal), so they drop more bits.
    if min_normal_field > 1 and np.any(effective_field < uint(min_normal_field)):
        drop_true = np.where(effective_field < uint(min_normal_field),
                             uint(min_normal_field) - effective_field, uint(0)) + uint(drop_normal)
        # Past big_m + 1 dropped bits the kept part is 0 and the remainder the
        # whole significand, whatever the exact count; the clamp keeps shifts defined.
        drop = np.minimum(drop_true, uint(big_m + 2))
    else:
        drop_true = drop = uint(drop_normal)

    kept = significand >> drop
    remainder = significand & ((uint(1) << drop) - uint(1))
    half = uint(1) << (drop - uint(1))
    negative = sign != 0
    if rounding == "nearest_even":
        round_up = (remainder > half) | ((remainder == half) & ((kept & uint(1)) == 1))
    elif rounding == "nearest_away":
        round_up = remainder >= half
    elif rounding == "toward_zero":
        round_up = None
    elif rounding == "up":
        round_up = (remainder != 0) & ~negative
    elif rounding == "down":
        round_up = (remainder != 0) & negative
    else:
        round_up = _stochastic_round_up(remainder, drop_true, draws)
    if round_up is not None:
        kept += round_up.astype(uint)

    # Rebuild the magnitude: adding the rounded significand to (field - 1)
    # carries into the exponent when rounding crosses a binade, and gives the
    # source's own subnormal codes for field 0.  With more than big_m bits
    # dropped, kept is 0 or 1: zero or fmt's smallest subnormal.
    result = ((effective_field - uint(1)) << uint(big_m)) + (kept << drop)
    if np.ndim(drop):
        smallest = _bits_of(_subnormal_quantum(fmt), arr.dtype)
        result = np.where(drop > uint(big_m), kept * smallest, result)

    max_bits = _bits_of(fmt.max_finite, arr.dtype)
    nan_bits = _bits_of(np.nan, arr.dtype)
    inf_bits = _bits_of(np.inf, arr.dtype)
    finite = field != uint(source.exponent_mask)
    all_finite = bool(finite.all())
    overflowed = result > max_bits
    if not all_finite:
        overflowed &= finite
    if overflowed.any():
        result = np.where(overflowed, _overflow_magnitude(fmt, rounding, overflow, negative,
                                                          max_bits, inf_bits, nan_bits), result)
    is_nan = None
    if not all_finite:
        payload_zero = (magnitude & uint((1 << big_m) - 1)) == 0
        infinite = ~finite & payload_zero
        is_nan = ~finite & ~payload_zero
        if overflow == "saturate":
            infinite_result = max_bits
        else:
            infinite_result = inf_bits if fmt.has_inf else nan_bits
        result = np.where(infinite, infinite_result, result)
        result = np.where(is_nan, nan_bits, result)
        overflowed |= infinite

    if not subnormals:
        result = np.where(result < _bits_of(fmt.min_normal, arr.dtype), uint(0), result)
    if fmt.has_negative_zero:
        result |= sign
    else:
        result |= np.where(result == 0, uint(0), sign)
    if is_nan is not None or not fmt.has_inf:
        # NaN results (NaN inputs, fn/fnuz overflow) drop the sign: one canonical NaN.
        result = np.where((result & ~sign_bit) == nan_bits, nan_bits, result)
    return Rounded(result.view(arr.dtype), overflowed)


def _subnormal_quantum(fmt: Format) -> float:
    """The spacing below min normal, 2**(emin - m): fmt's min subnormal where it has a zero (a
    format without one has no values there, and the kernel sees none of its inputs there)."""
    return float(np.ldexp(1.0, fmt.emin - fmt.mantissa_bits))


def _bits_of(value: float, dtype: np.dtype):
    """The bit pattern of ``value`` in ``dtype`` (a value beyond its range becomes inf's)."""
    source = _SOURCES[np.dtype(dtype)]
    with np.errstate(over="ignore"):
        return np.array(value, dtype=dtype).view(source.uint)[()]


def _overflow_magnitude(fmt, rounding, overflow, negative, max_bits, inf_bits, nan_bits):
    """Magnitude bits an overflowing element takes, per IEEE 754 section 7.4."""
    beyond = inf_bits if fmt.has_inf else nan_bits
    if overflow == "saturate" or rounding == "toward_zero":
        return max_bits
    if rounding == "up":
        return np.where(negative, max_bits, beyond)
    if rounding == "down":
        return np.where(negative, beyond, max_bits)
    return beyond


def _stochastic_round_up(remainder, drop, draws):
    """True with probability remainder / 2**drop, resolved to 32 bits."""
    wide = remainder.astype(np.uint64, copy=False)
    drop = np.asarray(drop, dtype=np.int64)
    left = np.clip(_RANDOM_BITS - drop, 0, 63).astype(np.uint64)
    right = np.clip(drop - _RANDOM_BITS, 0, 63).astype(np.uint64)
    return draws < ((wide << left) >> right)


def encode(x, fmt, *, rounding: str = "nearest_even", overflow: str = "inf",
           subnormals: bool = True, seed: Optional[int] = None, nan="code") -> np.ndarray:
    """Bit patterns of ``fmt`` for the values of ``x`` (rounded as :func:`quantize` does).

    Args:
      nan: what a NaN (a NaN input, or a value the format has no code for) encodes as:
        ``"code"``: the format's canonical quiet NaN (ValueError for a format without NaN);
        ``"raise"``: ValueError whenever there is one; an int: that code, with the NaN's sign
        bit added in a signed format, as torchao's fp4/fp6 casts give canonical NaNs finite codes
        (fp4_e2m1fn: NaN -> 0x3, -NaN -> 0xB).

    Returns:
      An unsigned integer array: uint8, uint16, uint32 or uint64 by fmt's width.

    Example:
      >>> hex(int(encode(1.0, "bf16")))
      '0x3f80'
      >>> encode([float("nan"), -float("nan")], "fp4_e2m1fn", nan=0x3).tolist()
      [3, 11]
    """
    fmt = get_format(fmt)
    nan_code = _nan_policy(nan, fmt)
    arr = as_float_array(x)
    if not _max_finite_fits(arr.dtype, fmt):  # round from float64 (exact widening), where they fit
        arr = arr.astype(np.float64)
    values = quantize(arr, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals, seed=seed)
    is_nan = np.isnan(values)
    if nan_code is None and is_nan.any():
        why = "the format has no NaN code" if not fmt.has_nan else "nan='raise'"
        raise ValueError(f"x holds NaN, which {fmt.name} cannot encode: {why}")
    code = np.dtype(f"uint{_storage_bits(fmt)}").type
    body = codes_of_values(values, fmt)
    if nan_code is not None and is_nan.any():
        nan_body = code(nan_code)
        if nan != "code" and fmt.signed:  # a finite code for NaN keeps the NaN's sign
            nan_body = nan_body | np.where(np.signbit(arr), code(1 << (fmt.bits - 1)), code(0))
        body = np.where(is_nan, nan_body, body)
    return body.astype(code)


def codes_of_values(values: np.ndarray, fmt: Format) -> np.ndarray:
    """The codes of values of ``fmt`` (float32 or float64 arrays of its own values, as
    :func:`quantize` returns them); a NaN's code is unspecified (:func:`encode` applies its policy).

    Example:
      >>> codes_of_values(np.array([1.0, -448.0], np.float32), get_format("fp8_e4m3fn")).tolist()
      [56, 254]
    """
    code = np.dtype(f"uint{_storage_bits(fmt)}").type
    if (values.dtype == np.float32 and fmt.signed and fmt.has_zero and fmt.mantissa_bits <= 10
            and fmt.emin - fmt.mantissa_bits >= -126 and fmt.emax <= 127):
        return _codes_from_float32(values, fmt, code)
    if fmt.dtype is not None:
        # The values are fmt's own, so the native cast is exact (even ml_dtypes' float64 one, which before
        # 0.7.0 rounds through float32), and several times faster than taking them apart.
        with np.errstate(invalid="ignore", over="ignore"):
            return values.astype(fmt.dtype).view(code)
    return _encode_fields(values, fmt)


def _codes_from_float32(values: np.ndarray, fmt: Format, code) -> np.ndarray:
    """Codes of float32 values of fmt, gathered from a table indexed by the float32 bits above fmt's
    mantissa width: every value of such a format (subnormals included) is a float32 normal or zero
    whose bits below that width are 0, so sign, exponent and kept mantissa bits name it.  NaN is
    left to the caller.  Two passes, several times faster than ml_dtypes' fp8 casts."""
    table = _float32_code_table(fmt)
    bits = values.reshape(-1).view(np.uint32)
    out = np.empty(bits.shape, table.dtype)
    # An intp index straight from the shift (numpy gathers with intp, and converts others first),
    # one cache-sized block at a time.
    index = np.empty(min(bits.size, _FAST_BLOCK), np.intp)
    shift = np.uint32(23 - fmt.mantissa_bits)
    for start in range(0, bits.size, _FAST_BLOCK):
        block = bits[start:start + _FAST_BLOCK]
        np.right_shift(block, shift, out=index[:len(block)], casting="unsafe")
        np.take(table, index[:len(block)], out=out[start:start + len(block)])
    return out.astype(code, copy=False).reshape(values.shape)


@functools.lru_cache(maxsize=32)
def _float32_code_table(fmt: Format) -> np.ndarray:
    """Entry i: the code of the float32 value whose bits are i << (23 - m) (0 where it is not a value of fmt)."""
    shift = 23 - fmt.mantissa_bits
    bits = np.arange(1 << (32 - shift), dtype=np.uint64).astype(np.uint32) << np.uint32(shift)
    candidates = bits.view(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        own = quantize(candidates, fmt)
    keep = (own.view(np.uint32) == bits) & ~np.isnan(candidates)
    table = np.zeros(candidates.shape, np.dtype(f"uint{_storage_bits(fmt)}"))
    table[keep] = _encode_fields(candidates[keep], fmt)
    table.flags.writeable = False
    return table


def _encode_fields(values: np.ndarray, fmt: Format) -> np.ndarray:
    """The codes of values of fmt (NaN left to the caller), assembled from exponent and mantissa."""
    values = values.astype(np.float64)
    m = fmt.mantissa_bits
    magnitude = np.abs(values)
    finite_nonzero = np.isfinite(values) & (magnitude != 0)
    safe = np.where(finite_nonzero, magnitude, 1.0)
    exponent = np.maximum(np.frexp(safe)[1] - 1, fmt.emin)
    field = np.where(safe >= fmt.min_normal, exponent + fmt.bias, 0)
    implicit = (field > 0) | (not fmt.has_zero)  # without a zero, field 0 is a normal binade
    mantissa = np.ldexp(safe, m - exponent) - np.where(implicit, float(1 << m), 0.0)
    body = (field.astype(np.uint64) << np.uint64(m)) | mantissa.astype(np.uint64)
    body = np.where(finite_nonzero, body, np.uint64(0))
    if fmt.has_inf:  # (the other conventions turn overflow into NaN or max finite)
        body = np.where(np.isinf(values), np.uint64(_inf_code(fmt)), body)
    if fmt.signed:
        body |= np.where(np.signbit(values) & ~np.isnan(values), np.uint64(1 << (fmt.bits - 1)), np.uint64(0))
    return body.astype(np.dtype(f"uint{_storage_bits(fmt)}"))


def _nan_policy(nan, fmt: Format) -> Optional[int]:
    """The code NaN encodes as under the policy ``nan``, None when a NaN must raise."""
    if isinstance(nan, str) and nan in ("code", "raise"):
        return _nan_code(fmt) if nan == "code" and fmt.has_nan else None
    if isinstance(nan, (int, np.integer)) and not isinstance(nan, bool) and 0 <= nan < (1 << fmt.bits):
        return int(nan)
    raise ValueError(f"nan must be 'code', 'raise' or a code of the {fmt.bits}-bit format {fmt.name} "
                     f"(0 .. {(1 << fmt.bits) - 1}), got {nan!r}")


def decode(bits, fmt, *, dtype=np.float64) -> np.ndarray:
    """Values of ``fmt``'s bit patterns ``bits`` (unsigned or signed integers).

    Args:
      bits: integer codes in ``0 .. 2**fmt.bits - 1``.
      fmt: a Format or name.
      dtype: float64 (default) or float32 for the result.

    Example:
      >>> decode([0x7C00, 0x0001], "fp16").tolist()
      [inf, 5.960464477539063e-08]
      >>> decode([0x00, 0x7F, 0xFE, 0xFF], "e8m0").tolist()[1:]
      [1.0, 1.7014118346046923e+38, nan]
    """
    fmt = get_format(fmt)
    codes = np.asarray(bits)
    if codes.dtype.kind not in "iu":
        raise TypeError(f"bits must be an integer array, got dtype {codes.dtype}")
    if codes.size and (codes.min() < 0 or codes.max() >= (1 << fmt.bits)):
        raise ValueError(f"bits must be codes of the {fmt.bits}-bit format {fmt.name} "
                         f"(0 .. {(1 << fmt.bits) - 1}), got values in [{codes.min()}, {codes.max()}]")
    if np.dtype(dtype) not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise ValueError(f"dtype must be float32 or float64, got {dtype}")
    if fmt.bits <= _TABLE_BITS:  # a table of every code's value, gathered
        return _code_values(fmt, np.dtype(dtype).str)[codes.astype(np.intp)]
    return _decode_fields(codes, fmt).astype(dtype)


# Formats up to this width decode through a table of all their codes' values (64K entries at most).
_TABLE_BITS = 16


@functools.lru_cache(maxsize=64)
def _code_values(fmt: Format, dtype: str) -> np.ndarray:
    table = _decode_fields(np.arange(1 << fmt.bits, dtype=np.uint64), fmt).astype(dtype)
    table.flags.writeable = False
    return table


def _decode_fields(codes: np.ndarray, fmt: Format) -> np.ndarray:
    """float64 values of codes, taken apart into sign, exponent and mantissa."""
    codes = codes.astype(np.uint64) & np.uint64((1 << fmt.bits) - 1)
    m = fmt.mantissa_bits
    magnitude_code = codes & np.uint64((1 << (fmt.exponent_bits + m)) - 1)
    mantissa = (codes & np.uint64((1 << m) - 1)).astype(np.float64)
    field = (magnitude_code >> np.uint64(m)).astype(np.int64)
    normal = (field > 0) | (not fmt.has_zero)
    significand = np.where(normal, mantissa + float(1 << m), mantissa)
    lowest_field = 1 if fmt.has_zero else 0
    values = np.ldexp(significand, np.maximum(field, lowest_field) - fmt.bias - m)
    if fmt.signed:
        values = np.where((codes >> np.uint64(fmt.bits - 1)) != 0, -values, values)
    above_finite = magnitude_code.astype(np.int64) - fmt.max_finite_code
    if fmt.has_inf:
        values = np.where(above_finite == 1, np.copysign(np.inf, values), values)
    values = np.where(above_finite > int(fmt.has_inf), np.nan, values)
    if fmt.nan_at_negative_zero:
        values = np.where(codes == np.uint64(1 << (fmt.bits - 1)), np.nan, values)
    return values


def _storage_bits(fmt: Format) -> int:
    return next(width for width in (8, 16, 32, 64) if fmt.bits <= width)


def _inf_code(fmt: Format) -> int:
    return fmt.max_finite_code + 1


def _nan_code(fmt: Format) -> int:
    """The canonical NaN: the -0 code (fnuz), else IEEE's quiet NaN where it is a NaN code
    (top exponent, top mantissa bit), else the all-ones magnitude (fn, e8m0)."""
    if fmt.nan_at_negative_zero:
        return 1 << (fmt.bits - 1)
    quiet = (((1 << fmt.exponent_bits) - 1) << fmt.mantissa_bits) | (1 << max(fmt.mantissa_bits - 1, 0))
    first_nan = fmt.max_finite_code + 1 + int(fmt.has_inf)
    return quiet if quiet >= first_nan else (1 << (fmt.exponent_bits + fmt.mantissa_bits)) - 1
