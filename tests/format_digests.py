"""Digests of every named format's results over all its codes and a large input sweep.

``tests/data/format_digests.json`` holds these digests as the format code computed them before
``Format`` was rebuilt on orthogonal fields (signed, has_inf, NaN codes, zero codes); the test
that compares them proves the rebuild changed no result of any existing format.  Regenerate only
when a change of results is intended: ``python tests/format_digests.py > tests/data/format_digests.json``.
"""

import hashlib
import json

import numpy as np

import fpemu
from fpemu.formats import round_to_format

# Named formats as they stood before the rebuild (new formats get tests of their own).
NAMES = ["fp32", "tf32", "fp16", "bf16", "fp8_e4m3fn", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e5m2fnuz",
         "fp8_e4m3", "fp8_e3m4", "fp8_e4m3b11fnuz", "fp6_e2m3fn", "fp6_e3m2fn", "fp4_e2m1fn"]
# float32 bit patterns: an odd stride walks every sign, binade and low-bit pattern.
SWEEP = (np.arange(1 << 16, dtype=np.uint64) * np.uint64(65521) + np.uint64(12345)).astype(np.uint32)


def _digest(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        if a.dtype.kind == "f":  # NaN-aware: every NaN hashes alike
            a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
        h.update(a.tobytes())
    return h.hexdigest()[:24]


def digests() -> dict:
    x32 = SWEEP.view(np.float32)
    with np.errstate(invalid="ignore"):
        x64 = x32.astype(np.float64) * (1 + 2.0**-40)  # float64 inputs off the float32 grid
    out = {}
    for name in NAMES:
        fmt = fpemu.get_format(name)
        row = {"layout": [fmt.bits, fmt.max_finite, fmt.min_normal, fmt.min_subnormal, fmt.emin, fmt.emax,
                          fmt.has_inf, fmt.has_nan, fmt.has_negative_zero]}
        if fmt.bits <= 16:
            codes = np.arange(1 << fmt.bits, dtype=np.uint64)
            values = fpemu.decode(codes, fmt)
            finite = ~np.isnan(values)
            row["codes"] = _digest(values, fpemu.encode(values[finite], fmt))
        for source in (x32, x64):
            for rounding in fpemu.ROUNDING_MODES:
                seed = 1 if rounding == "stochastic" else None
                for overflow in fpemu.OVERFLOW_MODES:
                    for subnormals in (True, False):
                        q = fpemu.quantize(source, fmt, rounding=rounding, overflow=overflow,
                                           subnormals=subnormals, seed=seed)
                        r = round_to_format(source, fmt, rounding, overflow, subnormals, seed)
                        key = f"{source.dtype}/{rounding}/{overflow}/{subnormals}"
                        row[key] = _digest(q, r.values, r.overflowed)
        if fmt.has_nan:
            row["encode"] = _digest(fpemu.encode(x32, fmt))
        out[name] = row
    return out


if __name__ == "__main__":
    print(json.dumps(digests(), indent=1, sort_keys=True))
