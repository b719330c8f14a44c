"""The trace file format (version 1): what a run did, step by step, stored losslessly.

A trace is JSON::

    {
      "format": "fpemu-trace",
      "version": 1,
      "metadata": {
        "fpemu_version": "0.1.0",
        "spec": {"name": ..., "path": ..., "sha256": ..., "text": ...},   # the full spec text
        "implementation": "reference" | "torch@cpu" | "flax@cpu" | ...,
        "profile": "torch",                  # the profile the parameters belong to
        "params": {...},                     # every parameter, defaults included
        "packages": {"numpy": "2.4.6", ...}, # versions of what computed it (provenance: see PROVENANCE)
        "device": "cpu",
        "host": {"platform": ..., "machine": "x86_64", "python": "3.11.7",     # recorded traces only:
                 "cpu_features": ["avx2", "fma", ...], "flags": {"XLA_FLAGS": ...},   # a reference has nothing of the host
                 "torch_cpu": {"aten_cpu_capability": "AVX512", "onednn_bf16": true}}  # where torch was imported
      },
      "steps": [
        {"step": 0, "scale": 16.0, "scale_hex": "0x1.0000000000000p+4", "overflow": false,
         "applied": true, "growth_counter": 1},
        ...
      ],
      "summary": {"attempts": 16, "completed_updates": 14, "skipped_updates": 2,
                  "final_scale": 32.0, "final_scale_hex": "0x1.0000000000000p+5", "stopped_at": null},
      "checksum": "sha256:<hex of the canonical JSON of everything above>"
    }

Every float is stored twice: a readable value and ``float.hex()`` of it, which
round-trips exactly; comparisons read the hex.  Files are written with sorted
keys and fixed separators (the same trace gives the same bytes), through a
temporary file and a rename (never half-written).  A file whose checksum does
not match its content is refused, and so is one that does not fit fpemu.traces.schema (bounded before
parsing, every field checked after the checksum: docs/bounds.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pathlib

from fpemu.errors import FpemuInputError
from fpemu.fileio import atomic_write, read_bounded
from fpemu.traces.schema import READ_LIMITS, bounded_json, trace_problem

FORMAT_NAME = "fpemu-trace"
FORMAT_VERSION = 1


class TraceError(FpemuInputError):
    """A trace file that is missing, malformed, of another version, or tampered with."""


@dataclasses.dataclass(frozen=True)
class Trace:
    """A trace in memory: metadata, per-step records and a summary (all plain JSON values)."""

    metadata: dict
    steps: tuple
    summary: dict

    @property
    def implementation(self) -> str:
        return self.metadata["implementation"]

    @property
    def spec_name(self) -> str:
        return self.metadata["spec"]["name"]

    def column(self, field: str) -> list:
        """One field of every step, floats decoded from their hex form."""
        return [decode_value(record, field) for record in self.steps]


def encode_float(value: float) -> float | str:
    """JSON has no inf/NaN: store them as strings; finite floats as themselves."""
    value = float(value)
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


def float_fields(name: str, value) -> dict:
    """``{name: readable, name_hex: exact}`` for one float."""
    return {name: encode_float(value), f"{name}_hex": float(value).hex()}


def decode_value(record: dict, field: str):
    """A field of a step record, floats (and lists, or lists of lists, of floats) read exactly from their
    hex form."""
    exact = record.get(f"{field}_hex")
    if exact is not None:
        return _from_hex(exact)
    return record.get(field)


def _from_hex(exact):
    return [_from_hex(v) for v in exact] if isinstance(exact, list) else float.fromhex(exact)


def _body(trace: Trace) -> dict:
    return {"format": FORMAT_NAME, "version": FORMAT_VERSION, "metadata": trace.metadata,
            "steps": list(trace.steps), "summary": trace.summary}


def _canonical(body: dict) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


def checksum(body: dict) -> str:
    return "sha256:" + hashlib.sha256(_canonical(body).encode()).hexdigest()


def dumps(trace: Trace) -> str:
    body = _body(trace)
    body["checksum"] = checksum(body)
    return json.dumps(body, sort_keys=True, indent=1, allow_nan=False) + "\n"


def write_trace(trace: Trace, path) -> pathlib.Path:
    return atomic_write(path, dumps(trace))


# What computed a trace, not what it computed: fpemu's and the packages' versions, the host of a
# recorded run and the spec's path as typed.  Comparisons never read them (a diff names a package
# only to explain a divergence), so a golden regenerated where only they differ is the same golden.
PROVENANCE = ("fpemu_version", "packages", "host")


def behaviour(trace: Trace) -> str:
    """The canonical JSON of ``trace`` without its provenance (:data:`PROVENANCE`, ``spec.path``)."""
    metadata = {key: value for key, value in trace.metadata.items() if key not in PROVENANCE}
    if isinstance(metadata.get("spec"), dict):
        metadata["spec"] = {key: value for key, value in metadata["spec"].items() if key != "path"}
    return _canonical({"metadata": metadata, "steps": list(trace.steps), "summary": trace.summary})


def write_golden_trace(trace: Trace, path) -> pathlib.Path:
    """:func:`write_trace`, except that a valid trace at ``path`` with the same :func:`behaviour` is left
    as it is: a golden changes only when behaviour does, not with a newer numpy or another host.

    Example:
      >>> import pathlib, tempfile
      >>> golden = Trace({"spec": {"name": "s", "path": "specs/s.toml", "sha256": "0", "text": ""},
      ...                 "implementation": "reference", "packages": {"numpy": "2.4.6"}}, ({"step": 0},), {})
      >>> path = write_golden_trace(golden, pathlib.Path(tempfile.mkdtemp()) / "s.json")
      >>> newer = Trace({**golden.metadata, "packages": {"numpy": "2.5.0"}}, golden.steps, golden.summary)
      >>> before = path.read_bytes(); _ = write_golden_trace(newer, path); path.read_bytes() == before
      True
    """
    path = pathlib.Path(path)
    if path.exists():
        try:
            if behaviour(read_trace(path)) == behaviour(trace):
                return path
        except TraceError:  # unreadable or tampered with: replace it
            pass
    return write_trace(trace, path)


def loads(text: str | bytes, path: str = "<string>") -> Trace:
    """The trace in ``text``: bounded before it is parsed, its checksum checked, then every field against
    fpemu.traces.schema (a checksum anyone can recompute proves no more than that the file is as written)."""
    body = bounded_json(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text, path, TraceError)
    if isinstance(body, dict) and "format" not in body and "steps" in body:
        raise TraceError(f"{path}: not a trace file but a command's --json result (no 'format' key; `fpemu "
                         "simulate --json` prints one; `fpemu simulate --save DIR` writes traces): traces come from `fpemu golden`, `fpemu record`, `fpemu diff "
                         "--save`, record_torch and record_jax")
    if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
        raise TraceError(f"{path}: not a trace file: 'format' is not {FORMAT_NAME!r}")
    if body.get("version") != FORMAT_VERSION:
        raise TraceError(f"{path}: trace version {body.get('version')!r}; this fpemu reads version {FORMAT_VERSION}")
    stored = body.pop("checksum", None)
    try:
        computed = checksum(body)
    except ValueError:  # NaN or inf literals: no fpemu writer produces them
        computed = None
    if stored != computed:
        raise TraceError(f"{path}: checksum mismatch: the file was modified or corrupted after it was written "
                         "(regenerate it: `fpemu golden` for golden traces, `fpemu record` for baselines)")
    problem = trace_problem(body)
    if problem:
        raise TraceError(f"{path}: not a valid trace: {problem}")
    return Trace(body["metadata"], tuple(body["steps"]), body["summary"])


def read_trace(path) -> Trace:
    return loads(read_bounded(path, TraceError, READ_LIMITS["bytes"]), str(path))


def trace_filename(spec_name: str, implementation: str) -> str:
    """Where a trace of ``spec_name`` by ``implementation`` lives inside a folder."""
    safe = implementation.replace("@", "-")
    return f"{spec_name}.json" if implementation == "reference" else f"{spec_name}.{safe}.json"
