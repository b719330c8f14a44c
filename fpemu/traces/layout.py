"""The layout of a trace's metadata, step records and summary, shared by every trace builder.

The scenario kinds (fpemu.kinds: reference and recorded traces), fpemu.harness.ranks (per-rank traces)
and fpemu.emulate.trace (emulated runs) all write model and scaler traces through these functions, so
they cannot drift apart; fp8 training traces (fpemu.kinds.fp8_training) and emulated fp8 runs write each
cast's amax and scale through :func:`fp8_cast_fields`, and fp8 codes are digested by :func:`codes_digest`.
"""

from __future__ import annotations

import hashlib

import numpy as np

from fpemu.host import host_provenance
from fpemu.formats import decode
from fpemu.traces.format import encode_float, float_fields
from fpemu.traces.replay import replayed_metadata
from fpemu.version import __version__

REFERENCE = "reference"


def trace_metadata(scenario, implementation: str, profile: str, params: dict,
                   versions: dict, device: str, **extra) -> dict:
    """The metadata every trace carries (see fpemu.traces.format) for a scenario (its ``name``, ``path``,
    ``sha256`` and ``text``) run by ``implementation`` (``REFERENCE``: no host provenance; otherwise the
    host's facts and the CPU tiers of the frameworks in ``versions``, whatever else the process imported)."""
    return {"fpemu_version": __version__,
            "spec": {"name": scenario.name, "path": scenario.path, "sha256": scenario.sha256, "text": scenario.text},
            "implementation": implementation, "profile": profile, "params": params,
            "packages": versions, "device": device,
            # A reference trace is a pure function of its spec and fpemu's core: nothing of the host,
            # so a golden regenerated on another machine is byte-identical.
            **({} if implementation == REFERENCE else {"host": host_provenance(versions)}), **_replayed(scenario), **extra}


def _replayed(scenario) -> dict:
    return replayed_metadata(scenario)


def trace_steps(scaler_trace, fields, model_columns=None) -> tuple:
    """The step records of a ScalerTrace: the ``fields`` it has, and each model column in ``fields``."""
    ratios = scaler_trace.update_ratios() if "update_ratio" in fields else None
    records = []
    for step in range(scaler_trace.attempts):
        record = {"step": step}
        if "scale" in fields:
            record.update(float_fields("scale", scaler_trace.scales[step]))
        if "overflow" in fields:
            record["overflow"] = bool(scaler_trace.overflow[step])
        if "applied" in fields:
            record["applied"] = bool(scaler_trace.applied[step])
        if "growth_counter" in fields:
            record["growth_counter"] = int(scaler_trace.growth_counter[step])
        if "hysteresis" in fields and scaler_trace.hysteresis is not None:
            record["hysteresis"] = scaler_trace.hysteresis[step]
        if "update_ratio" in fields:
            record.update(float_fields("update_ratio", ratios[step]))
        if model_columns is not None:
            for field, column in model_columns.items():
                if field in fields:
                    record.update(float_fields(field, column[step]))
        records.append(record)
    return tuple(records)


def trace_summary(scaler_trace) -> dict:
    """The summary of a ScalerTrace in the trace layout."""
    return {"attempts": scaler_trace.attempts, "completed_updates": scaler_trace.completed_updates,
            "skipped_updates": scaler_trace.skipped_updates, **float_fields("final_scale", scaler_trace.final_scale),
            "stopped_at": scaler_trace.stopped_at,
            "events": [[step, text] for step, text in scaler_trace.events]}


def fp8_cast_fields(casts) -> dict:
    """The fp8 fields of one step record (see fpemu.traces.fields.FIELDS) from the step's casts in call order.

    Args:
      casts: ``(name, amaxes, scales)`` or ``(name, amaxes, scales, codes digest)`` per cast; amaxes and
        scales are float32 arrays (one value per tensor, or one per row).

    Returns:
      ``fp8_casts`` (the names), ``tensor_amax`` and ``tensor_scale`` (a list per cast, each float also as
      hex) and, where the casts carry digests, ``fp8_codes`` (one per cast).

    Example:
      >>> fp8_cast_fields([("layer0.input", [2.0], [224.0])])["tensor_scale_hex"]
      [['0x1.c000000000000p+7']]
    """
    casts = list(casts)
    record = {"fp8_casts": [cast[0] for cast in casts]}
    for field, position in (("tensor_amax", 1), ("tensor_scale", 2)):
        values = [[float(v) for v in np.ravel(cast[position])] for cast in casts]
        record[field] = [[encode_float(v) for v in per_cast] for per_cast in values]
        record[f"{field}_hex"] = [[v.hex() for v in per_cast] for per_cast in values]
    if casts and len(casts[0]) > 3:
        record["fp8_codes"] = [cast[3] for cast in casts]
    return record


def codes_digest(codes, fp8_format: str) -> str:
    """sha256 of one cast's fp8 codes, NaN codes written as 0xFF (their sign is unspecified).

    Example:
      >>> codes_digest(np.array([0x7F, 0xFF, 0x38], np.uint8), "fp8_e4m3fn") == codes_digest(
      ...     np.array([0xFF, 0x7F, 0x38], np.uint8), "fp8_e4m3fn")
      True
    """
    codes = np.asarray(codes, dtype=np.uint8).ravel()
    return hashlib.sha256(np.where(np.isnan(decode(codes, fp8_format)), np.uint8(0xFF), codes).tobytes()).hexdigest()


def portable_spec_path(trace, base):
    """``trace`` with its spec path relative to the root of the project the spec lies in (the nearest folder
    above it holding ``.git`` or ``pyproject.toml``), else to the folder ``base`` where the spec lies inside
    it, else the spec's file name alone: a golden must not hold the path of the host that wrote it (an
    absolute path as typed, or one relative to wherever the command ran).  A relative path is read from
    the current folder, as the spec was.

    Example:
      >>> from fpemu.traces.format import Trace
      >>> t = Trace({"spec": {"name": "s", "path": "/home/me/repo/specs/s.toml"}}, (), {})
      >>> portable_spec_path(t, "/home/me/repo").metadata["spec"]["path"], portable_spec_path(t, "/tmp").metadata["spec"]["path"]
      ('specs/s.toml', 's.toml')
    """
    import os
    import pathlib
    from fpemu.traces.format import Trace
    spec = trace.metadata.get("spec") or {}
    if not spec.get("path"):
        return trace
    path = pathlib.Path(os.path.abspath(spec["path"]))  # '..' folded, links kept: as the user named them
    root = next((folder for folder in path.parents
                 if any((folder / marker).exists() for marker in (".git", "pyproject.toml"))), None)
    base = pathlib.Path(os.path.abspath(base))
    for folder in ([root] if root is not None else []) + ([base] if base != pathlib.Path(base.anchor) else []):
        try:
            portable = path.relative_to(folder)
            break
        except ValueError:
            continue
    else:
        portable = pathlib.PurePath(path.name)
    return Trace({**trace.metadata, "spec": {**spec, "path": portable.as_posix()}}, trace.steps, trace.summary)
