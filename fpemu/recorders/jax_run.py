"""Record a JAX training run (optax, jmp, flax DynamicScale, Keras on JAX) as a trace, from inside jit.

A jitted step cannot be watched from outside and its gradients should not leave the device, so the
recording has two halves:

* :func:`grad_stats`, called by the user inside the jitted step on the gradients, returns a small
  pytree of counts and maxima per leaf (or per module): what the compute format makes of the scaled
  gradients.  The step returns it as aux; no gradient is copied to the host.
* :class:`JaxRecorder`, on the host, appends one attempt per step (the statistics, the scale state,
  loss, gradient norm, learning rate) and writes the recorded trace.

The format's rounding boundaries are found once on the host with fpemu's own rounding kernel (the
largest float32 that rounds to zero, the largest that stays subnormal, the smallest that overflows),
so inside jit each statistic is a comparison against a float32 constant: exact for every fpemu
format, native to XLA or not, and the same counts :func:`fpemu.range_stats` gives.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional, Union

import numpy as np

from fpemu.host import installed_versions
from fpemu.jax_states import scale_of, state_field, state_kind
from fpemu.errors import FpemuInputError
from fpemu.formats import get_format, quantize
from fpemu.traces.format import write_trace
from fpemu.traces.binades import CODES, binade_codes
from fpemu.traces.recorded import (GroupStats, RecordedStep, RecorderSettings, RoundingLimits, ShadowHistogram,
                                   ShadowStats, recorded_metadata, recorded_trace, rounding_limits)

# What grad_stats and shadow_stats return per group, in the trace's order; a last column named
# HISTOGRAM holds the rest of the row (CODES counts of the float32 pass's magnitudes by binade).
HISTOGRAM = "histogram"
STAT_NAMES = ("elements", "zero", "subnormal", "overflow", "nan", "max_abs", "min_nonzero")
SHADOW_NAMES = ("elements", "underflow", "subnormal", HISTOGRAM)


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


# group_by -> the group of a leaf from its path (a tuple of key names)
GROUPINGS = {
    "parameter": lambda path: "/".join(path),
    "module": lambda path: "/".join(path[:-1]) or "/".join(path),
}


def _grouper(group_by) -> Callable:
    if callable(group_by):
        return group_by
    if group_by not in GROUPINGS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPINGS)} or a callable path -> name, "
                         f"got {group_by!r}")
    return GROUPINGS[group_by]


def _pattern(value: np.float32) -> int:
    return int(np.array([value], np.float32).view(np.uint32)[0])


_INF_PATTERN = 0x7F800000
_MAGNITUDE_MASK = 0x7FFFFFFF


def _magnitude_bits(jax, leaf, scale):
    """|leaf * scale| in float32 as uint32 bit patterns, which order as the magnitudes do.

    Compared as integers: XLA:CPU flushes float32 subnormals in float comparisons, which would
    count bf16's subnormals as zeros."""
    jnp = jax.numpy
    values = leaf.astype(jnp.float32) if scale is None else leaf.astype(jnp.float32) * scale
    return jax.lax.bitcast_convert_type(values, jnp.uint32) & jnp.uint32(_MAGNITUDE_MASK)


# How each statistic of grad_stats reduces over elements (and over a group's leaves): its combining
# function's name in jax.numpy and its identity.  "elements" is a leaf's size and adds.
_REDUCTIONS = {"zero": ("add", 0), "subnormal": ("add", 0), "overflow": ("add", 0), "nan": ("add", 0),
               "max_abs": ("maximum", 0), "min_nonzero": ("minimum", _INF_PATTERN)}


