"""fpemu's rounding kernel applied to torch tensors, and the counts telemetry takes of each rounding.

torch's own float32 -> float16 and float32 -> bfloat16 casts round to nearest even with IEEE
overflow and subnormals; tests/test_emulate_torch.py checks them bit for bit against
``fpemu.quantize`` (random and boundary values; all 2**32 float32 inputs behind
FPEMU_TEST_EXHAUSTIVE=1), so the default mode uses them.  Every other case goes through
``fpemu.formats.rounding.quantize`` on a numpy view of the float32 tensor.
"""

from __future__ import annotations

import torch

from fpemu.formats import FORMATS, Format, quantize

# torch dtypes that hold a format's values exactly, so a tensor can carry them (the emulated dtype).
CARRIERS = {"fp16": torch.float16, "bf16": torch.bfloat16}


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
    if rounding == "nearest_even" and overflow == "inf" and subnormals and dtype != torch.float32:
        return values.to(dtype)
    source = values.detach().contiguous().numpy()
    rounded = quantize(source, fmt, rounding=rounding, overflow=overflow, subnormals=subnormals,
                       seed=None if rounding != "stochastic" else seed)
    return torch.from_numpy(rounded).to(dtype)


def rounding_counts(before: torch.Tensor, after: torch.Tensor, min_normal: float):
    """(counts in telemetry's COUNTERS order, 'overflow' / 'nan' / 'inf' / None) of one rounding of
    the float32 result ``before`` to ``after``.

    Rounding never makes a zero nonzero, so the underflows are the nonzeros lost; every inf or NaN
    it adds is an overflow (a NaN for formats without infinity); ``nan`` counts the NaNs the op's
    float32 result already held.  The last element says what the first non-finite value was.
    """
    elements = before.numel()
    nonzero_after = int(torch.count_nonzero(after))
    underflow = int(torch.count_nonzero(before)) - nonzero_after
    subnormal = int(torch.count_nonzero(after.abs() < min_normal)) - (elements - nonzero_after)
    nonfinite_after = elements - int(torch.count_nonzero(torch.isfinite(after)))
    if not nonfinite_after:
        return (elements, underflow, subnormal, 0, 0), None
    nonfinite_before = elements - int(torch.count_nonzero(torch.isfinite(before)))
    nan_before = int(torch.count_nonzero(torch.isnan(before)))
    overflow = nonfinite_after - nonfinite_before
    kind = "overflow" if overflow else ("nan" if nan_before else "inf")
    return (elements, underflow, subnormal, overflow, nan_before), kind
