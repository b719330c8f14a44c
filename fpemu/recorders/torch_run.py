"""Record a real torch mixed-precision training loop as a trace (see fpemu.traces.recorded).

``with record_torch(scaler, optimizer, model, scheduler, path="run.json") as rec:`` runs the
user's loop unchanged.  It watches through :class:`fpemu.audits.torch_loop.TorchLoopAudit` (the
same wrappers and hooks ``audit_torch`` uses; ``rec.audit`` holds its findings) and writes one
step record per update attempt:

* each backward pass (microbatch) hands every parameter its own gradient, at the pass's scale,
  before it is added into ``.grad``: a tensor hook keeps it and the pass's end measures them all, on
  their own device, at most ``CHUNK`` elements at a time (a large gradient in pieces, small ones
  together), so the temporaries stay under ~40 MiB whatever the model; nothing is copied to the host
  but a handful of numbers per group.  A gradient is classed by the range of the format it was
  computed in: the compute format's, or float32's for one autocast leaves in float32 (see
  ``compute_max`` below for how that is told; it was counted as fp16 before, so a float32 embedding's
  gradient of 85,809 showed an fp16 overflow share at a step that did not overflow).  So an attempt that accumulates microbatches is described by
  what each backward produced in the compute format, not by the float32 sum in ``.grad`` (which can
  pass fp16's range with no microbatch overflowing); gradients set by hand, with no backward pass,
  are measured in ``.grad`` when ``scaler.step`` (or ``scaler.unscale_``) first unscales.  Holding a
  pass's gradients until it ends makes autograd copy them into a ``.grad`` that was None (it moves them
  otherwise): one extra copy of the gradients at the first microbatch of each update;
* ``compute_max``: the largest gradient magnitude computed in the compute format, over the passes:
  every module output held in it gets a tensor hook (an fp16 activation gradient overflows before
  any parameter's), and the parameters whose gradients arrive as compute-format values (autocast cast
  them; tested once per parameter) count, float32 ones (a norm's weight, an embedding) do not.  Replay
  decides overflow at another scale from it;
* the scale, found-inf, whether the update ran and the learning rate when ``scaler.step``
  returns; the growth tracker after ``scaler.update``; the loss as handed to ``scaler.scale``
  (summed over the attempt's microbatches); the gradient norm from the norms the audit keeps of
  each gradient as the backward pass left it (before any clipping), divided by the scale.

True underflow needs what the run lost, so it needs a second pass: ``rec.shadow(loss_fn)``, called
after the backward pass, reruns ``loss_fn()`` with autocast off (float32) on every
``shadow_every``-th attempt, takes its gradients with ``torch.autograd.grad`` (the run's ``.grad``
are untouched and the audit does not see the pass) and counts, element by element, the values
nonzero in float32 that the run holds as zero or as a compute-format subnormal, and histograms the
float32 gradients by binade (``shadow_histogram``: what a replay at another scale or in another
format recounts underflow from).  It costs one float32 forward and backward and a few elementwise
passes and a bincount per sampled attempt, so about ``1/shadow_every`` of a float32 step per step
(``reports/bench_record.md`` measures it); dropout draws other masks in the shadow pass (record
with dropout off, or read the shares as a bound).

torch is imported on first use.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import weakref
from typing import Callable, NamedTuple, Optional

import numpy as np

from fpemu.host import installed_versions
from fpemu.audits.torch_loop import TorchLoopAudit, import_torch
from fpemu.formats import get_format
from fpemu.traces import write_trace
from fpemu.traces.binades import CODES, binade_codes
from fpemu.traces.recorded import (GroupStats, RecordedStep, RecorderSettings, ShadowHistogram, ShadowStats,
                                   audit_findings, format_thresholds, recorded_metadata, recorded_trace)

GROUPINGS = ("module", "parameter")
# module outputs noted as watched before the notes are dropped (forwards with no backward)
_HOOKED_AT_MOST = 1 << 16
# fpemu compute format -> the torch dtype a backward computes in (autocast's)
_COMPUTE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# Elements measured at once: a gradient larger than this is measured in pieces, so the temporaries
# stay under ~40 MiB whatever the model (about 10 bytes per element measured); smaller gradients are
# measured together, up to CHUNK elements at once.
CHUNK = 1 << 22
# Elements of activation gradients held to be measured together: each hook's own three torch ops cost ~40 us
# of dispatch on the CPU, more than a small module's gradient takes to compute; held, a pass's small ones
# cost one join and two ops (and at most ~2 MiB of 16-bit gradients are kept alive meanwhile)
ACTIVATION_BATCH = 1 << 20


def _group_names(groups, model, optimizer) -> tuple:
    """(the grouping's name for the trace, [(group name, [params])] in optimizer order).

    Parameters are named as the model names them; without a model (or for a parameter the model
    lacks) by their place in the optimizer, ``param_groups[g][i]``, and "module" groups them by
    the optimizer's parameter group.
    """
    if not (callable(groups) or groups in GROUPINGS):
        raise ValueError(f"groups must be one of {', '.join(GROUPINGS)} or a function (name, parameter) -> "
                         f"group name, got {groups!r}")
    names = {} if model is None else {id(param): name for name, param in model.named_parameters()}
    grouped: dict = {}
    for index, group in enumerate(optimizer.param_groups):
        for position, param in enumerate(p for p in group["params"] if p.requires_grad):
            name = names.get(id(param), f"param_groups[{index}][{position}]")
            if callable(groups):
                group_name = groups(name, param)
            elif groups == "parameter":
                group_name = name
            else:
                group_name = name.rpartition(".")[0] or name if id(param) in names else f"param_groups[{index}]"
            if not isinstance(group_name, str):
                raise TypeError(f"groups({name!r}, ...) must return a str, got {type(group_name).__name__}")
            grouped.setdefault(group_name, []).append(param)
    label = groups if isinstance(groups, str) else getattr(groups, "__name__", type(groups).__name__)
    return label, list(grouped.items())


def _class_bounds(torch, fmt) -> tuple:
    """Class edges (float32 numbers): x is in class i where edge[i-1] < x <= edge[i]; 0 zero, 1 subnormal,
    2 normal, 3 beyond the range (or NaN)."""
    zero_at_most, normal_from, overflow_from = format_thresholds(fmt)
    edges = torch.tensor([zero_at_most, normal_from, overflow_from], dtype=torch.float32)
    # x <= edge[i] is the test: the two upper edges are strict, so step them down one float32 value (exact:
    # they are float32 numbers)
    edges[1:] = torch.nextafter(edges[1:], torch.zeros(2))
    return tuple(edges.tolist())


def _output_tensors(torch, output) -> list:
    """The tensors a module returned: itself, or the tensors among a tuple's, list's or dict's items (a
    transformers ModelOutput is a dict) one level down."""
    if isinstance(output, torch.Tensor):
        return [output]
    items = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return [item for item in items if isinstance(item, torch.Tensor)]


def _pieces(grad):
    """A gradient as flat pieces of at most CHUNK elements."""
    flat = grad.detach().reshape(-1)
    return (flat,) if flat.numel() <= CHUNK else flat.split(CHUNK)  # most are small: no split call


def _batches(pieces, kind=lambda item: None):
    """Consecutive (key, piece) pairs packed into lists of at most CHUNK elements on one device (and of one
    ``kind(item)``), so a model's many small gradients are measured in a few tensor operations, not eight
    per tensor."""
    batch, size = [], 0
    for item in pieces:
        elements = item[1].numel()
        if batch and (size + elements > CHUNK or batch[-1][1].device != item[1].device
                      or kind(batch[-1]) != kind(item)):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += elements
    if batch:
        yield batch


def _batch_measures(torch, pieces, edges) -> tuple:
    """(class counts [zero, subnormal, normal, beyond-or-NaN] per piece, [min_nonzero, max_abs] per piece) of
    non-empty pieces on one device, together at most CHUNK elements, as two tensors of shape (pieces, 4)
    and (pieces, 2).  NaN is not nonzero for min_nonzero; max_abs does not ignore it, so a piece with
    anything in the top class is measured again by _top_class_measures (rare: an overflow).

    It works on the magnitudes' float32 bit patterns, which order as the magnitudes (NaN's above inf's), in
    integer arithmetic: torch's CPU compares write bools 4-6x slower than an integer subtract (a 4-layer
    Llama's pass, 39 gradients: 2.6 -> 1.7 ms best, 3.6 -> 2.0 ms median, old and new alternated)."""
    # the edges are float32 numbers: wider grads compare in float32 (abs commutes with the rounding)
    magnitude = torch.cat([p if p.dtype == torch.float32 else p.float() for p in pieces]).abs_()
    bits = magnitude.view(torch.int32)
    lengths = [p.numel() for p in pieces]
    # a value's class is the number of edges it is above (bucketize's classes, edge[i-1] < x <= edge[i]; NaN is
    # above every edge: the top class), each "above" the clamp of a difference (no int32 overflow: both are in
    # [0, 2**31)); one count per piece and class: a bincount over piece * 4 + class (a few operations per batch,
    # not one per piece and edge: 16 small gradients took 48 counts a pass)
    # (in place on two scratch tensors: a fresh tensor of a batch's size costs page faults on each use)
    edge_bits, scratch = _float32_bits(edges), torch.empty_like(bits)
    above = torch.sub(bits, edge_bits[0]).clamp_(0, 1)
    for edge in edge_bits[1:]:
        above += torch.sub(bits, edge, out=scratch).clamp_(0, 1)
    counts = torch.bincount(above.add_(_piece_index(torch, tuple(lengths), magnitude.device)),
                            minlength=4 * len(pieces)).view(len(pieces), 4)
    largest = torch.stack(torch._foreach_max(magnitude.split(lengths)))
    # min_nonzero: the least of bits - 1 over 31 bits (a zero wraps to the greatest), as -max(-x): torch has no
    # _foreach_min.  At or past inf's pattern it is a piece of zeros (and NaN): no nonzero value, inf.
    negated = torch.sub(bits, 1, out=scratch).bitwise_and_(0x7FFFFFFF).neg_()
    least = torch.stack(torch._foreach_max(negated.split(lengths))).neg_()
    smallest = torch.where(least >= _INF_BITS, _INF_BITS, least + 1).view(torch.float32)
    return counts, torch.stack([smallest, largest], 1)


