"""Recorded traces: a real training run (torch or JAX) stored as a trace v1.

A recorded trace is an ordinary trace (see :mod:`fpemu.traces.format`), so ``fpemu compare``,
``fpemu diff`` and replay read it like any other.  What marks it and what it adds::

    "metadata": {
      ...the keys every trace has ("spec" describes the run, "implementation": "torch@cpu"),
      "source": "recorded_run",
      "framework": "torch" | "jax",
      "profile": "torch",  "params": {"init_scale": 65536.0, ...},   # the scaler as the run held it
      "recorder": {"groups": "module", "shadow_every": 10, "compute_format": "fp16", ...},
      "host": {...}                                                  # fpemu.host.host_provenance()
    },
    "steps": [   # one record per update attempt (scaler.step / an optax update)
      {"step": 0, "scale": 65536.0, "scale_hex": ..., "overflow": false, "applied": true,
       "growth_counter": 1,
       "loss": 10.9, "loss_hex": ...,            # unscaled (the value handed to the scaler)
       "grad_norm": 3.1, "grad_norm_hex": ...,   # unscaled, before clipping; inf/nan on overflow
       "lr": 0.0001, "lr_hex": ...,              # the optimizer's (first group's) rate at the attempt
       "grad_stats": {"h.0.attn": {"elements": 49152, "zero": 0.01, "zero_hex": ..., "subnormal": ...,
                                   "overflow": ..., "nan": ..., "max_abs": ..., "min_nonzero": ...}},
       "shadow": {"h.0.attn": {"underflow": 0.02, "underflow_hex": ..., "subnormal": ...}},   # sampled steps
       "shadow_histogram": {"h.0.attn": {"elements": 49152, "zero": 12, "nonfinite": 0,        # sampled steps
                                         "binades": {"-20": [3, 512, 260, 121, ...], ...}}}},
      ...
    ],
    "summary": {"attempts": 20, "completed_updates": 19, "skipped_updates": 1, "examples": 160,
                "scheduler_steps": 20, "final_scale": ..., "final_scale_hex": ..., "stopped_at": null}

``grad_stats`` describe each group's gradients as the run holds them at the attempt's scale
(scaled, before unscaling), rounded to the recorder's compute format: the shares of elements that
are zero, subnormal, beyond the format's range (``overflow``, inf included) and NaN there, and
the largest magnitude and the smallest nonzero magnitude of the stored (scaled) values.  The torch
recorder classes a gradient that autocast leaves in float32 (a norm's weight, an embedding: computed in
float32, never held in the compute format) by float32's range instead: it counts as beyond the range
only where it is inf, and as subnormal only below float32's smallest normal.  Where an
attempt accumulates several backward passes (microbatches) the torch recorder measures each pass's
own gradient as the backward hands it to the parameter (in the compute format where autocast cast
the parameter), not the float32 sum in ``.grad``, which may exceed the format's range without any
pass overflowing: the step then holds ``"microbatches": n``, the shares are of ``elements * n``
values and the extremes are over the passes.
``shadow`` compares a float32 pass over the same batch (autocast off) with the run's gradients
element by element: ``underflow`` is the share of elements nonzero in float32 but zero in the run,
``subnormal`` the share nonzero in float32 but subnormal in the compute format in the run.
``shadow_histogram`` keeps the float32 pass's gradient magnitudes themselves, counted per binade
(``2**b <= |g| < 2**(b+1)``, float32 subnormals included): per binade ``[powers, n_0, n_1, ...]``,
the exact powers of two and the values whose fraction (the bits below the leading one) starts with
exactly k ones, plus the group's float32 zeros and non-finite values (traces without it stay
readable: it is optional).  From it, :meth:`ShadowHistogram.shares` counts what rounding the float32
gradients once, at any scale and into any format, makes zero or subnormal: exactly at power-of-two
scales (every fpemu format's zero edge is a power of two and its normal edge a tie point, whose
fractions the histogram resolves), within bounds at other scales.  A replay under another scale or
format (:mod:`fpemu.traces.replay`) recomputes the true underflow from it.

Every float is stored as a readable value and its ``float.hex()`` (the trace rule); the reader
decodes the hex.  This module imports no framework: the torch and JAX recorders both build their
records with it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from typing import Mapping, NamedTuple, Optional

import numpy as np

from fpemu.host import host_provenance
from fpemu.formats import get_format
from fpemu.formats.rounding import round_to_format
from fpemu.traces.binades import NONFINITE_CODE, ZERO_CODE, count_below, sparse_binades
from fpemu.traces.format import Trace, TraceError, decode_value, float_fields
from fpemu.version import __version__

SOURCE = "recorded_run"
FRAMEWORKS = ("torch", "jax")


def _floats(**values) -> dict:
    """Each float as its readable value and its exact hex form."""
    out = {}
    for name, value in values.items():
        out.update(float_fields(name, value))
    return out


def _read(raw: Mapping, key: str, where: str, kind: type = float):
    """``raw[key]`` decoded (floats from their hex form), checked to be of ``kind``."""
    if key not in raw:
        raise TraceError(f"{where}: missing {key!r}")
    value = decode_value(raw, key)
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TraceError(f"{where}.{key}: expected {kind.__name__}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class GroupStats:
    """One group's gradients at one attempt, at the attempt's scale, in the compute format.

    Attributes:
      elements: gradient elements in the group (parameters without a gradient count as zeros).
      zero, subnormal, overflow, nan: shares of ``elements`` that round to zero, to a subnormal,
        beyond the largest finite value (or are inf), and that are NaN.
      max_abs: the largest magnitude of the stored (scaled) values (inf if any is inf; NaN ignored).
      min_nonzero: the smallest nonzero magnitude of the stored values (inf if all are zero).
    """

    elements: int
    zero: float
    subnormal: float
    overflow: float
    nan: float
    max_abs: float
    min_nonzero: float

    SHARES = ("zero", "subnormal", "overflow", "nan")

    @classmethod
    def from_counts(cls, elements: int, zero: int, subnormal: int, overflow: int, nan: int,
                    max_abs: float, min_nonzero: float) -> "GroupStats":
        """Shares from element counts (0 shares for an empty group)."""
        def share(count):
            return count / elements if elements else 0.0
        return cls(int(elements), share(zero), share(subnormal), share(overflow), share(nan),
                   float(max_abs), float(min_nonzero))

    def to_json(self) -> dict:
        return {"elements": self.elements, **_floats(**{name: getattr(self, name) for name in
                                                          self.SHARES + ("max_abs", "min_nonzero")})}

    @classmethod
    def from_json(cls, raw: Mapping, where: str) -> "GroupStats":
        if not isinstance(raw, Mapping):
            raise TraceError(f"{where}: expected a table of gradient statistics, got {raw!r}")
        return cls(_read(raw, "elements", where, int),
                   *(_read(raw, name, where) for name in cls.SHARES + ("max_abs", "min_nonzero")))


@dataclasses.dataclass(frozen=True)
class ShadowStats:
    """One group's true underflow at a sampled attempt (float32 shadow pass vs the run).

    Attributes:
      underflow: share of elements nonzero in the float32 pass but zero in the run's gradients.
      subnormal: share nonzero in the float32 pass but subnormal (compute format) in the run's.
    """

    underflow: float
    subnormal: float

    def to_json(self) -> dict:
        return _floats(underflow=self.underflow, subnormal=self.subnormal)

    @classmethod
    def from_json(cls, raw: Mapping, where: str) -> "ShadowStats":
        if not isinstance(raw, Mapping):
            raise TraceError(f"{where}: expected a table of shadow statistics, got {raw!r}")
        return cls(_read(raw, "underflow", where), _read(raw, "subnormal", where))


@dataclasses.dataclass(frozen=True)
class ShadowShares:
    """What rounding a group's float32 shadow gradients once at one scale into one format does, as
    counts or shares of the group's elements, each a (lower, upper) bound (equal where exact).

    Attributes:
      underflow: nonzero in float32, zero once scaled and rounded.
      subnormal: nonzero in float32, subnormal once scaled and rounded.
    """

    underflow: tuple
    subnormal: tuple

    @property
    def exact(self) -> bool:
        return self.underflow[0] == self.underflow[1] and self.subnormal[0] == self.subnormal[1]

    def per(self, elements: int) -> "ShadowShares":
        """Counts as shares of ``elements`` (0 for none)."""
        def share(pair):
            return tuple(n / elements if elements else 0.0 for n in pair)
        return ShadowShares(share(self.underflow), share(self.subnormal))

    @classmethod
    def total(cls, counts) -> "ShadowShares":
        """The sum of several :meth:`ShadowHistogram.counts`."""
        counts = list(counts)
        return cls(*(tuple(sum(getattr(c, name)[i] for c in counts) for i in range(2))
                     for name in ("underflow", "subnormal")))


def _bounds_below(binades: dict, value: float, inclusive: bool, exact: bool) -> tuple:
    """count_below, widened by a float64 ulp either side where ``value`` came from an inexact division."""
    if exact or math.isinf(value) or value == 0:
        return count_below(binades, value, inclusive)
    return (count_below(binades, value * (1 - 2.0 ** -52), inclusive)[0],
            count_below(binades, value * (1 + 2.0 ** -52), inclusive)[1])


@dataclasses.dataclass(frozen=True)
class ShadowHistogram:
    """One group's float32 shadow-pass gradient magnitudes at a sampled attempt, by binade.

    Attributes:
      elements: gradient elements in the group (parameters without a shadow gradient count as zeros).
      zero: elements that are zero in the float32 pass.
      nonfinite: elements that are inf or NaN in the float32 pass.
      binades: binade b (``2**b <= |g| < 2**(b+1)``) -> ``(powers, n_0, n_1, ...)``: the exact powers
        of two, and the other values whose fraction starts with exactly k one bits (trailing zero
        counts left out); only binades that hold a value.
    """

    elements: int
    zero: int
    nonfinite: int
    binades: Mapping

    @classmethod
    def from_counts(cls, elements: int, counts) -> "ShadowHistogram":
        """From a dense histogram of :data:`fpemu.traces.binades.CODES` counts of the group's present
        elements (the rest count as zeros)."""
        counts = [int(n) for n in counts]
        present = sum(counts)
        binades = {b: tuple(row) for b, row in sparse_binades(counts).items()}
        return cls(int(elements), int(elements) - present + counts[ZERO_CODE], counts[NONFINITE_CODE], binades)

    def counts(self, scale: float, fmt) -> ShadowShares:
        """How many elements nonzero in float32 multiplying by ``scale`` (exactly) and rounding once into
        ``fmt`` (nearest even, at fpemu's kernel edges) makes zero or subnormal, as (lower, upper) counts.

        Exact where ``scale`` is a power of two (or 0 or inf); otherwise bounds.
        """
        zero_at_most, normal_from, _ = format_thresholds(fmt)
        exact = scale == 0 or math.isinf(scale) or math.frexp(scale)[0] == 0.5

        def edge(threshold):
            return threshold / scale if scale else math.inf

        binades = {b: list(row) for b, row in self.binades.items()}
        under = _bounds_below(binades, edge(zero_at_most), True, exact)
        below_normal = _bounds_below(binades, edge(normal_from), False, exact)
        return ShadowShares(under, (max(0, below_normal[0] - under[1]), max(0, below_normal[1] - under[0])))

    def shares(self, scale: float, fmt) -> ShadowShares:
        """:meth:`counts` as shares of the group's elements.

        Example:
          >>> import numpy as np
          >>> from fpemu.traces.binades import CODES, numpy_codes
          >>> grads = np.array([2.0 ** -26, 2.0 ** -25, 3e-8, 1e-5, 0.0], np.float32)
          >>> hist = ShadowHistogram.from_counts(5, np.bincount(numpy_codes(grads), minlength=CODES))
          >>> hist.shares(1.0, "fp16")        # 2^-26 and the tie 2^-25 round to zero; 3e-8 and 1e-5 are subnormal
          ShadowShares(underflow=(0.4, 0.4), subnormal=(0.4, 0.4))
          >>> hist.shares(2.0 ** 10, "fp16").underflow, hist.shares(1.0, "bf16").underflow
          ((0.0, 0.0), (0.0, 0.0))
        """
        return self.counts(scale, fmt).per(self.elements)

    def to_json(self) -> dict:
        return {"elements": self.elements, "zero": self.zero, "nonfinite": self.nonfinite,
                "binades": {str(b): list(row) for b, row in self.binades.items()}}

    @classmethod
    def from_json(cls, raw: Mapping, where: str) -> "ShadowHistogram":
        if not isinstance(raw, Mapping) or not isinstance(raw.get("binades"), Mapping):
            raise TraceError(f"{where}: expected a shadow histogram (elements, zero, nonfinite, binades), got {raw!r}")
        binades = {}
        for key, row in raw["binades"].items():
            if not (key.lstrip("-").isdigit() and isinstance(row, list) and row
                    and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in row)):
                raise TraceError(f"{where}.binades.{key}: expected a binade -> a list of counts, got {row!r}")
            binades[int(key)] = tuple(row)
        return cls(*(_read(raw, name, where, int) for name in ("elements", "zero", "nonfinite")), binades)


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """One update attempt of a recorded run.

    Attributes:
      step: the attempt's index.
      scale: the loss scale the attempt's gradients carry (before the scaler's update).
      overflow: the scaler found inf/NaN in the gradients.
      applied: the optimizer's update ran (not skipped).
      growth_counter: the scaler's growth tracker after its update (None where not exposed).
      loss: the unscaled loss (summed over the attempt's microbatches), None where not seen.
      grad_norm: the unscaled gradient norm before clipping, None where not measured.
      lr: the learning rate the attempt used (first parameter group), None where unknown.
      grad_stats: group name -> :class:`GroupStats` (empty where statistics are off).
      shadow: group name -> :class:`ShadowStats` on sampled attempts, else None.
      shadow_histogram: group name -> :class:`ShadowHistogram` on sampled attempts, else None.
      microbatches: the backward passes the attempt accumulated, where more than one (None: one, or
        not observed); ``grad_stats`` then describe every pass's own gradient, not their sum.
      compute_max: the largest gradient magnitude the attempt's backward passes computed in the compute
        format, at the attempt's scale (inf where one overflowed; None where not observed): module
        outputs' gradients held in the format (where a backward overflows first) and the gradients of
        parameters autocast cast to it, not float32 gradients (a norm's weight, an embedding) that no
        scale makes overflow the format.  Replay decides overflow at another scale from it.
    """

    step: int
    scale: float
    overflow: bool
    applied: bool
    growth_counter: Optional[int] = None
    loss: Optional[float] = None
    grad_norm: Optional[float] = None
    lr: Optional[float] = None
    grad_stats: Mapping = dataclasses.field(default_factory=dict)
    shadow: Optional[Mapping] = None
    shadow_histogram: Optional[Mapping] = None
    microbatches: Optional[int] = None
    compute_max: Optional[float] = None

    def max_abs(self) -> float:
        """The largest stored gradient magnitude over every group (0 without statistics)."""
        return max((stats.max_abs for stats in self.grad_stats.values()), default=0.0)


_OPTIONAL_FLOATS = ("loss", "grad_norm", "lr", "compute_max")
_OPTIONAL_INTS = ("growth_counter", "microbatches")
# the per-group tables of sampled (shadow-pass) attempts: step field -> its class
_PER_GROUP_SAMPLED = {"shadow": ShadowStats, "shadow_histogram": ShadowHistogram}


def to_step_record(step: RecordedStep) -> dict:
    """The trace's step record of ``step`` (keys left out where a value is None).

    Example:
      >>> record = to_step_record(RecordedStep(0, 1024.0, False, True, growth_counter=1, loss=2.5))
      >>> record["scale_hex"], record["loss"], "grad_norm" in record
      ('0x1.0000000000000p+10', 2.5, False)
    """
    record = {"step": step.step, **float_fields("scale", step.scale), "overflow": bool(step.overflow),
              "applied": bool(step.applied)}
    for name in _OPTIONAL_INTS:
        if getattr(step, name) is not None:
            record[name] = int(getattr(step, name))
    for name in _OPTIONAL_FLOATS:
        if getattr(step, name) is not None:
            record.update(float_fields(name, getattr(step, name)))
    if step.grad_stats:
        record["grad_stats"] = {group: stats.to_json() for group, stats in step.grad_stats.items()}
    for name in _PER_GROUP_SAMPLED:
        if getattr(step, name) is not None:
            record[name] = {group: stats.to_json() for group, stats in getattr(step, name).items()}
    return record


def from_step_record(record: Mapping) -> RecordedStep:
    """A :class:`RecordedStep` read back from a step record (floats exact, from their hex form).

    Raises:
      TraceError: a key is missing or of the wrong type (the message names the step and key).
    """
    where = f"steps[{record.get('step', '?')}]"
    optional = {name: _read(record, name, where) if name in record else None for name in _OPTIONAL_FLOATS}
    optional.update((name, _read(record, name, where, int) if name in record else None) for name in _OPTIONAL_INTS)
    grad_stats = {group: GroupStats.from_json(raw, f"{where}.grad_stats.{group}")
                  for group, raw in record.get("grad_stats", {}).items()}
    sampled = {name: None if record.get(name) is None else
               {group: kind.from_json(raw, f"{where}.{name}.{group}") for group, raw in record[name].items()}
               for name, kind in _PER_GROUP_SAMPLED.items()}
    return RecordedStep(
        step=_read(record, "step", where, int), scale=_read(record, "scale", where),
        overflow=_read(record, "overflow", where, bool), applied=_read(record, "applied", where, bool),
        grad_stats=grad_stats, **sampled, **optional)


@dataclasses.dataclass(frozen=True)
class RecorderSettings:
    """How a run was recorded (the trace's ``metadata.recorder``).

    Attributes:
      groups: how gradients were grouped: ``module``, ``parameter``, or the name of the user's
        grouping function.
      shadow_every: a float32 shadow pass every this many attempts (0: never).
      compute_format: the fpemu format the gradient statistics round to (``fp16``, ``bf16``...).
      statistics: whether per-group gradient statistics were computed.
      applied_assumed: how many steps' ``applied`` the recorder took from ``overflow`` instead of
        observing the update (JAX, where the loop gave neither ``applied`` nor the parameters); written
        only where it is not 0.
    """

    groups: str = "module"
    shadow_every: int = 0
    compute_format: str = "fp16"
    statistics: bool = True
    applied_assumed: int = 0

    def __post_init__(self):
        for name in ("shadow_every", "applied_assumed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        get_format(self.compute_format)  # an unknown name raises, listing the known ones

    def to_json(self) -> dict:
        settings = dataclasses.asdict(self)
        if not self.applied_assumed:  # traces recorded before it, and every observed run, read the same
            del settings["applied_assumed"]
        return settings


_POSITIVE_FLOAT32_PATTERNS = (1, 0x7F800000)  # smallest subnormal .. +inf


class RoundingLimits(NamedTuple):
    """float32 magnitudes that split what rounding to a format does (nearest even, overflow to inf).

    Attributes:
      zero: the largest magnitude that rounds to zero.
      subnormal: the largest magnitude whose result is below the format's min normal.
      overflow: the smallest magnitude that overflows (inf or NaN, or saturates, beyond max finite).
    """

    zero: np.float32
    subnormal: np.float32
    overflow: np.float32


def _first_pattern(predicate) -> int:
    """Smallest positive float32 bit pattern p with ``predicate(magnitude of p)``, monotone in p."""
    lo, hi = _POSITIVE_FLOAT32_PATTERNS
    while lo < hi:
        mid = (lo + hi) // 2
        value = np.array([mid], np.uint32).view(np.float32)
        lo, hi = (lo, mid) if predicate(value) else (mid + 1, hi)
    return lo


def _from_pattern(pattern: int) -> np.float32:
    return np.array([pattern], np.uint32).view(np.float32)[0]


@functools.lru_cache(maxsize=None)
def rounding_limits(fmt) -> RoundingLimits:
    """The float32 rounding boundaries of ``fmt`` (a Format or name), found with fpemu's kernel.

    Example:
      >>> limits = rounding_limits("fp16")
      >>> float(limits.zero) == 2.0 ** -25, float(limits.overflow)
      (True, 65520.0)
    """
    fmt = get_format(fmt)

    def rounded(value):
        return round_to_format(value, fmt)

    zero = _first_pattern(lambda v: rounded(v).values[0] != 0) - 1
    subnormal = _first_pattern(lambda v: abs(rounded(v).values[0]) >= fmt.min_normal) - 1
    overflow = _first_pattern(lambda v: bool(rounded(v).overflowed[0]))
    return RoundingLimits(_from_pattern(zero), _from_pattern(subnormal), _from_pattern(overflow))


def format_thresholds(fmt) -> tuple:
    """Where round-to-nearest-even into ``fmt`` changes class, as Python floats: (zero_at_most,
    normal_from, overflow_from).  ``|x| <= zero_at_most`` rounds to zero, ``|x| < normal_from``
    (and above zero_at_most) to a subnormal, ``|x| >= overflow_from`` beyond the largest finite
    value.  They are :func:`rounding_limits`, found with fpemu's kernel, so every tie goes where the
    kernel sends it: fp16's 65520 overflows (its largest finite mantissa is odd), fp8_e4m3fn's 464
    rounds down to 448 (even), so its overflow starts one float32 value above.

    Example:
      >>> format_thresholds("fp16")
      (2.9802322387695312e-08, 6.1005353927612305e-05, 65520.0)
      >>> format_thresholds("fp8_e4m3fn")[2] > 464.0
      True
    """
    limits = rounding_limits(get_format(fmt))
    normal_from = np.nextafter(limits.subnormal, np.float32(np.inf))
    return float(limits.zero), float(normal_from), float(limits.overflow)


def recorded_metadata(*, framework: str, name: str, device: str, profile: str, params: dict,
                      packages: dict, settings: RecorderSettings, description: str = "") -> dict:
    """The metadata of a recorded trace.

    Args:
      framework: ``torch`` or ``jax``.
      name: the run's name (the trace's ``spec.name``).
      device: where the run computed (``cpu``, ``cuda``...).
      profile, params: the scaler's fpemu profile and its parameters as the run's scaler holds them.
      packages: versions of what computed the run.
      settings: the :class:`RecorderSettings`.
      description: a line about the run, kept as the spec text.

    Returns:
      The metadata dict; its ``spec`` has no file (``path`` empty) and hashes its text.
    """
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    text = description or f"a {framework} training run recorded by fpemu.record_{framework}"
    return {"fpemu_version": __version__,
            "spec": {"name": name, "path": "", "sha256": hashlib.sha256(text.encode()).hexdigest(), "text": text},
            "implementation": f"{framework}@{device}", "profile": profile, "params": dict(params),
            "packages": dict(packages), "device": device, "host": host_provenance(),
            "source": SOURCE, "framework": framework, "recorder": settings.to_json()}


def audit_findings(findings) -> dict:
    """A recorded trace's ``metadata.audit_findings``: per kind of audit finding, how many and the first step.

    Example:
      >>> from types import SimpleNamespace as F
      >>> audit_findings([F(kind="clip_before_unscale", step=2), F(kind="clip_before_unscale", step=3)])
      {'clip_before_unscale': {'count': 2, 'first_step': 2}}
    """
    out = {}
    for finding in findings:
        entry = out.setdefault(finding.kind, {"count": 0, "first_step": finding.step})
        entry["count"] += 1
        entry["first_step"] = min(entry["first_step"], finding.step)
    return out


def recorded_trace(metadata: dict, steps, *, final_scale: float, examples: Optional[int],
                   scheduler_steps: int, stopped_at: Optional[int] = None) -> Trace:
    """A recorded :class:`~fpemu.traces.Trace` from its metadata and :class:`RecordedStep` s.

    The summary counts attempts, completed and skipped updates from the steps, and keeps
    ``examples`` (None where the batch size is unknown), ``scheduler_steps`` and the final scale.
    """
    steps = tuple(steps)
    completed = sum(1 for step in steps if step.applied)
    summary = {"attempts": len(steps), "completed_updates": completed, "skipped_updates": len(steps) - completed,
               "examples": examples, "scheduler_steps": int(scheduler_steps),
               **float_fields("final_scale", final_scale), "stopped_at": stopped_at}
    return Trace(metadata, tuple(to_step_record(step) for step in steps), summary)


def is_recorded(trace: Trace) -> bool:
    return trace.metadata.get("source") == SOURCE


def recorded_steps(trace: Trace, path: str = "<trace>") -> tuple:
    """The :class:`RecordedStep` s of a recorded trace.

    Raises:
      TraceError: ``trace`` is not a recorded run (its ``metadata.source`` is not ``recorded_run``)
        or a step record is malformed.
    """
    if not is_recorded(trace):
        raise TraceError(f"{path}: not a recorded run: metadata.source is {trace.metadata.get('source')!r}, "
                         f"expected {SOURCE!r} (record one with fpemu.record_torch)")
    return tuple(from_step_record(record) for record in trace.steps)


def recorder_settings(trace: Trace, path: str = "<trace>") -> RecorderSettings:
    """The :class:`RecorderSettings` a recorded trace was made with."""
    raw = trace.metadata.get("recorder")
    try:
        return RecorderSettings(**raw)
    except (TypeError, ValueError) as error:
        raise TraceError(f"{path}: metadata.recorder: {error} (got {json.dumps(raw)})") from None


__all__ = ["SOURCE", "FRAMEWORKS", "GroupStats", "ShadowStats", "ShadowHistogram", "ShadowShares", "RecordedStep", "RecorderSettings",
           "to_step_record", "from_step_record", "format_thresholds", "RoundingLimits", "rounding_limits", "recorded_metadata", "recorded_trace",
           "is_recorded", "recorded_steps", "recorder_settings"]
