"""Traces of block quantization: per input kind, digests of a rule's scale codes, element codes and values.

A run of a [blocks] scenario (fpemu.kinds.blocks.spec) quantizes one set of seeded probe blocks per input
kind (:func:`fpemu.blocks.probes.probe_blocks`) and writes one step record per kind: the kind, the
counts of blocks and elements, the two-level NVFP4 tensor scale (hex float) and the sha256 of the
scale codes, of the element codes and of the values' float32 bits (fields of
:data:`fpemu.traces.fields.FIELDS`).  The digests are NaN-aware as the recipe pages compare:

- scale codes: every code whose scale is NaN hashes as 0xFF (e4m3 has two NaN codes, 0x7F and 0xFF,
  and TE's reference picks one by where torch's vector loop put the block; e8m0 has one);
- element codes: as they are (a NaN element's code is a rule's policy, fpemu.blocks.NAN_ELEMENTS,
  and its sign is part of it);
- values: every NaN hashes as the float32 pattern 0x7FC00000.

The reference trace is fpemu's model (:func:`fpemu.block_quantize`, numpy only); a recorded trace is a
blocks adapter (fpemu.adapters) on the very same blocks, and its metadata's ``model_differences``
counts, per kind, the codes and values in which it differs from fpemu's model of the spec's rule
(kept for the divergence's cause: the digests say where, the counts how much; not compared).
"""

from __future__ import annotations

import hashlib

import numpy as np

from fpemu.blocks import SCALE_RULES, block_quantize
from fpemu.blocks.probes import PROBE_KINDS, probe_blocks
from fpemu.formats import decode
from fpemu.adapters import (BLOCKS, adapter_versions, adapters_of_kind, driven_rules, get_adapter, package_versions,
                            quantize_blocks)
from fpemu.traces.layout import REFERENCE, codes_digest, trace_metadata
from fpemu.traces import Trace, float_fields

_CANONICAL_NAN = np.uint32(0x7FC00000)


def probe_inputs(scenario) -> list:
    """(kind, float32 blocks of ``rows`` x ``columns``) per step of a BlocksScenario."""
    return [(kind, probe_blocks(kind, scenario.element, rows=scenario.rows, block_size=scenario.columns,
                                seed=scenario.seed + PROBE_KINDS.index(kind))) for kind in scenario.kinds]


def values_digest(values) -> str:
    """sha256 of float32 ``values``' bits, every NaN written as 0x7FC00000 first.

    Example:
      >>> a = np.array([1.0, np.nan], np.float32)
      >>> values_digest(a) == values_digest(np.array([1.0, -np.nan], np.float32))
      True
    """
    return hashlib.sha256(_canonical_bits(values).astype("<u4").tobytes()).hexdigest()


def _canonical_bits(values) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    return np.where(np.isnan(values), _CANONICAL_NAN, values.view(np.uint32))


def _nan_alike_scale_codes(q) -> np.ndarray:
    """``q``'s scale codes with every NaN code as 0xFF, as :func:`codes_digest` hashes them."""
    codes = np.asarray(q.scale_codes, np.uint8)
    return np.where(np.isnan(decode(codes, q.scale_format)), np.uint8(0xFF), codes)


def block_record(step: int, kind: str, q, fields) -> dict:
    """The step record of one kind's BlockQuantized ``q``: the ``fields`` (FIELDS rows of kind blocks) it has."""
    columns = {"block_input": kind, "block_count": int(q.scale_codes.size), "element_count": int(q.element_codes.size),
               "scale_codes": codes_digest(q.scale_codes, q.scale_format.name),
               "element_codes": hashlib.sha256(np.ascontiguousarray(q.element_codes, np.uint8).tobytes()).hexdigest(),
               "block_values": values_digest(q.values)}
    record = {"step": step, **{field: columns[field] for field in fields if field in columns}}
    if "block_tensor_scale" in fields and q.tensor_scale is not None:
        record.update(float_fields("block_tensor_scale", q.tensor_scale))
    return record