_INF_BITS = 0x7F800000  # float32 inf's bit pattern


@functools.lru_cache(maxsize=8)
def _float32_bits(edges: tuple) -> tuple:
    """The float32 bit patterns of non-negative float32 numbers, as ints."""
    return tuple(int(bits) for bits in np.asarray(edges, np.float32).view(np.int32))


@functools.lru_cache(maxsize=64)
def _piece_index(torch, lengths: tuple, device):
    """4 x the index of the piece each value of a batch of pieces of ``lengths`` belongs to (int32; a model's
    passes repeat the same batches, so it is made once per batch shape)."""
    ids = torch.arange(0, 4 * len(lengths), 4, dtype=torch.int32, device=device)
    return ids.repeat_interleave(torch.tensor(lengths, device=device))


def _top_class_measures(torch, piece) -> tuple:
    """(NaN count, max_abs ignoring NaN) of a piece holding values beyond the range or NaN (one sync)."""
    magnitude = piece.abs().float()
    nan = int(torch.isnan(magnitude).sum())
    return nan, float(magnitude.nan_to_num_(nan=0.0, posinf=math.inf).amax())


def _group_stats(elements: int, measured: list, microbatches: int = 1) -> GroupStats:
    """GroupStats from [(counts, max_abs, min_nonzero, nan)] of the group's pieces over ``microbatches``
    backward passes: the shares are of ``elements`` x ``microbatches`` values, and elements a pass gave
    no gradient count as zeros."""
    values = elements * microbatches
    present = sum(sum(counts) for counts, *_ in measured)
    zero = values - present + sum(counts[0] for counts, *_ in measured)
    subnormal = sum(counts[1] for counts, *_ in measured)
    nan = sum(n for *_, n in measured)
    beyond = sum(counts[3] for counts, *_ in measured) - nan  # NaN lands in the top bucket
    stats = GroupStats.from_counts(values, int(zero), int(subnormal), int(beyond), int(nan),
                                   max((m for _, m, _, _ in measured), default=0.0),
                                   min((m for _, _, m, _ in measured), default=math.inf))
    return dataclasses.replace(stats, elements=elements)


