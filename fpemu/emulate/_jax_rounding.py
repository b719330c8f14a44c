"""fpemu's rounding kernel as jax.numpy / lax integer operations: it runs inside ``jax.jit`` (one
compiled program, any backend), bit-identical to :func:`fpemu.formats.quantize` on float32 inputs.

It is the general bit kernel of ``fpemu/formats/rounding.py`` (``_round_bits``, with the wrapper for
formats without a sign bit or a zero) written on the uint32 bit patterns: the dropped bits are read
at the format's quantum (fixed below its min normal), rounded up or not by the mode, the carry
crossing binades; then overflow (IEEE 754 section 7.4, or saturation), infinities, NaN, flush-to-zero
and the sign.  Every step is an integer operation on the bits, never a float one, so XLA:CPU's
FTZ/DAZ (which would read a float32 subnormal input as zero) and its algebraic simplifier cannot
change a result.

Stochastic rounding takes its random bits explicitly, one uint32 draw per element, as the numpy
kernel consumes them: :func:`stochastic_draws` makes the draws ``quantize(..., seed=s)`` would make
(PCG64 of ``numpy.random.default_rng(s)``, two draws from each 64-bit output; for float32 -> bf16
with IEEE overflow and subnormals, quantize's own path draws 16 bits an element from SFC64 and adds
them below bf16's last bit, which :func:`round_to_format_jax` applies to ``bf16_draws``).

Formats whose float32 inputs the numpy kernel rounds in float64 (a min normal below float32's, 23 or
more mantissa bits, a min normal beyond float32's range: fp32, e8m0, such custom formats) are
refused (ValueError naming the format): their rounding needs float64, which JAX gives only under
``jax_enable_x64``.

tests/test_emulate_jax_rounding.py checks every named format in every mode against quantize on an
edge-dense sample of float32 bit patterns; behind FPEMU_TEST_EXHAUSTIVE=1 on all 2**32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fpemu.formats import Format, ROUNDING_MODES, OVERFLOW_MODES, get_format

_U32 = jnp.uint32
_MANTISSA, _BIAS, _EXPONENT_MASK = 23, 127, 0xFF
_SIGN_BIT, _NAN_BITS, _INF_BITS = 0x80000000, 0x7FC00000, 0x7F800000
_RANDOM_BITS = 32  # the numpy kernel compares the discarded fraction, in 32-bit fixed point, with 32 random bits


def float32_bits(value: float) -> int:
    """The float32 bit pattern of ``value`` (inf's where it is beyond float32)."""
    with np.errstate(over="ignore"):
        return int(np.array(value, np.float32).view(np.uint32))


def supported(fmt: Format) -> bool:
    """Whether the uint32 kernel rounds float32 onto ``fmt`` (see the module docstring)."""
    return not (fmt.emin + _BIAS < 1 or fmt.mantissa_bits >= _MANTISSA or fmt.emin > _BIAS)


def check_format(fmt) -> Format:
    """``fmt`` as a Format, if the uint32 kernel takes it; else ValueError naming it and why."""
    fmt = get_format(fmt)
    if not supported(fmt):
        raise ValueError(f"round_to_format_jax: format {fmt.name} (emin {fmt.emin}, {fmt.mantissa_bits} mantissa "
                         "bits) rounds float32 inputs in float64 in fpemu's kernel; the uint32 JAX kernel takes "
                         "formats whose min normal is a float32 normal and whose mantissa is narrower than float32's")
    return fmt


def round_to_format_jax(x, fmt, *, rounding: str = "nearest_even", overflow: str = "inf", subnormals: bool = True,
                        draws=None, bf16_draws=None):
    """``x`` (float32; narrower floats are widened exactly) rounded onto ``fmt``, as a float32 jax array.

    Args:
      x: a float32 jax or numpy array (traced under jit or not).
      fmt: a :class:`Format` or name (see :func:`supported`).
      rounding, overflow, subnormals: as :func:`fpemu.quantize`.
      draws: stochastic rounding's uint32 draws, one per element of ``x`` in C order.
      bf16_draws: instead of ``draws``, for fmt bf16 with overflow ``inf`` and subnormals: 16-bit draws
        (uint16 or uint32 < 2**16) as quantize's own bf16 path adds them (:func:`stochastic_draws`).

    Returns:
      float32 values of fmt, bit for bit quantize's (a NaN is some NaN, as everywhere in fpemu).

    Raises:
      ValueError: an unknown mode, a format the kernel does not take, draws missing or of the wrong shape.

    Example:
      >>> import jax.numpy as jnp
      >>> round_to_format_jax(jnp.array([65519.996, 65520.0, 1 + 2.0 ** -11], jnp.float32), "fp16").tolist()
      [65504.0, inf, 1.0]
    """
    fmt = check_format(fmt)
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"rounding must be one of {ROUNDING_MODES}, got {rounding!r}")
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow must be one of {OVERFLOW_MODES}, got {overflow!r}")
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        if not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype.itemsize > 4:
            raise ValueError(f"round_to_format_jax: x must be float32 (or a narrower float), got {x.dtype}")
        x = x.astype(jnp.float32)
    if rounding == "stochastic":
        if bf16_draws is not None:
            if not _adds_bf16_draws(fmt, overflow, subnormals):
                raise ValueError("bf16_draws apply to fmt bf16 with overflow 'inf' and subnormals; pass draws")
            return _stochastic_bf16(x, _draw_array(bf16_draws, x.shape, "bf16_draws"))
        draws = _draw_array(draws, x.shape, "draws")
    elif draws is not None or bf16_draws is not None:
        raise ValueError(f"draws are only used with rounding='stochastic', got rounding={rounding!r}")
    bits = jax.lax.bitcast_convert_type(x, _U32)
    if fmt.signed and fmt.has_zero:
        out = _round_signed(bits, fmt, rounding, overflow, subnormals, draws)
    else:
        out = _round_onto_positive(bits, fmt, rounding, overflow, subnormals, draws)
    return jax.lax.bitcast_convert_type(out, jnp.float32)