def _leaf_stats(jax, leaf, scale, limits: RoundingLimits) -> dict:
    """A leaf's statistics in one variadic reduction: one pass over the leaf computes all six (six
    reductions made six passes and six kernels per leaf; the counts and extremes are the same integers)."""
    jnp = jax.numpy
    bits = _magnitude_bits(jax, leaf, scale).reshape(-1)
    nan = bits > _INF_PATTERN
    nonzero = (bits > _pattern(limits.zero)) & ~nan
    contributions = {
        "zero": bits <= _pattern(limits.zero),
        "subnormal": nonzero & (bits <= _pattern(limits.subnormal)),
        "overflow": (bits >= _pattern(limits.overflow)) & ~nan,
        "nan": nan,
        "max_abs": jnp.where(nan, jnp.uint32(0), bits),
        "min_nonzero": jnp.where(nonzero, bits, jnp.uint32(_INF_PATTERN)),
    }
    names = tuple(_REDUCTIONS)
    kinds = {name: jnp.uint32 if combine != "add" else jnp.int32 for name, (combine, _) in _REDUCTIONS.items()}
    operands = tuple(contributions[name].astype(kinds[name]) for name in names)
    identities = tuple(kinds[name](_REDUCTIONS[name][1]) for name in names)

    def combine(a, b):
        return tuple(getattr(jnp, _REDUCTIONS[name][0])(x, y) for name, x, y in zip(names, a, b))

    reduced = jax.lax.reduce(operands, identities, combine, (0,))
    return {"elements": jnp.int32(leaf.size), **dict(zip(names, reduced))}


def _combine(jnp, parts: list) -> dict:
    """One group's statistics from its leaves': counts add, maxima and minima reduce."""
    return {name: functools.reduce(getattr(jnp, _REDUCTIONS.get(name, ("add",))[0]), [part[name] for part in parts])
            for name in parts[0]}


class GroupCounts:
    """What :func:`grad_stats` and :func:`shadow_stats` return: one uint32 row per group, in a single
    array, so one small buffer leaves the jitted step however many groups there are (each output of
    a jitted function costs a transfer of its own).

    Attributes:
      columns: the statistic of each column (``STAT_NAMES`` or ``SHADOW_NAMES``).
      groups: the group of each row.
      values: the uint32 array, ``len(groups)`` x ``len(columns)``.

    ``counts[group]`` is that group's row as a dict of column -> value (a last ``HISTOGRAM`` column:
    the rest of the row, as a list).
    """

    def __init__(self, columns: tuple, groups: tuple, values):
        self.columns, self.groups, self.values = tuple(columns), tuple(groups), values

    def _row(self, row) -> dict:
        if self.columns[-1] != HISTOGRAM:
            return dict(zip(self.columns, row))
        head = len(self.columns) - 1
        return {**dict(zip(self.columns[:head], row[:head])), HISTOGRAM: list(row[head:])}

    def __getitem__(self, group: str) -> dict:
        return self._row(self.values[self.groups.index(group)])

    def __iter__(self):
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)

    def rows(self) -> dict:
        """group -> {column: int}, read from one copy of the array on the host."""
        values = np.asarray(self.values, dtype=np.uint32)
        return {group: self._row([int(v) for v in row]) for group, row in zip(self.groups, values)}


@functools.lru_cache(maxsize=None)
def _register_group_counts() -> None:
    import jax
    jax.tree_util.register_pytree_node(
        GroupCounts, lambda c: ((c.values,), (c.columns, c.groups)),
        lambda aux, children: GroupCounts(aux[0], aux[1], children[0]))


def _grouped(grads, group_by, leaf_stats, columns, *others) -> GroupCounts:
    """``leaf_stats(leaf, *other_leaves)`` over the floating-point leaves of ``grads`` (and the
    matching leaves of ``others``), combined per group and packed as uint32 (counts, and float32
    magnitudes as their bit patterns)."""
    import jax
    import jax.numpy as jnp
    _register_group_counts()
    grouper = _grouper(group_by)
    other_leaves = [jax.tree_util.tree_leaves(tree) for tree in others]
    groups: dict = {}
    for index, (path, leaf) in enumerate(jax.tree_util.tree_flatten_with_path(grads)[0]):
        if not jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            continue  # integer state carried in the tree (a step count) is not a gradient
        name = grouper(tuple(_key_name(key) for key in path))
        groups.setdefault(name, []).append(leaf_stats(leaf, *(leaves[index] for leaves in other_leaves)))
    combined = [_combine(jnp, parts) for parts in groups.values()]
    values = jnp.stack([jnp.concatenate([jnp.atleast_1d(row[column]).astype(jnp.uint32) for column in columns])
                        for row in combined]) if combined else jnp.zeros((0, len(columns)), jnp.uint32)
    return GroupCounts(columns, tuple(groups), values)


def _factor(scale):
    import jax.numpy as jnp
    return None if scale is None else jnp.asarray(scale, jnp.float32)