def _shadow_counts(torch, shadow_grad, run_grad, factor, edges):
    """[underflow, subnormal] counts: nonzero in the float32 pass, zero / subnormal in the run."""
    counts = []
    for shadow, run in zip(shadow_grad.reshape(-1).split(CHUNK), run_grad.detach().reshape(-1).split(CHUNK)):
        nonzero = shadow != 0
        run = (run.float() * factor).abs()
        subnormal = (run > edges[0]) & (run <= edges[1])
        counts.append(torch.stack([(nonzero & (run == 0)).sum(), (nonzero & subnormal).sum()]))
    return torch.stack(counts).sum(0)


def _rank_path(path, ranks: Optional[dict]):
    """Where this rank writes its trace: ``path`` on one rank; on several, ``{rank}`` in it filled in,
    else ``.rank<r>`` before its suffix (``run.json`` -> ``run.rank1.json``), so ranks never share a file."""
    if ranks is None:
        return path
    if "{rank}" in str(path):
        return pathlib.Path(str(path).format(rank=ranks["rank"]))
    path = pathlib.Path(path)
    return path.with_name(f"{path.stem}.rank{ranks['rank']}{path.suffix}")


def _shadow_histograms(torch, grads, groups: int):
    """The dense binade histograms (fpemu.traces.binades) of float32-pass gradients, one row per group.

    Args:
      grads: (group index, gradient) pairs.
      groups: how many groups.

    Returns:
      An int64 tensor (groups, CODES), on the gradients' device: small gradients are coded together, up
      to CHUNK elements at once, and every group's codes go into one bincount (offset by the group), so a
      model's many small tensors cost a few tensor operations, not a dozen each.
    """
    pieces = [(index, piece) for index, grad in grads for piece in _pieces(grad) if piece.numel()]
    device = pieces[0][1].device if pieces else "cpu"
    counts = torch.zeros(groups * CODES, dtype=torch.int64, device=device)
    for batch in _batches(pieces):
        bits = torch.cat([piece.float() for _, piece in batch]).view(torch.int32) & 0x7FFFFFFF
        codes = binade_codes(bits, lambda ints: ints.float().view(torch.int32), torch.where)
        offsets = torch.tensor([index * CODES for index, _ in batch], device=bits.device)
        codes = codes + offsets.repeat_interleave(torch.tensor([piece.numel() for _, piece in batch],
                                                               device=bits.device))
        counts += torch.bincount(codes, minlength=groups * CODES).to(counts.device)  # a model on several devices
    return counts.view(groups, CODES)