def _draw_array(draws, shape, name: str):
    if draws is None:
        raise ValueError(f"rounding='stochastic' needs {name} (uint32, one per element: stochastic_draws)")
    draws = jnp.asarray(draws)
    if tuple(draws.shape) != tuple(shape):
        raise ValueError(f"{name} must have x's shape {tuple(shape)}, got {tuple(draws.shape)}")
    return draws.astype(_U32)


def _adds_bf16_draws(fmt: Format, overflow: str, subnormals: bool) -> bool:
    """Whether quantize rounds float32 onto fmt stochastically by its bf16 path (16-bit SFC64 draws)."""
    return fmt == get_format("bf16") and overflow == "inf" and subnormals


def stochastic_draws(seed: int, shape, fmt, *, overflow: str = "inf", subnormals: bool = True) -> dict:
    """The random bits ``quantize(x, fmt, rounding="stochastic", seed=seed, ...)`` consumes for an x of
    ``shape`` (numpy, on the host), as keyword arguments of :func:`round_to_format_jax`.

    Example:
      >>> sorted(stochastic_draws(7, (3,), "fp16"))
      ['draws']
    """
    fmt = get_format(fmt)
    size = int(np.prod(shape, dtype=np.int64))
    if _adds_bf16_draws(fmt, overflow, subnormals):
        generator = np.random.SFC64(seed)
        return {"bf16_draws": generator.random_raw((size + 3) // 4).view(np.uint16)[:size].reshape(shape)}
    raw = np.random.default_rng(seed).bit_generator.random_raw((size + 1) // 2)
    return {"draws": raw.view(np.uint32)[:size].reshape(shape)}


def _stochastic_bf16(x, draws):
    """quantize's float32 -> bf16 stochastic path: add the 16-bit draw below bf16's last bit, clear the low
    16 bits (a carry crosses binades and reaches inf); NaN inputs stay NaN."""
    bits = jax.lax.bitcast_convert_type(x, _U32)
    rounded = (bits + draws) & _U32(0xFFFF0000)
    nan = (bits & _U32(0x7FFFFFFF)) > _U32(_INF_BITS)
    return jax.lax.bitcast_convert_type(jnp.where(nan, bits | _U32(_NAN_BITS), rounded), jnp.float32)


class _Constants:
    """The integer constants of one format (made once per format)."""

    def __init__(self, fmt: Format):
        self.drop_normal = _MANTISSA - fmt.mantissa_bits
        self.min_normal_field = fmt.emin + _BIAS  # the float32 exponent field of fmt's min normal
        self.max_bits = float32_bits(fmt.max_finite)
        self.min_normal_bits = float32_bits(fmt.min_normal)
        self.smallest_bits = float32_bits(np.ldexp(1.0, fmt.emin - fmt.mantissa_bits))


@functools.lru_cache(maxsize=64)
def _constants(fmt: Format) -> _Constants:
    return _Constants(fmt)


def _shift_right(value, shift):
    """value >> shift, 0 for shifts of 32 and more (XLA leaves those to the backend)."""
    return jnp.where(shift >= 32, _U32(0), jax.lax.shift_right_logical(value, jnp.minimum(shift, _U32(31))))


def _round_signed(bits, fmt: Format, rounding: str, overflow: str, subnormals: bool, draws):
    """The kernel proper (``_round_bits``) on uint32 patterns, for formats with a sign bit and a zero (and on
    magnitudes for the others)."""
    if not (fmt.has_inf or fmt.has_nan):
        overflow = "saturate"  # max finite is the only result beyond it
    c = _constants(fmt)
    u = _U32
    sign = bits & u(_SIGN_BIT)
    magnitude = bits ^ sign
    field = magnitude >> u(_MANTISSA)
    significand = (magnitude & u((1 << _MANTISSA) - 1)) | (jnp.minimum(field, u(1)) << u(_MANTISSA))
    effective_field = jnp.maximum(field, u(1))
    drop_normal = u(c.drop_normal)
    if c.min_normal_field > 1:
        # Below fmt's min normal the quantum is fixed: more bits drop.  Past 25 dropped bits the kept part is 0
        # and the remainder the whole significand, whatever the count; the clamp keeps the shifts defined.
        below = effective_field < u(c.min_normal_field)
        drop_true = jnp.where(below, u(c.min_normal_field) - effective_field, u(0)) + drop_normal
        drop = jnp.minimum(drop_true, u(_MANTISSA + 2))
    else:
        drop_true = drop = jnp.broadcast_to(drop_normal, bits.shape)
    kept = significand >> drop
    remainder = significand & ((u(1) << drop) - u(1))
    half = u(1) << (drop - u(1))
    negative = sign != u(0)
    if rounding == "nearest_even":
        round_up = (remainder > half) | ((remainder == half) & ((kept & u(1)) == u(1)))
    elif rounding == "nearest_away":
        round_up = remainder >= half
    elif rounding == "toward_zero":
        round_up = None
    elif rounding == "up":
        round_up = (remainder != u(0)) & ~negative
    elif rounding == "down":
        round_up = (remainder != u(0)) & negative
    else:
        round_up = _stochastic_round_up(remainder, drop_true, draws)
    if round_up is not None:
        kept = kept + round_up.astype(u)
    # The rounded significand added to (field - 1) carries into the exponent across a binade; with more than
    # 23 bits dropped kept is 0 or 1: zero or fmt's smallest subnormal.
    result = ((effective_field - u(1)) << u(_MANTISSA)) + (kept << drop)
    result = jnp.where(drop > u(_MANTISSA), kept * u(c.smallest_bits), result)

    finite = field != u(_EXPONENT_MASK)
    overflowed = (result > u(c.max_bits)) & finite
    result = jnp.where(overflowed, _overflow_magnitude(fmt, rounding, overflow, negative, c.max_bits), result)
    payload_zero = (magnitude & u((1 << _MANTISSA) - 1)) == u(0)
    beyond = _INF_BITS if fmt.has_inf else _NAN_BITS
    infinite_result = c.max_bits if overflow == "saturate" else beyond
    result = jnp.where(~finite & payload_zero, u(infinite_result), result)
    result = jnp.where(~finite & ~payload_zero, u(_NAN_BITS), result)
    if not subnormals:
        result = jnp.where(result < u(c.min_normal_bits), u(0), result)
    if fmt.has_negative_zero:
        result = result | sign
    else:
        result = result | jnp.where(result == u(0), u(0), sign)
    # NaN results drop the sign: one canonical NaN.
    return jnp.where((result & u(0x7FFFFFFF)) == u(_NAN_BITS), u(_NAN_BITS), result)


def _overflow_magnitude(fmt: Format, rounding: str, overflow: str, negative, max_bits: int):
    """Magnitude bits an overflowing element takes (IEEE 754 section 7.4)."""
    beyond = _U32(_INF_BITS if fmt.has_inf else _NAN_BITS)
    if overflow == "saturate" or rounding == "toward_zero":
        return _U32(max_bits)
    if rounding == "up":
        return jnp.where(negative, _U32(max_bits), beyond)
    if rounding == "down":
        return jnp.where(negative, beyond, _U32(max_bits))
    return beyond


def _stochastic_round_up(remainder, drop, draws):
    """True with probability remainder / 2**drop, resolved to 32 bits: the draw below the remainder in 32-bit
    fixed point (a float32 significand has 24 bits, so every shifted remainder fits in 32)."""
    u, width = _U32, _U32(_RANDOM_BITS)
    left = jnp.where(drop < width, width - drop, u(0))
    right = jnp.where(drop > width, drop - width, u(0))
    return draws < _shift_right(remainder << jnp.minimum(left, u(31)), right)


def _round_onto_positive(bits, fmt: Format, rounding: str, overflow: str, subnormals: bool, draws):
    """Formats without a sign bit or without a zero (``_round_onto_positive``): the kernel rounds the magnitude
    (an unsigned format), raised to min normal where there is no zero; then negative inputs of an unsigned
    format and zeros of a format without zero are NaN."""
    u = _U32
    c = _constants(fmt)
    magnitude = bits & u(0x7FFFFFFF)
    is_nan = magnitude > u(_INF_BITS)
    operand = bits if fmt.signed else magnitude
    if not fmt.has_zero:  # (NaN stays NaN: its magnitude is above min normal's)
        lowest = (operand & u(_SIGN_BIT)) | u(c.min_normal_bits)
        operand = jnp.where((operand & u(0x7FFFFFFF)) < u(c.min_normal_bits), lowest, operand)
    rounded = _round_signed(operand, fmt, rounding, overflow, subnormals, draws)
    no_code = jnp.zeros(bits.shape, bool)
    if not fmt.signed:
        no_code = ((bits & u(_SIGN_BIT)) != u(0)) & (magnitude != u(0)) & ~is_nan
    if not fmt.has_zero:
        no_code = no_code | (magnitude == u(0))
    return jnp.where(no_code, u(_NAN_BITS), rounded)