def grad_stats(grads, fmt="fp16", *, scale=None, group_by: Union[str, Callable] = "parameter") -> dict:
    """Per-group statistics of the gradients as the compute format holds them; call it inside jit.

    Args:
      grads: the gradient pytree as the backward pass produced it, multiplied by the loss scale
        (jmp's ``loss_scale.scale(loss)``, flax's DynamicScale, Keras' scaled loss).
      fmt: the compute format (a Format or name: "fp16", "bf16", "fp8_e5m2", ...).
      scale: a factor applied in float32 first, for gradients that are already unscaled (pass the
        loss scale) or to ask "what would this scale do" (a JAX scalar is fine); None: none.  The
        product is XLA's, which on the CPU flushes float32 subnormals to zero: exact for fp16 and
        fp8, whose ranges lie inside float32's normal range, not for bf16's subnormals.
      group_by: "parameter" (one group per leaf, named by its path), "module" (leaves sharing a
        parent: a layer's kernel and bias), or a callable from a path (a tuple of key names) to a name.

    Returns:
      A :class:`GroupCounts` (a pytree holding one uint32 array): per group, ``elements`` and the
      counts of elements that are ``zero``, ``subnormal``, ``overflow`` or ``nan`` once rounded to
      ``fmt``, and ``max_abs`` and ``min_nonzero`` as float32 bit patterns (the recorder decodes
      and rounds them).
      Return it from the step and pass it to :meth:`JaxRecorder.record`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> grads = {"dense": {"kernel": jnp.array([1e-9, 0.5, 7e4]), "bias": jnp.array([0.0])}}
      >>> stats = jax.jit(lambda g: grad_stats(g, "fp16"))(grads)
      >>> int(stats["dense/kernel"]["zero"]), int(stats["dense/kernel"]["overflow"])
      (1, 1)
      >>> sorted(jax.jit(lambda g: grad_stats(g, "fp16", group_by="module"))(grads))
      ['dense']
    """
    import jax
    limits, factor = rounding_limits(get_format(fmt)), _factor(scale)
    return _grouped(grads, group_by, lambda leaf: _leaf_stats(jax, leaf, factor, limits), STAT_NAMES)


def shadow_stats(grads, reference, fmt="fp16", *, scale=None, group_by: Union[str, Callable] = "parameter") -> dict:
    """True underflow, element by element: the run's gradients against a float32 pass over the same
    batch (the model in float32, no loss scale).  Call it inside a jitted function on sampled steps.

    Args:
      grads: the run's gradient pytree as in :func:`grad_stats` (scaled, or unscaled with ``scale``).
      reference: the float32 pass's gradients, the same tree.
      fmt, scale, group_by: as in :func:`grad_stats`.

    Returns:
      A :class:`GroupCounts` of ``elements``, ``underflow`` and ``subnormal`` per group: elements
      nonzero in the float32 pass but zero in the run (or, for ``subnormal``, subnormal in ``fmt``).  Values
      that underflowed inside an fp16 backward arrive as plain zeros, which ``grad_stats`` can only
      count as zeros; this tells them from gradients that are really zero.  Its ``histogram``
      column counts the float32 pass's magnitudes by binade (fpemu.traces.binades), from which a
      replay recounts underflow at another scale or in another format.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> run = {"w": jnp.array([0.0, 0.0, 1e-6, 0.5])}            # what the fp16 backward left
      >>> exact = {"w": jnp.array([0.0, 1e-9, 1e-6, 0.5])}         # the float32 pass
      >>> row = jax.jit(shadow_stats)(run, exact).rows()["w"]
      >>> row["elements"], row["underflow"], row["subnormal"], sum(row["histogram"])
      (4, 1, 1, 4)
    """
    import jax
    jnp = jax.numpy
    limits, factor = rounding_limits(get_format(fmt)), _factor(scale)

    def float_bits(ints):
        return jax.lax.bitcast_convert_type(ints.astype(jnp.float32), jnp.int32)

    def leaf_shadow(leaf, exact):
        bits, nonzero = _magnitude_bits(jax, leaf, factor), exact != 0
        exact_bits = float_bits(exact) & 0x7FFFFFFF  # a float32 pass: the bitcast is the value
        return {"elements": jnp.int32(leaf.size),
                "underflow": jnp.sum(nonzero & (bits <= _pattern(limits.zero)), dtype=jnp.int32),
                "subnormal": jnp.sum(nonzero & (bits > _pattern(limits.zero)) & (bits <= _pattern(limits.subnormal)),
                                     dtype=jnp.int32),
                HISTOGRAM: jnp.bincount(binade_codes(exact_bits.reshape(-1), float_bits, jnp.where), length=CODES)}

    return _grouped(grads, group_by, leaf_shadow, SHADOW_NAMES, reference)


