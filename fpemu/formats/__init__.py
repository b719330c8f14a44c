"""Number formats: values, bit-exact rounding, and what a tensor loses."""

from fpemu.formats.format import FORMATS, Format, format_names, get_format, make_format
from fpemu.formats.packing import pack_nibbles, unpack_nibbles
from fpemu.formats.rounding import (OVERFLOW_MODES, ROUNDING_MODES, decode, encode, quantize,
                                    round_to_format)
from fpemu.formats.stats import RangeStats, range_stats

__all__ = ["FORMATS", "Format", "format_names", "get_format", "make_format", "OVERFLOW_MODES",
           "ROUNDING_MODES", "decode", "encode", "quantize", "round_to_format", "RangeStats",
           "range_stats", "pack_nibbles", "unpack_nibbles"]