def differences(model, real) -> dict:
    """How many scale codes (any NaN code alike), element codes and values (float32 bits, NaN-aware)
    of ``real`` differ from ``model``'s, with the counts of blocks and elements."""
    model_bits, real_bits = _canonical_bits(model.values), _canonical_bits(real.values)
    return {"scale_codes": int(np.count_nonzero(_nan_alike_scale_codes(model) != _nan_alike_scale_codes(real))),
            "element_codes": int(np.count_nonzero(np.asarray(model.element_codes) != np.asarray(real.element_codes))),
            "block_values": int(np.count_nonzero(model_bits != real_bits)),
            "blocks": int(model.scale_codes.size), "elements": int(model.element_codes.size)}


def _model(scenario, x):
    return block_quantize(x, scenario.element, scenario.block_size, scale_rule=scenario.rule)


def _summary(steps: int) -> dict:
    """A blocks step is one quantization: an attempt that completes (no loss scale, no events)."""
    return {"attempts": steps, "completed_updates": steps, "skipped_updates": 0, "stopped_at": None, "events": []}


def reference_blocks_trace(scenario) -> Trace:
    """The golden trace of a BlocksScenario: fpemu's model of its rule on every kind's probe blocks."""
    driven = any(scenario.rule in driven_rules(name) for name in adapters_of_kind(BLOCKS))
    metadata = trace_metadata(scenario, REFERENCE, scenario.rule, scenario.params,
                              package_versions(["numpy", "ml_dtypes"]), "cpu",
                              verified="driven" if driven else "source-derived")
    steps = tuple(block_record(step, kind, _model(scenario, x), scenario.record)
                  for step, (kind, x) in enumerate(probe_inputs(scenario)))
    return Trace(metadata, steps, _summary(len(steps)))


def recorded_blocks_trace(scenario, impl) -> Trace:
    """The blocks adapter ``impl`` run on the scenario's probe blocks under its rule (``params.rule``, else
    the spec's); its metadata's ``model_differences`` counts, per kind, where it differs from fpemu's model."""
    rule = scenario.rule_of(impl)
    steps, counted = [], {}
    for step, (kind, x) in enumerate(probe_inputs(scenario)):
        real = quantize_blocks(impl.name, x, scenario.element, rule, impl.device)
        steps.append(block_record(step, kind, real, scenario.record))
        counted[kind] = differences(_model(scenario, x), real)
    metadata = trace_metadata(scenario, impl.key, rule, {**scenario.params, "rule": rule},
                              adapter_versions(get_adapter(impl.name)), impl.device, model_differences=counted)
    return Trace(metadata, tuple(steps), _summary(len(steps)))


def block_cause(field: str, step: int, golden: Trace, observed: Trace) -> str:
    """Why a blocks trace's step differs from the golden's: its input kind, how many codes and values differ
    (``model_differences``, where the observed trace counted them), and the rules' own account of their
    arithmetic (``source`` and ``departs``, fpemu.blocks.SCALE_RULES)."""
    kind = golden.steps[step].get("block_input", f"step {step}")
    expected, got = golden.metadata.get("profile"), observed.metadata.get("profile")
    counts = (observed.metadata.get("model_differences") or {}).get(kind)
    parts = [f"{kind} blocks"]
    if counts:
        parts.append(f"{counts['scale_codes']} of {counts['blocks']} scale codes, {counts['element_codes']} of "
                     f"{counts['elements']} element codes and {counts['block_values']} of {counts['elements']} "
                     "values differ from fpemu's model")
    if expected != got:
        parts.append(f"{observed.implementation} ran rule {got} ({_source(got)}) where the golden is fpemu's "
                     f"model of {expected} ({_source(expected)})")
    else:
        parts.append(f"{expected} ({_source(expected)}) departs from exact: "
                     f"{SCALE_RULES[expected].departs if expected in SCALE_RULES else 'unknown rule'}; the real code "
                     "changed, or fpemu's model did since the golden was made (it holds for the versions in its "
                     "metadata)")
    return "; ".join(parts)


def _source(rule: str) -> str:
    return SCALE_RULES[rule].source if rule in SCALE_RULES else "not a rule of this fpemu"
