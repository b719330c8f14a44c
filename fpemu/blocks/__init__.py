"""Block-scaled formats (MX with e8m0 scales, NVFP4 with e4m3 scales), rule by real implementation."""

from fpemu.blocks.quantize import BlockQuantized, block_quantize
from fpemu.blocks.rules import APPLICATIONS, EXPONENTS, NAN_ELEMENTS, SCALE_RULES, ScaleRule
from fpemu.blocks.stats import BlockStats, block_stats

__all__ = ["BlockQuantized", "block_quantize", "BlockStats", "block_stats", "SCALE_RULES", "ScaleRule", "EXPONENTS",
           "APPLICATIONS", "NAN_ELEMENTS"]