class _PieceOf(NamedTuple):
    """Whose piece of a gradient is measured: its group, the gradient's index, whether it was computed in
    the compute format (pieces of one batch share that, so they share the format's bounds)."""
    group: str
    index: int
    in_format: bool


@dataclasses.dataclass
class _OpenStep:
    """An attempt whose scaler.update has not run yet."""
    step: RecordedStep


class TorchRecorder:
    """Records one run of a torch training loop as a trace.  Use :func:`record_torch` to create one.

    After the ``with`` block, :attr:`trace` is the recorded trace (written to ``path`` if given),
    :attr:`steps` its :class:`~fpemu.traces.recorded.RecordedStep` s and :attr:`audit` the audit
    that watched the run (its findings come for free).
    """

    def __init__(self, scaler, optimizer, model=None, scheduler=None, *, groups="module", shadow_every: int = 0,
                 compute_format: Optional[str] = None, path=None, name: str = "recorded_run",
                 batch_size: Optional[int] = None, statistics: bool = True):
        torch = import_torch()
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be one torch.optim.Optimizer, got {type(optimizer).__name__}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module or None, got {type(model).__name__}")
        if compute_format is not None:
            get_format(compute_format)
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        self.audit = TorchLoopAudit(scaler, optimizer, scheduler, batch_size=batch_size)
        self.audit.watch(self)
        self._scaler, self._optimizer, self._path, self._name = scaler, optimizer, path, name
        self._grouping, self._groups = _group_names(groups, model, optimizer)
        self._shadow_every, self._statistics = shadow_every, bool(statistics)
        self._compute_format = compute_format
        RecorderSettings(self._grouping, shadow_every, compute_format or "fp16", self._statistics)  # checks them
        self._edges: dict = {}  # (in the compute format, device) -> class edges
        self._hooks: list = []
        # each backward pass's gradients as it hands them to the parameters (group, gradient), measured
        # when the pass ends; what the attempt's passes measured, per group; how many passes; the pass
        self._incoming: list = []
        self._passes: dict = {}
        self._microbatches = 0
        self._pass_task: Optional[int] = None
        # the largest gradient magnitude computed in the compute format in the attempt's passes (module
        # outputs held in it, parameters whose gradients arrive in it), and this pass's activation maxima
        self._compute_max: Optional[float] = None
        self._activation_maxima: list = []
        self._held: list = []  # this pass's activation gradients not measured yet, and their elements
        self._held_elements = 0
        self._in_format: dict = {}  # id(param) -> whether its gradients arrive as compute-format values
        self._dtype = None  # the compute format's torch dtype, once known
        # id -> a weak reference to each module output whose gradient is watched (a tensor's == is elementwise,
        # so no WeakSet); emptied when a backward pass ends
        self._hooked: dict = {}
        self._loss = None  # the attempt's summed loss, a device tensor (read once per attempt)
        self._grad_stats: Optional[dict] = None
        self._shadow: Optional[dict] = None
        self._shadow_histogram: Optional[dict] = None
        self._open: Optional[_OpenStep] = None
        self.steps: list = []
        self.trace = None

    # --- the context ------------------------------------------------------------------

    def __enter__(self) -> "TorchRecorder":
        self.audit.__enter__()
        if self._statistics:
            self._hooks = [param.register_hook(functools.partial(self._on_incoming, group, param))
                           for group, members in self._groups for param in members]
            self._hooks.append(import_torch().nn.modules.module.register_module_forward_hook(self._on_output))
        return self

    def __exit__(self, *exc_info) -> None:
        while self._hooks:
            self._hooks.pop().remove()
        self.audit.__exit__(*exc_info)
        self._close_open()
        self.trace = self._build_trace(clean=exc_info[0] is None)
        if self._path is not None and exc_info[0] is None:
            write_trace(self.trace, _rank_path(self._path, self.trace.metadata.get("ranks")))

    # --- what the audit reports ----------------------------------------------------------

    def scaled(self, outputs) -> None:
        torch = import_torch()
        if isinstance(outputs, torch.Tensor) and outputs.numel() == 1:
            loss = outputs.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss

    def before_unscale(self, log) -> None:
        if self._statistics and self._grad_stats is None and not self._microbatches:
            self._grad_stats = self._measure()  # gradients no backward pass handed over (set by hand)

    def attempt_finished(self, log, completed: bool) -> None:
        self._close_open()
        if self._statistics and self._microbatches:
            self._grad_stats = {group: _group_stats(sum(p.numel() for p in members), self._passes[group],
                                                    self._microbatches) for group, members in self._groups}
        elif self._statistics and self._grad_stats is None:  # no unscale_ ran (a disabled scaler, no scaler)
            self._grad_stats = self._measure()
        scale = self.audit._scale()
        loss, self._loss = self._loss, None
        step = RecordedStep(
            step=log.attempts, scale=scale, overflow=self._found_inf(completed), applied=bool(completed),
            loss=None if loss is None else float(loss), grad_norm=self._grad_norm(log, scale),
            lr=float(self._optimizer.param_groups[0]["lr"]), grad_stats=self._grad_stats or {},
            shadow=self._shadow, shadow_histogram=self._shadow_histogram,
            microbatches=self._microbatches if self._microbatches > 1 else None, compute_max=self._compute_max)
        self._grad_stats = self._shadow = self._shadow_histogram = self._compute_max = None
        self._passes, self._microbatches = {}, 0
        self._open = _OpenStep(step)
        if not self.audit._scaling:
            self._close_open()

    def updated(self) -> None:
        self._close_open()

    # --- the shadow pass -------------------------------------------------------------------

    @property
    def shadow_due(self) -> bool:
        """Whether :meth:`shadow` would run a pass in the current attempt."""
        attempt = self.audit._logs[0].attempts
        return bool(self._shadow_every) and attempt % self._shadow_every == 0 and self._shadow is None

    def shadow(self, loss_fn: Callable) -> Optional[float]:
        """On a sampled attempt, rerun ``loss_fn()`` in float32 and count what the run's gradients lost.

        Call it after the attempt's backward pass(es) and before ``scaler.step``; on other attempts it
        returns at once.

        Args:
          loss_fn: computes the loss of the batch the run just used, e.g. ``lambda: model(x, labels=y).loss``
            (the float32 loss, unscaled: the shadow pass never scales).

        Returns:
          The float32 loss of the shadow pass, or None where the attempt is not sampled.
        """
        if not self.shadow_due:
            return None
        torch = import_torch()
        params = [param for _, members in self._groups for param in members]
        device_type = params[0].device.type
        with self.audit.paused(), torch.autocast(device_type, enabled=False):
            loss = loss_fn()
            grads = torch.autograd.grad(loss, params, allow_unused=True)
        log = self.audit._logs[0]
        factor = 1.0 if log.scaled else self.audit._scale()  # compare at the attempt's scale
        shadow_of = dict(zip(map(id, params), grads))
        shadow, results = {}, []
        for group, members in self._groups:
            counts = [_shadow_counts(torch, shadow_of[id(p)], p.grad, factor,
                                     self._bounds(self._computed_in(p)))
                      for p in members if shadow_of[id(p)] is not None and p.grad is not None]
            results.append((group, sum(p.numel() for p in members), torch.stack(counts).sum(0) if counts else None))
        histograms = _shadow_histograms(torch, [(index, shadow_of[id(p)]) for index, (_, members) in
                                                enumerate(self._groups) for p in members
                                                if shadow_of[id(p)] is not None], len(self._groups)).tolist()
        for (group, elements, counts), dense in zip(results, histograms):
            under, sub = counts.tolist() if counts is not None else (0, 0)
            shadow[group] = ShadowStats(under / elements if elements else 0.0, sub / elements if elements else 0.0)
        self._shadow = shadow
        self._shadow_histogram = {group: ShadowHistogram.from_counts(elements, dense)
                                  for (group, elements, _), dense in zip(results, histograms)}
        return float(loss.detach())

    # --- measuring -------------------------------------------------------------------------

    def _format(self) -> str:
        """The compute format: as given, else the autocast dtype the run used, else fp16."""
        if self._compute_format is None:
            torch = import_torch()
            used = next(iter(self.audit._autocast), None)
            self._compute_format = {torch.bfloat16: "bf16"}.get(used, "fp16")
        return self._compute_format

    def _compute_dtype(self):
        """The torch dtype of the compute format (None for a format torch does not compute in); kept once the
        run's autocast dtype is known (the format follows it)."""
        name = _COMPUTE_DTYPES.get(self._format())
        dtype = None if name is None else getattr(import_torch(), name)
        if self.audit._autocast or self._compute_format is not None:
            self._dtype = dtype
        return dtype

    def _bounds(self, in_format: bool = True) -> tuple:
        """The class edges of the compute format, or of float32 for a gradient computed in float32."""
        if in_format not in self._edges:
            self._edges[in_format] = _class_bounds(import_torch(), self._format() if in_format else "fp32")
        return self._edges[in_format]

    def _computed_in(self, param) -> bool:
        """Whether ``param``'s gradients are computed in the compute format (not yet known: as if they were)."""
        return self._in_format.get(id(param), True)

    def _in_pass(self) -> None:
        """Measure what the running backward pass hands over when it ends (queued once per pass)."""
        torch = import_torch()
        task = torch._C._current_graph_task_id()
        if task != self._pass_task:
            self._pass_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._pass_ended)

    def _on_incoming(self, group: str, param, grad) -> None:
        """Tensor hook: ``grad`` is what this backward pass hands the parameter, before it is added into
        ``.grad`` (so one microbatch's own gradient, in the compute format where autocast cast the
        parameter, not the float32 sum of the microbatches so far); measured when the pass ends."""
        if self.audit._paused:  # the shadow pass
            return
        self._in_pass()
        self._incoming.append((group, param, grad))

    def _on_output(self, _module, _args, output) -> None:
        """Global forward hook: the gradient of each module output held in the compute format is where a
        backward overflows first (an fp16 activation gradient, before any parameter's): keep its maximum."""
        torch = import_torch()
        if self.audit._paused or not torch.is_grad_enabled():
            return
        dtype = self._dtype if self._dtype is not None else self._compute_dtype()
        for tensor in _output_tensors(torch, output):
            # a container returns its last child's output: hook each tensor once (a GPT-2 forward hands 38
            # outputs over, 21 of them distinct)
            if tensor.requires_grad and tensor.dtype == dtype and not self._hooked_already(tensor):
                node = tensor.grad_fn
                if node is None:  # a leaf: no node computes its gradient
                    tensor.register_hook(self._on_activation_grad)
                else:  # the node's pre-hook sees the same gradient: ~4 us to register, a tensor hook ~23 us
                    node.register_prehook(functools.partial(self._on_node_grads, tensor.output_nr))

    def _hooked_already(self, tensor) -> bool:
        """Whether ``tensor`` is watched already; else note it (a forward without a backward piles up no more
        than _HOOKED_AT_MOST notes)."""
        known = self._hooked.get(id(tensor))
        if known is not None and known() is tensor:
            return True
        if len(self._hooked) >= _HOOKED_AT_MOST:
            self._hooked.clear()
        self._hooked[id(tensor)] = weakref.ref(tensor)
        return False

    def _on_node_grads(self, output_nr: int, grads) -> None:
        """Node pre-hook: ``grads[output_nr]`` is the watched output's gradient (None where it has none)."""
        if grads[output_nr] is not None:
            self._on_activation_grad(grads[output_nr])

    def _on_activation_grad(self, grad) -> None:
        if not self.audit._paused:
            self._in_pass()
            self._held.append(grad.detach())
            self._held_elements += grad.numel()
            if self._held_elements >= ACTIVATION_BATCH:
                self._measure_held()

    def _measure_held(self) -> None:
        """The held activation gradients' largest magnitude, per device, as the largest 15-bit pattern of the
        16-bit values (they order as the magnitudes, NaN's above inf's): an integer max is ~20x faster on the
        CPU than an fp16 vector_norm or abs().amax()."""
        torch = import_torch()
        by_device: dict = {}
        for grad in self._held:
            by_device.setdefault(grad.device, []).append(grad.reshape(-1).view(torch.int16))
        for patterns in by_device.values():
            joined = patterns[0] if len(patterns) == 1 else torch.cat(patterns)
            self._activation_maxima.append((joined & 0x7FFF).amax())
        self._held, self._held_elements = [], 0

    def _pass_ended(self) -> None:
        incoming, self._incoming, self._pass_task = self._incoming, [], None
        self._hooked.clear()
        self._measure_held()
        activations, self._activation_maxima = self._activation_maxima, []
        self._classify([(param, grad) for _, param, grad in incoming if id(param) not in self._in_format])
        by_group, largest = self._measure_grads([(group, grad, self._computed_in(param))
                                                 for group, param, grad in incoming])
        for group, measured in by_group.items():
            self._passes.setdefault(group, []).extend(measured)
        maxima = [top for (_, param, _), top in zip(incoming, largest) if self._in_format.get(id(param))]
        if activations:  # 16-bit patterns of the compute format (the only dtype hooked): back to its value
            maxima.append(float(import_torch().stack(activations).amax().view(self._compute_dtype())))
        if maxima:
            top = max(math.inf if math.isnan(m) else m for m in maxima)  # NaN: non-finite
            self._compute_max = top if self._compute_max is None else max(self._compute_max, top)
        self._microbatches += 1

    def _classify(self, grads) -> None:
        """Whether each parameter's gradient arrives as compute-format values (autocast cast the
        parameter, so its gradient is computed in the format) or as float32 computed in float32 (a norm's
        weight, an embedding), which no scale makes overflow the format: decided once per parameter, at
        its first gradient with finite nonzero elements, from those (an overflowed pass's finite elements
        tell it too, so the pass is classed by its own format)."""
        torch = import_torch()
        dtype = self._compute_dtype()
        for param, grad in grads:
            grad = grad.detach()
            if dtype is None:
                self._in_format[id(param)] = True  # a format torch has no dtype for: every value counts
                continue
            finite = grad if bool(torch.isfinite(grad).all()) else grad[torch.isfinite(grad)]
            if bool(finite.any()):
                self._in_format[id(param)] = bool((finite.to(dtype).to(grad.dtype) == finite).all())

    def _measure_grads(self, grads) -> tuple:
        """(group -> [(counts, max_abs, min_nonzero, nan)] of the pieces of (group, gradient, computed in the
        compute format) triples, and each gradient's max_abs) (two transfers per CHUNK elements).  Each
        gradient's classes are those of the format it was computed in: a float32 one (a norm's weight, an
        embedding) is never beyond the compute format's range, nor subnormal in it, whatever its values."""
        torch = import_torch()
        pieces = [(_PieceOf(group, index, in_format), piece) for index, (group, grad, in_format) in enumerate(grads)
                  for piece in _pieces(grad) if piece.numel()]
        # a batch holds one device's pieces of one kind: ordered so, a model whose float32-computed gradients
        # (norms, embeddings) lie between its compute-format ones is measured in a few batches, not one per run
        # of a kind (a 4-layer Llama: 18 batches a pass, 2 sorted)
        pieces.sort(key=lambda item: (str(item[1].device), item[0].in_format))
        by_group = {group: [] for group, _ in self._groups}
        largest_of = [0.0] * len(grads)
        for batch in _batches(pieces, kind=lambda item: item[0].in_format):
            tensors = [piece for _, piece in batch]
            bounds = self._bounds(batch[0][0].in_format)
            counts, extremes = _batch_measures(torch, tensors, bounds)
            for ((group, index, _), piece), piece_counts, (smallest, largest) in zip(batch, counts.tolist(),
                                                                                     extremes.tolist()):
                nan = 0
                if piece_counts[3]:
                    nan, largest = _top_class_measures(torch, piece)
                by_group[group].append((piece_counts, largest, smallest, nan))
                largest_of[index] = max(largest_of[index], math.inf if nan else largest)  # NaN: non-finite
        return by_group, largest_of

    def _measure(self) -> dict:
        """GroupStats of every group at the gradients' current values."""
        by_group, _ = self._measure_grads([(group, p.grad, self._computed_in(p)) for group, members in self._groups
                                           for p in members if p.grad is not None])
        return {group: _group_stats(sum(p.numel() for p in members), by_group[group])
                for group, members in self._groups}

    def _found_inf(self, completed: bool) -> bool:
        """The scaler's found-inf for the optimizer in this attempt (else: the update did not run)."""
        if not self.audit._scaling:
            return False
        state = self._scaler._per_optimizer_states.get(id(self._optimizer), {})
        found = state.get("found_inf_per_device")
        if not found:
            return not completed
        return any(float(value) != 0 for value in found.values())

    def _grad_norm(self, log, scale: float) -> Optional[float]:
        """The unscaled norm of the gradients as the last backward pass left them."""
        torch = import_torch()
        norms = [log.accumulated_norms[id(p)] for _, members in self._groups for p in members
                 if p.grad is not None and id(p) in log.accumulated_norms]
        if not norms:
            return None
        return float(torch.linalg.vector_norm(torch.stack([n.cpu() for n in norms]))) / scale

    # --- the trace -------------------------------------------------------------------------

    def _close_open(self) -> None:
        """File the open attempt with the growth tracker as the scaler holds it now."""
        if self._open is None:
            return
        step = self._open.step
        if self.audit._scaling:
            step = dataclasses.replace(step, growth_counter=int(self._scaler._get_growth_tracker()))
        self.steps.append(step)
        self._open = None

    def _build_trace(self, clean: bool):
        from fpemu.recorders.grad_scaler import grad_scaler_params
        scaler = self._scaler
        scaling = self.audit._scaling
        params = grad_scaler_params(scaler) if scaling else {}
        device = next((p.device.type for _, members in self._groups for p in members), "cpu")
        settings = RecorderSettings(self._grouping, self._shadow_every, self._format(), self._statistics)
        metadata = recorded_metadata(
            framework="torch", name=self._name, device=device, profile="torch" if scaling else "none",
            params=params, packages=installed_versions(("torch", "numpy")), settings=settings)
        ranks = self.audit._ranks  # fpemu.audits.distributed.RankCheck on a multi-rank run, else None
        accounting = self.audit.accounting
        findings = audit_findings(self.audit.findings)
        if findings:  # what the audit found, for a comparison to name (none: the key is left out)
            metadata["audit_findings"] = findings
        if ranks is not None:  # every rank's skips and final scale are gathered on a clean exit only
            metadata["ranks"] = ranks.metadata(self.audit.findings, accounting.skipped_updates if clean else None)
        return recorded_trace(metadata, self.steps, final_scale=self.audit._scale(), examples=accounting.examples,
                              scheduler_steps=accounting.scheduler_steps or 0)


