"""fpemu's rounding kernel applied to torch tensors, and the counts telemetry takes of each rounding.

torch's own float32 casts to float16, bfloat16 and its float8 dtypes round to nearest even with
subnormals (``NATIVE_CASTS`` says with which overflow: torch's float8_e4m3fn cast saturates);
tests/test_emulate_torch.py checks each bit for bit against fpemu's kernel (boundary and random
values; float16 and bfloat16 on all 2**32 float32 inputs behind FPEMU_TEST_EXHAUSTIVE=1), so those
cases use them.  Every other case goes through ``fpemu.formats.rounding.quantize`` on a numpy view
of the float32 tensor.
"""

from __future__ import annotations

import functools

import torch

from fpemu.formats import FORMATS, Format, quantize

# torch dtypes that hold a format's values exactly, so a tensor can carry them (the emulated dtype).
CARRIERS = {"fp16": torch.float16, "bf16": torch.bfloat16}


# (format, overflow mode) -> the torch dtype whose float32 cast rounds exactly so (nearest even, subnormals kept).
NATIVE_CASTS = {("fp16", "inf"): torch.float16, ("bf16", "inf"): torch.bfloat16,
                ("fp8_e4m3fn", "saturate"): torch.float8_e4m3fn, ("fp8_e5m2", "inf"): torch.float8_e5m2,
                ("fp8_e4m3fnuz", "inf"): torch.float8_e4m3fnuz, ("fp8_e5m2fnuz", "inf"): torch.float8_e5m2fnuz}


def _native_cast(fmt: Format, overflow: str):
    for (name, mode), dtype in NATIVE_CASTS.items():
        if mode == overflow and FORMATS[name] == fmt:
            return dtype
    return None


def carrier(fmt: Format):
    """The torch dtype that holds fmt's values (float16, bfloat16), or float32."""
    for name, dtype in CARRIERS.items():
        if FORMATS[name] == fmt:
            return dtype
    return torch.float32


def round_tensor(values: torch.Tensor, fmt: Format, dtype, rounding: str = "nearest_even",
                 overflow: str = "inf", subnormals: bool = True, seed=None) -> torch.Tensor:
    """float32 ``values`` rounded once to ``fmt``, as a tensor of ``dtype`` (fmt's carrier).

    Example:
      >>> round_tensor(torch.tensor([65519.996, 65520.0]), FORMATS["fp16"], torch.float16).tolist()
      [65504.0, inf]
    """
    native = _native_cast(fmt, overflow) if rounding == "nearest_even" and subnormals else None
    if native is not None:
        return values.to(native).to(dtype)
    source = values.detach().contiguous().numpy()
    rounded = quantize(source, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals,
                       seed=None if rounding != "stochastic" else seed)
    return torch.from_numpy(rounded).to(dtype)


# The integer view of each carrier dtype, and the mask that clears its sign bit.
_BITS = {torch.float16: (torch.int16, 0x7FFF), torch.bfloat16: (torch.int16, 0x7FFF),
         torch.float32: (torch.int32, 0x7FFFFFFF)}


@functools.lru_cache(maxsize=None)
def _thresholds(dtype, min_normal: float) -> tuple:
    """(bits of min normal, bits of inf) of ``dtype``'s magnitudes: below the first a nonzero value is
    subnormal in the format, from the second on it is inf or NaN."""
    view, _ = _BITS[dtype]
    as_bits = lambda v: int(torch.tensor(v, dtype=dtype).view(view))
    return as_bits(min_normal), as_bits(float("inf"))


def _magnitudes(after: torch.Tensor, min_normal: float) -> tuple:
    """(magnitude bits, their least, their greatest, bits of min normal, bits of inf) of a nonempty
    carrier tensor: the one cheap pass every count starts from."""
    view, mask = _BITS[after.dtype]
    magnitude = after.view(view) & mask
    low, high = (int(v) for v in torch.aminmax(magnitude))
    return (magnitude, low, high) + _thresholds(after.dtype, min_normal)


def normal_counts(after: torch.Tensor, min_normal: float):
    """The counts of a rounding whose every result ``after`` is a normal finite number (nothing
    underflowed, became subnormal or overflowed: the float32 values need not be read); None when some
    result is zero, subnormal, inf or NaN, or there is none."""
    if not after.numel():
        return None
    _, low, high, normal_bits, inf_bits = _magnitudes(after, min_normal)
    return (after.numel(), 0, 0, 0, 0) if low >= normal_bits and high < inf_bits else None


def rounding_counts(before: torch.Tensor, after: torch.Tensor, min_normal: float):
    """(counts in telemetry's COUNTERS order, 'overflow' / 'nan' / 'inf' / None) of one rounding of
    the float32 result ``before`` to ``after`` (a carrier tensor).

    Rounding never makes a zero nonzero, so the underflows are the nonzeros lost; every inf or NaN
    it adds is an overflow (a NaN for formats without infinity); ``nan`` counts the NaNs the op's
    float32 result already held.  The last element says what the first non-finite value was.  The
    counts read ``after``'s bit patterns (integer ops: torch's float16 compares are slow on the CPU).
    """
    elements = before.numel()
    if not elements:
        return (0, 0, 0, 0, 0), None
    magnitude, low, high, normal_bits, inf_bits = _magnitudes(after, min_normal)
    if low >= normal_bits and high < inf_bits:  # the common case, in one cheap pass: all normal
        return (elements, 0, 0, 0, 0), None
    zeros_after = elements - int(torch.count_nonzero(magnitude)) if low == 0 else 0
    underflow = 0
    if zeros_after:
        before_view, before_mask = _BITS[before.dtype]
        underflow = int(torch.count_nonzero(before.view(before_view) & before_mask)) - (elements - zeros_after)
    subnormal = int(torch.count_nonzero(magnitude < normal_bits)) - zeros_after if low < normal_bits else 0
    nonfinite_after = int(torch.count_nonzero(magnitude >= inf_bits)) if high >= inf_bits else 0
    if not nonfinite_after:
        return (elements, underflow, subnormal, 0, 0), None
    nonfinite_before = elements - int(torch.count_nonzero(torch.isfinite(before)))
    nan_before = int(torch.count_nonzero(torch.isnan(before)))
    overflow = nonfinite_after - nonfinite_before
    kind = "overflow" if overflow else ("nan" if nan_before else "inf")
    return (elements, underflow, subnormal, overflow, nan_before), kind
