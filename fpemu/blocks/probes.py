"""Input blocks that probe a block-scaling implementation: the kinds the differential tests use.

Example:
  >>> probe_blocks("edges", "fp8_e4m3fn", rows=2, block_size=32).shape
  (2, 32)
"""

from __future__ import annotations

import numpy as np

from fpemu.formats.format import get_format

PROBE_KINDS = ("random", "wide", "edges", "tiny", "zeros", "nan", "inf")


def probe_blocks(kind: str, element_format, rows: int = 64, block_size: int = 32, seed: int = 0) -> np.ndarray:
    """float32 array of ``rows`` blocks of ``block_size`` values of one kind.

    Args:
      kind: ``random`` (randn), ``wide`` (random signs and magnitudes 2**-149 .. 2**127.9),
        ``edges`` (blocks whose amax lies one float32 ulp below, at and above max(element) * 2**k
        and 2**k, for k across e8m0's range), ``tiny`` (amax below 2**-110: scale byte 0),
        ``zeros`` (all-zero blocks, and zeros with one tiny value), ``nan`` / ``inf`` (randn blocks
        with one NaN / one infinity of either sign).
      element_format: the element format whose max the edges are built around.
    """
    if kind not in PROBE_KINDS:
        raise ValueError(f"kind must be one of {PROBE_KINDS}, got {kind!r}")
    rng = np.random.default_rng(seed)
    shape = (rows, block_size)
    base = rng.standard_normal(shape).astype(np.float32)
    if kind == "random":
        return base
    if kind == "wide":
        return (np.sign(base) * np.exp2(rng.uniform(-149, 127.9, shape))).astype(np.float32)
    if kind == "tiny":
        return (base * np.exp2(rng.uniform(-150, -110, (rows, 1)))).astype(np.float32)
    if kind == "zeros":
        out = np.zeros(shape, np.float32)
        out[1::2, 0] = np.float32(2.0**-140) * np.sign(base[1::2, 0])
        return out
    if kind in ("nan", "inf"):
        special = np.float32(np.nan if kind == "nan" else np.inf)
        where = rng.integers(0, block_size, rows)
        base[np.arange(rows), where] = np.where(rng.random(rows) < 0.5, special, -special)
        return base
    return _edges(base, get_format(element_format), rng)


def _edges(base: np.ndarray, elem, rng) -> np.ndarray:
    rows = base.shape[0]
    top = np.where(rng.random(rows) < 0.5, elem.max_finite, 1.0)
    k = rng.integers(-140, 127 - np.log2(top).astype(np.int64))  # max(element) * 2**k stays finite
    centre = top * np.exp2(k.astype(np.float64))
    amax = centre.astype(np.float32).view(np.uint32).astype(np.int64) + rng.integers(-1, 2, rows)
    amax = amax.astype(np.uint32).view(np.float32)
    out = np.clip(base, -1, 1) * amax[:, None] * np.float32(0.99)
    out[np.arange(rows), rng.integers(0, base.shape[1], rows)] = amax * np.where(rng.random(rows) < 0.5, 1, -1)
    return out.astype(np.float32)
