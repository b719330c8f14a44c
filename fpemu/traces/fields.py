"""The fields of a trace's step records (format version 1), as one table: what each holds, which scenario kinds
record it, how it is compared and what values it may take.

Every other list of field names (the exact and ulp-compared ones, those real scaler adapters observe) is derived
from :data:`FIELDS`; fpemu.traces.schema checks each step record against it.

Example:
  >>> FIELDS["scale"].value[0](-1.0), fields_recorded_by("recipe")
  ('a number >= 0 or "nan", "inf"', ('scale', 'amax', 'amax_used', 'scale_inv'))
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from fpemu.traces.checks import (at_least, binade_rows, count, flag, float_hex, groups_of, integer, list_of, number,
                                 share, string)

# A step field's value check, and its exact form's (``<name>_hex``; None: it has none): see TraceField.value.
NUMBER, NONNEGATIVE, SHARE = (number, float_hex), (at_least(0), float_hex), (share, float_hex)
NUMBERS, PER_CAST = (list_of(number), list_of(float_hex)), (list_of(at_least(0), 2), list_of(float_hex, 2))
# A recorded step's per-group statistics, as fpemu.traces.recorded writes them (GroupStats, ShadowStats,
# ShadowHistogram.to_json)
GRAD_STATS = groups_of({"elements": count, **dict.fromkeys(("zero", "subnormal", "overflow", "nan"), share),
                        "max_abs": at_least(0), "min_nonzero": at_least(0)},
                       ("zero", "subnormal", "overflow", "nan", "max_abs", "min_nonzero"))
SHADOW = groups_of({"underflow": share, "subnormal": share}, ("underflow", "subnormal"))
SHADOW_HISTOGRAM = groups_of({"elements": count, "zero": count, "nonfinite": count, "binades": binade_rows})


@dataclasses.dataclass(frozen=True)
class TraceField:
    """One field of a step record.

    Attributes:
      name: its key in the step records.
      ulp: every field is compared bit for bit; for float-valued ones the ulp distance is reported too.
      recorded_by: the scenario kinds whose traces can hold it: ``scaler`` (overflow flags
        through a profile), ``model`` (a model decides the flags), ``step`` (seed 002's step),
        ``recipe`` (an fp8 scaling recipe over amaxes), ``fp8_training`` (a real fp8 training run
        against the recipe's model on the same tensors, fpemu.kinds.fp8_training), ``emulated`` (an
        fpemu.emulate run: a model's fields, and its fp8 casts under an fp8 placement), ``blocks`` (a block scale rule on probe blocks,
        fpemu.kinds.blocks) and ``recorded`` (a user's own run, see fpemu.traces.recorded).
      value: (the readable value's check, the ``<name>_hex`` form's check or None where it has none): checks
        of fpemu.traces.checks, each naming what it expects of a value that does not fit.
      observed: real scaler adapters record it unless their row's ``fields`` says otherwise (the
        DeepSpeed engine rows have no growth counter); the others only where a row lists them.
      by_default: a spec without ``[record] fields`` records it.
      trajectory: a change in it changes what training did (scales, skips, update sizes), which
        ranks above a change in numerics alone (losses, weights, shares).
      labels: the field of the same step record that names this list's elements, one name per
        element (a comparison names the first element that differs: ``layer1.weight``), or one name for the
        whole step (a blocks step's input kind: ``edges``).
    """

    name: str
    ulp: bool
    recorded_by: tuple
    value: tuple
    observed: bool = False
    by_default: bool = True
    trajectory: bool = True
    labels: Optional[str] = None

    @property
    def checks(self) -> dict:
        """Step key -> check: the field's own and, where it has one, its ``_hex`` form's."""
        readable, exact = self.value
        return {self.name: readable, **({f"{self.name}_hex": exact} if exact is not None else {})}


_ONE: Callable = lambda check: (check, None)  # noqa: E731 -- a field with no hex form

FIELDS = {field.name: field for field in [
    TraceField("scale", False, ("scaler", "model", "emulated", "step", "recipe", "recorded"), NONNEGATIVE, observed=True),
    TraceField("overflow", False, ("scaler", "model", "emulated", "step", "recorded"), _ONE(flag), observed=True),
    TraceField("applied", False, ("scaler", "model", "emulated", "step", "recorded"), _ONE(flag), observed=True),
    TraceField("growth_counter", False, ("scaler", "model", "emulated", "step", "recorded"), _ONE(count), observed=True),
    TraceField("hysteresis", False, ("scaler", "model", "emulated"), _ONE(integer)),  # Megatron counts it below 0
    TraceField("update_ratio", True, ("scaler",), NONNEGATIVE, by_default=False),  # measured by training engines only
    TraceField("loss", True, ("model", "emulated", "step", "recorded"), NUMBER, trajectory=False),
    TraceField("params", True, ("step",), NUMBERS, trajectory=False),
    TraceField("underflow_share", True, ("model", "emulated"), SHARE, trajectory=False),
    TraceField("subnormal_share", True, ("model", "emulated"), SHARE, trajectory=False),
    TraceField("overflow_share", True, ("model", "emulated"), SHARE, trajectory=False),
    # fp8 recipes (fpemu.kinds.recipe): the step's amax, the amax its scale came from, and 1/scale
    TraceField("amax", False, ("recipe",), NONNEGATIVE),
    TraceField("amax_used", False, ("recipe",), NONNEGATIVE),
    TraceField("scale_inv", False, ("recipe",), NONNEGATIVE),
    # fp8 training (fpemu.kinds.fp8_training) and emulated fp8 (fpemu.emulate): per step, the name of every
    # fp8 cast in call order, its amaxes and scales (a list per cast: one per tensor, or one per row) and a
    # digest of its fp8 codes (fpemu.traces.layout.fp8_cast_fields writes them)
    TraceField("fp8_casts", False, ("fp8_training", "emulated"), _ONE(list_of(string))),
    TraceField("tensor_amax", False, ("fp8_training", "emulated"), PER_CAST, labels="fp8_casts"),
    TraceField("tensor_scale", False, ("fp8_training", "emulated"), PER_CAST, labels="fp8_casts"),
    TraceField("fp8_codes", False, ("fp8_training",), _ONE(list_of(string)), labels="fp8_casts"),
    # block quantization (fpemu.kinds.blocks): per input kind of probe blocks, the kind,
    # the counts of blocks and elements, the two-level NVFP4 tensor scale and the sha256 of the scale codes (any
    # NaN code alike), of the element codes and of the values' float32 bits (every NaN alike)
    TraceField("block_input", False, ("blocks",), _ONE(string), trajectory=False),
    TraceField("block_count", False, ("blocks",), _ONE(count), trajectory=False, labels="block_input"),
    TraceField("element_count", False, ("blocks",), _ONE(count), trajectory=False, labels="block_input"),
    TraceField("block_tensor_scale", False, ("blocks",), NONNEGATIVE, trajectory=False, labels="block_input"),
    TraceField("scale_codes", False, ("blocks",), _ONE(string), trajectory=False, labels="block_input"),
    TraceField("element_codes", False, ("blocks",), _ONE(string), trajectory=False, labels="block_input"),
    TraceField("block_values", False, ("blocks",), _ONE(string), trajectory=False, labels="block_input"),
    # recorded runs only (fpemu.traces.recorded): the loop's own measurements
    TraceField("grad_norm", True, ("recorded",), NONNEGATIVE, by_default=False, trajectory=False),
    TraceField("lr", True, ("recorded",), NUMBER, by_default=False),  # a different rate changes the update sizes
    TraceField("grad_stats", False, ("recorded",), _ONE(GRAD_STATS), by_default=False, trajectory=False),
    TraceField("microbatches", False, ("recorded",), _ONE(count), by_default=False, trajectory=False),
    TraceField("compute_max", True, ("recorded",), NONNEGATIVE, by_default=False, trajectory=False),
    TraceField("shadow", False, ("recorded",), _ONE(SHADOW), by_default=False, trajectory=False),
    TraceField("shadow_histogram", False, ("recorded",), _ONE(SHADOW_HISTOGRAM), by_default=False, trajectory=False),
]}
EXACT_FIELDS = tuple(name for name, field in FIELDS.items() if not field.ulp)
ULP_FIELDS = tuple(name for name, field in FIELDS.items() if field.ulp)
OBSERVED_FIELDS = tuple(name for name, field in FIELDS.items() if field.observed)
RECORDING_KINDS = tuple(dict.fromkeys(kind for field in FIELDS.values() for kind in field.recorded_by))


def fields_recorded_by(kind: str, by_default: bool = False) -> tuple:
    """The fields a scenario of ``kind`` can record (``by_default``: those it records unless its spec
    lists them), in table order."""
    return tuple(name for name, field in FIELDS.items()
                 if kind in field.recorded_by and (field.by_default or not by_default))
