"""Versioned, checksummed, lossless trace files."""

from fpemu.traces.format import (FORMAT_VERSION, Trace, TraceError, decode_value, dumps,
                                 float_fields, loads, read_trace, trace_filename, write_golden_trace, write_trace)

__all__ = ["FORMAT_VERSION", "Trace", "TraceError", "decode_value", "dumps",
           "float_fields", "loads", "read_trace", "trace_filename", "write_golden_trace", "write_trace"]