def _rows(stats, columns: tuple, function: str) -> dict:
    if not isinstance(stats, GroupCounts) or stats.columns != columns:
        raise TypeError(f"expected what {function} returns (a GroupCounts of {', '.join(columns)}), "
                        f"got {type(stats).__name__}")
    return stats.rows()


def host_shadow_stats(stats) -> dict:
    """``shadow_stats``' output on the host as the trace's :class:`~fpemu.traces.recorded.ShadowStats`."""
    out = {}
    for group, row in _rows(stats, SHADOW_NAMES, "shadow_stats").items():
        elements = row["elements"]
        out[group] = ShadowStats(*(row[name] / elements if elements else 0.0 for name in ("underflow", "subnormal")))
    return out


def host_shadow_histograms(stats) -> dict:
    """``shadow_stats``' histograms on the host as the trace's :class:`~fpemu.traces.recorded.ShadowHistogram` s."""
    return {group: ShadowHistogram.from_counts(row["elements"], row[HISTOGRAM])
            for group, row in _rows(stats, SHADOW_NAMES, "shadow_stats").items()}


def host_grad_stats(stats, fmt) -> dict:
    """``grad_stats``' output on the host as the trace's :class:`~fpemu.traces.recorded.GroupStats`:
    shares of the element counts, and ``max_abs`` and ``min_nonzero`` rounded to ``fmt`` (rounding
    is monotone, so the rounded maximum is the maximum of the rounded values; beyond the range is
    inf, also in formats whose overflow is NaN)."""
    fmt = get_format(fmt)
    rows = _rows(stats, STAT_NAMES, "grad_stats")
    magnitudes = np.array([[row["max_abs"], row["min_nonzero"]] for row in rows.values()], np.uint32).reshape(-1, 2)
    rounded = quantize(magnitudes.view(np.float32), fmt)  # one call for every group
    rounded = np.where(np.isnan(rounded), np.inf, rounded)
    return {group: GroupStats.from_counts(*(row[name] for name in STAT_NAMES[:5]), float(top), float(bottom))
            for (group, row), (top, bottom) in zip(rows.items(), rounded)}


def keras_scale_state(optimizer, variables=None) -> dict:
    """The scale state of a Keras 3 ``LossScaleOptimizer`` as a dict the recorder reads.

    Args:
      optimizer: the LossScaleOptimizer.
      variables: its variable values as a jitted ``stateless_apply`` returns them (None: read the
        optimizer's own variables, as after ``model.fit``).

    Returns:
      ``{"scale": float, "growth_counter": int, "growth_interval": int}``.
    """
    values = [v.value for v in optimizer.variables] if variables is None else list(variables)
    paths = [v.path for v in optimizer.variables]
    by_suffix = {suffix: next((values[i] for i, path in enumerate(paths) if path.endswith(suffix)), None)
                 for suffix in ("dynamic_scale", "step_counter")}
    if by_suffix["dynamic_scale"] is None:
        raise ValueError(f"optimizer must be a keras LossScaleOptimizer (no dynamic_scale variable among "
                         f"{', '.join(paths)})")
    return {"scale": float(np.asarray(by_suffix["dynamic_scale"])),
            "growth_counter": int(np.asarray(by_suffix["step_counter"])),
            "growth_interval": optimizer.dynamic_growth_steps}


