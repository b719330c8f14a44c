"""What a tensor loses when it is block-quantized: :func:`fpemu.range_stats` for MX and NVFP4."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from fpemu.blocks.quantize import block_quantize
from fpemu.formats.rounding import as_float_array, decode


@dataclasses.dataclass(frozen=True)
class BlockStats:
    """Counts of what one scale rule's block quantization did to each element and block.

    Attributes:
      rule, element_format: the scale rule and element format; block_size: values per scale.
      total: number of elements; zeros, nan, inf: the inputs that were +-0, NaN, +-inf.
      underflow: finite non-zero inputs whose dequantized value is +-0.
      subnormal: elements whose code is one of the element format's subnormals.
      saturated: finite inputs beyond the block's largest value (max element * scale, as the
        rule dequantizes it), so clamped to it.
      blocks: number of blocks; flushed_blocks: blocks holding a finite non-zero input whose
        dequantized values are all zero (one-level NVFP4 of a small tensor); nan_scale_blocks:
        blocks whose scale is NaN.
      relative_rms_error: sqrt(sum((value - x)**2) / sum(x**2)) over the elements where both are
        finite, in float64 (NaN where no such element is non-zero).
    """

    rule: str
    element_format: str
    block_size: int
    total: int
    zeros: int
    nan: int
    inf: int
    underflow: int
    subnormal: int
    saturated: int
    blocks: int
    flushed_blocks: int
    nan_scale_blocks: int
    relative_rms_error: float

    def share(self, field: str) -> float:
        """``field``'s count as a share of ``total`` (of ``blocks`` for the block counts; 0.0 when empty)."""
        whole = self.blocks if field.endswith("_blocks") else self.total
        return getattr(self, field) / whole if whole else 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def block_stats(x, element_format="fp8_e4m3fn", block_size: Optional[int] = None,
                scale_rule: str = "ocp", axis: int = -1) -> BlockStats:
    """Measure underflow, subnormals, saturation and error of ``x`` block-quantized by ``scale_rule``.

    Args:
      x, element_format, block_size, scale_rule, axis: as :func:`fpemu.block_quantize` takes them.

    Returns:
      A :class:`BlockStats`.

    Example:
      >>> x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32) * 1e-3
      >>> block_stats(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4").share("flushed_blocks")
      1.0
      >>> block_stats(x, "fp4_e2m1fn", scale_rule="torchao_nvfp4_2level").share("flushed_blocks")
      0.0
    """
    q = block_quantize(x, element_format, block_size, scale_rule=scale_rule, axis=axis)
    # the values as the rule computed them, in the blocks' own layout: (..., blocks, block_size)
    inputs = _in_blocks(as_float_array(x).astype(np.float64), q)
    values = _in_blocks(q.values.astype(np.float64), q)
    codes = _in_blocks(q.element_codes, q)
    elem = q.element_format
    element_values = np.abs(decode(codes, elem))
    finite_in = np.isfinite(inputs)
    nonzero_in = finite_in & (inputs != 0)
    zero_out = values == 0
    both = finite_in & np.isfinite(values)
    error = np.sum(np.where(both, values - inputs, 0.0) ** 2)
    energy = np.sum(np.where(both, inputs, 0.0) ** 2)
    return BlockStats(
        rule=q.rule, element_format=elem.name, block_size=q.block_size, total=int(inputs.size),
        zeros=int(np.count_nonzero(finite_in & (inputs == 0))), nan=int(np.count_nonzero(np.isnan(inputs))),
        inf=int(np.count_nonzero(np.isinf(inputs))),
        underflow=int(np.count_nonzero(nonzero_in & zero_out)),
        subnormal=int(np.count_nonzero((element_values < elem.min_normal) & (element_values > 0))),
        saturated=int(np.count_nonzero(finite_in & (element_values == elem.max_finite)
                                       & (np.abs(inputs) > np.abs(values)))),
        blocks=int(q.scale_codes.size),
        flushed_blocks=int(np.count_nonzero(nonzero_in.any(axis=-1) & np.all(zero_out | ~nonzero_in, axis=-1))),
        nan_scale_blocks=int(np.count_nonzero(np.isnan(q.scales))),
        relative_rms_error=float(np.sqrt(error / energy)) if energy > 0 else float("nan"),
    )


def _in_blocks(a: np.ndarray, q) -> np.ndarray:
    """``a`` (x's layout) as (..., blocks, block_size), the blocks along the last axis."""
    moved = np.moveaxis(a, q.axis, -1)
    return moved.reshape(*moved.shape[:-1], moved.shape[-1] // q.block_size, q.block_size)