def record_torch(scaler, optimizer, model=None, scheduler=None, *, groups="module", shadow_every: int = 0,
                 compute_format: Optional[str] = None, path=None, name: str = "recorded_run",
                 batch_size: Optional[int] = None, statistics: bool = True) -> TorchRecorder:
    """Record a torch mixed-precision training loop, unchanged, as a trace.

    Args:
      scaler: the loop's ``torch.amp.GradScaler`` (or None without loss scaling).
      optimizer: the loop's optimizer (one).
      model: the model, to name gradient groups after its modules; None names them by the
        optimizer's parameter groups.
      scheduler: the loop's LR scheduler (or a list of them), to count its steps.
      groups: ``"module"`` (default: one group per module that owns parameters), ``"parameter"``,
        or a function ``(parameter name, parameter) -> group name``.
      shadow_every: run the float32 shadow pass of :meth:`TorchRecorder.shadow` every this many
        attempts (0: never).
      compute_format: the fpemu format the statistics round to; None: the autocast dtype the run
        uses (fp16 if none).
      path: write the trace there on a clean exit (atomically); None keeps it in ``rec.trace``.  On a
        torch.distributed run of several ranks each rank writes its own: ``{rank}`` in ``path`` is
        filled in, else ``.rank<r>`` goes before the suffix; the trace's metadata then holds ``ranks``
        (rank, world_size, the found-inf reduction, the first attempt at which ranks disagreed, every
        rank's skipped updates and final scale; see fpemu.audits.distributed.RankCheck.metadata) and ``rec.audit.findings`` the audit's
        ``found_inf_not_reduced`` and ``ranks_disagree``.
      name: the run's name (the trace's ``spec.name``).
      batch_size: examples per backward pass, to count examples; None leaves them uncounted.
      statistics: False records only the scaler and loop fields (no per-group statistics).

    Returns:
      A :class:`TorchRecorder`, a context manager around the loop.

    Example:
      >>> import torch
      >>> model = torch.nn.Linear(2, 1)
      >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
      >>> scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
      >>> with record_torch(scaler, optimizer, model) as rec:
      ...     for _ in range(2):
      ...         optimizer.zero_grad()
      ...         scaler.scale(model(torch.ones(1, 2)).pow(2).sum()).backward()
      ...         scaler.step(optimizer)
      ...         scaler.update()
      >>> [(s.step, s.scale, s.applied, s.growth_counter) for s in rec.steps]
      [(0, 1024.0, True, 1), (1, 1024.0, True, 2)]
      >>> sorted(rec.steps[0].grad_stats), rec.steps[0].grad_stats["bias"].elements
      (['bias', 'weight'], 1)
    """
    return TorchRecorder(scaler, optimizer, model, scheduler, groups=groups, shadow_every=shadow_every,
                         compute_format=compute_format, path=path, name=name, batch_size=batch_size,
                         statistics=statistics)


__all__ = ["TorchRecorder", "record_torch"]