# (state package, state class, the recorder's scaler) -> profile parameter -> the state's attribute (or a
# Mapping's key) holding it: what the real state says wins over the parameters the caller passed, which may be
# stale.  The scale itself is the initial scale of the first attempt's state.
STATE_PARAMS = {
    ("jmp", "DynamicLossScale", "jmp"): {"loss_scale": "loss_scale", "period": "period", "factor": "factor",
                                         "min_loss_scale": "min_loss_scale"},
    ("jmp", "StaticLossScale", "static"): {"loss_scale": "loss_scale"},
    ("flax", "DynamicScale", "flax"): {"scale": "scale", "growth_factor": "growth_factor",
                                       "backoff_factor": "backoff_factor", "growth_interval": "growth_interval",
                                       "minimum_scale": "minimum_scale"},
    ("", "Mapping", "keras"): {"initial_scale": "scale", "dynamic_growth_steps": "growth_interval"},
}


def state_params(state, scaler: str) -> dict:
    """The profile parameters ``state`` (the first attempt's loss-scale state) holds, for ``scaler``'s profile;
    {} for a plain number or a state of another scaler."""
    row = state_kind(state)
    fields = {} if row is None else STATE_PARAMS.get((row.package, row.cls, scaler), {})
    read = state.get if isinstance(state, dict) else functools.partial(getattr, state)
    values = {param: read(name, None) for param, name in fields.items()}
    return {param: np.asarray(value).item() for param, value in values.items() if value is not None}


def params_changed(before, after):
    """Whether any leaf of ``after`` differs from ``before`` bit for bit (NaN-aware: a NaN that stays NaN is
    no change): whether an update was applied.  A JAX bool; call it inside jit or on the host."""
    import jax
    import jax.numpy as jnp

    def differs(a, b):
        a, b = jnp.asarray(a), jnp.asarray(b)
        if not jnp.issubdtype(a.dtype, jnp.floating):
            return jnp.any(a != b)
        return jnp.any((a != b) & ~(jnp.isnan(a) & jnp.isnan(b)))

    leaves = jax.tree_util.tree_leaves(jax.tree_util.tree_map(differs, before, after))
    return functools.reduce(jnp.logical_or, leaves, jnp.bool_(False))


class JaxRecorder:
    """Appends the attempts of a JAX loop on the host and writes them as a recorded trace.

    Use :func:`record_jax` to make one.  Inside the jitted step, :meth:`grad_stats` (or the
    function :func:`grad_stats` with the same format and grouping); then one :meth:`record` call
    per update attempt.
    """

    def __init__(self, fmt, *, name: str, scaler: str, params: Optional[dict] = None,
                 group_by: Union[str, Callable] = "parameter", batch_size: Optional[int] = None,
                 path=None, shadow_every: int = 0):
        self.format = get_format(fmt)
        self.shadow_every = shadow_every
        self.name, self.scaler, self.params = name, scaler, dict(params or {})
        self.group_by, self.batch_size, self.path = group_by, batch_size, path
        self._steps: list = []
        self._final_scale: Optional[float] = None
        self._schedule_count = 0  # no count given: no scheduler observed
        self._device: Optional[str] = None
        self._applied_assumed = 0  # steps whose `applied` was taken from `overflow`, not observed

    def grad_stats(self, grads, *, scale=None) -> dict:
        """:func:`grad_stats` in the recorder's format and grouping; call it inside the jitted step."""
        return grad_stats(grads, self.format, scale=scale, group_by=self.group_by)

    def shadow_stats(self, grads, reference, *, scale=None) -> dict:
        """:func:`shadow_stats` in the recorder's format and grouping; call it inside jit."""
        return shadow_stats(grads, reference, self.format, scale=scale, group_by=self.group_by)

    def record(self, stats, *, scale_state, next_scale_state=None, loss=None, grad_norm=None, lr=None,
               overflow: Optional[bool] = None, applied: Optional[bool] = None, params_before=None,
               params_after=None, schedule_count=None, shadow=None) -> RecordedStep:
        """Append one attempt.

        Args:
          stats: what :meth:`grad_stats` returned inside the step (JAX arrays are fine).
          scale_state: the loss scale the step used: a number, a jmp or flax state, or a dict with
            ``scale`` (:func:`keras_scale_state`).
          next_scale_state: the state the step returned; its counter is the step's growth counter
            and its scale the final scale.
          loss, grad_norm, lr: the unscaled loss, the unscaled gradient norm and the learning rate
            (any scalar; None: not recorded).
          overflow: whether the scaler saw non-finite gradients (jmp's ``all_finite``, flax's
            ``is_fin``, negated); None: any NaN or overflow in ``stats``.
          applied: whether the update ran (:func:`params_changed` inside the step says it); None: observed
            from ``params_before`` and ``params_after`` where given, else assumed exactly when it did not
            overflow.  That is an assumption, not an observation (a loop that applies inf/NaN updates
            would be recorded as skipping them, and a trace could never show the loop skipping other
            steps than the overflowing ones): the trace says so, ``metadata.recorder.applied_assumed``
            counting such steps, and the first one warns (RuntimeWarning).
          params_before, params_after: the parameters the step received and returned, to observe
            ``applied`` (compared on their device; one bool comes to the host).  An update that changes
            nothing (a learning rate of 0 at a warmup's first step) reads as not applied: pass
            ``applied`` where the step knows (the flag it selects the update on).
          schedule_count: the optax schedule's count after the step (``ScaleByScheduleState.count``,
            ``ScaleByAdamState.count``); the last one given is the summary's ``scheduler_steps``.
          shadow: what :meth:`shadow_stats` returned for this step's batch (sampled steps only).

        Returns:
          The :class:`~fpemu.traces.recorded.RecordedStep` appended.
        """
        groups = host_grad_stats(stats, self.format)
        if not self._steps:  # what the real state holds beats what the caller said
            self.params.update(state_params(scale_state, self.scaler))
        if applied is None and params_before is not None and params_after is not None:
            applied = _changed(params_before, params_after)
        if applied is None:
            self._assume_applied()
        if overflow is None:
            overflow = any(row.nan or row.overflow for row in groups.values())
        overflow = bool(np.asarray(overflow))
        after = scale_state if next_scale_state is None else next_scale_state
        counter = state_field(after, "counter")
        record = RecordedStep(
            step=len(self._steps), scale=scale_of(scale_state, "scale_state"), overflow=overflow,
            applied=(not overflow) if applied is None else bool(np.asarray(applied)),
            growth_counter=None if counter is None else int(np.asarray(counter)),
            loss=_optional(loss), grad_norm=_optional(grad_norm), lr=_optional(lr), grad_stats=groups,
            shadow=None if shadow is None else host_shadow_stats(shadow),
            shadow_histogram=None if shadow is None else host_shadow_histograms(shadow))
        self._steps.append(record)
        self._final_scale = scale_of(after, "next_scale_state")
        if schedule_count is not None:
            self._schedule_count = int(np.asarray(schedule_count))
        if self._device is None:
            self._device = _device_of(stats)
        return record

    def _assume_applied(self) -> None:
        if not self._applied_assumed:
            warnings.warn(f"record_jax {self.name!r}: step {len(self._steps)}: whether the update ran is assumed from "
                          "overflow (not observed): pass record(..., params_before=, params_after=) or applied=; the "
                          "trace counts such steps in metadata.recorder.applied_assumed", RuntimeWarning, stacklevel=3)
        self._applied_assumed += 1

    @property
    def steps(self) -> tuple:
        return tuple(self._steps)

    def trace(self):
        """The recorded trace so far (see :mod:`fpemu.traces.recorded`)."""
        final = self._final_scale if self._final_scale is not None else float("nan")
        examples = None if self.batch_size is None else self.batch_size * len(self._steps)
        return recorded_trace(self._metadata(), self._steps, final_scale=final, examples=examples,
                              scheduler_steps=self._schedule_count)

    def write(self, path=None):
        """Write the trace (atomically) to ``path`` or the recorder's own; returns the path."""
        target = path if path is not None else self.path
        if target is None:
            raise FpemuInputError("path: JaxRecorder.write needs a path (or record_jax(..., path=...))")
        return write_trace(self.trace(), target)

    def __enter__(self) -> "JaxRecorder":
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None and self.path is not None:
            self.write()

    def _metadata(self) -> dict:
        groups = self.group_by if isinstance(self.group_by, str) else getattr(self.group_by, "__name__", "custom")
        packages = _JAX_PACKAGES + _SCALER_PACKAGES[self.scaler]
        return recorded_metadata(
            framework="jax", name=self.name, device=self._device or "cpu", profile=self.scaler,
            params=self.params, packages=installed_versions(packages),
            settings=RecorderSettings(groups=groups, shadow_every=self.shadow_every, compute_format=self.format.name,
                                      applied_assumed=self._applied_assumed))


@functools.lru_cache(maxsize=None)
def _changed_jit():
    import jax
    return jax.jit(params_changed)


def _changed(before, after) -> bool:
    return bool(np.asarray(_changed_jit()(before, after)))


def _optional(value) -> Optional[float]:
    return None if value is None else float(np.asarray(value))


def _device_of(stats: GroupCounts) -> Optional[str]:
    """The platform (cpu, gpu, tpu) the statistics were computed on (None for host arrays)."""
    devices = getattr(stats.values, "devices", None)
    return None if devices is None else next(iter(devices())).platform


# scaler -> the packages a recording with it depends on (beyond jax and jaxlib)
_JAX_PACKAGES = ("jax", "jaxlib", "numpy", "ml_dtypes")
_SCALER_PACKAGES = {"jmp": ("jmp", "optax"), "flax": ("flax", "optax"), "optax": ("optax",),
                    "keras": ("keras",), "static": ()}


def record_jax(fmt="fp16", *, name: str, scaler: str, params: Optional[dict] = None,
               group_by: Union[str, Callable] = "parameter", batch_size: Optional[int] = None,
               path=None, shadow_every: int = 0) -> JaxRecorder:
    """A recorder for a JAX loop: call its :meth:`~JaxRecorder.grad_stats` inside the jitted step,
    then :meth:`~JaxRecorder.record` once per step on the host.

    Args:
      fmt: the compute format the statistics are taken in.
      name: the run's name (the trace's spec name).
      scaler: which loss scaler the loop uses: one of ``jmp``, ``flax``, ``optax``, ``keras``, ``static``.
      params: the scaler's parameters, as the loop set them; those its loss-scale state exposes (jmp's
        period, factor and floor, flax's growth and backoff factors, interval and floor, the Keras
        state's growth steps, and every initial scale) are read from the first attempt's state instead
        (:data:`STATE_PARAMS`), so stale ones cannot make a comparison blame growth timing.
      group_by: "parameter", "module" or a callable path -> group name (see :func:`grad_stats`).
      batch_size: examples per attempt (the summary counts examples when given).
      path: where the trace is written when a ``with`` block ends without an exception.
      shadow_every: how often the loop runs a float32 shadow pass (:meth:`JaxRecorder.shadow_stats`
        on the same batch; 0: never), recorded in the metadata.  The loop decides when: a shadow
        step costs one more forward and backward in float32.

    Returns:
      A :class:`JaxRecorder`.

    Example:
      >>> import jax, jax.numpy as jnp, jmp
      >>> state = jmp.DynamicLossScale(jnp.float32(2.0 ** 15), period=2)
      >>> recorder = record_jax("fp16", name="doc", scaler="jmp", params={"period": 2})
      >>> for g in ([1.0, 3.0], [float("inf"), 1.0]):
      ...     stats = jax.jit(recorder.grad_stats)({"w": jnp.array(g)})
      ...     finite = jmp.all_finite({"w": jnp.array(g)})
      ...     new = state.adjust(finite)
      ...     _ = recorder.record(stats, scale_state=state, next_scale_state=new, overflow=~finite)
      ...     state = new
      >>> [(r.scale, r.overflow, r.applied, r.growth_counter) for r in recorder.steps]
      [(32768.0, False, True, 1), (32768.0, True, False, 0)]
      >>> recorder.trace().summary["final_scale"]
      16384.0
    """
    if scaler not in _SCALER_PACKAGES:
        raise FpemuInputError(f"scaler: expected one of {', '.join(_SCALER_PACKAGES)}, got {scaler!r}")
    _grouper(group_by)
    RecorderSettings(shadow_every=shadow_every)  # checks it
    return JaxRecorder(fmt, name=name, scaler=scaler, params=params, group_by=group_by,
                       batch_size=batch_size, path=path, shadow_every=shadow_every)


__all__ = ["STAT_NAMES", "SHADOW_NAMES", "GROUPINGS", "STATE_PARAMS", "GroupCounts", "grad_stats", "host_grad_stats",
           "state_params", "params_changed",
           "shadow_stats", "host_shadow_stats", "host_shadow_histograms",
           "keras_scale_state", "JaxRecorder", "record_jax"]
