"""Audit a real torch mixed-precision training loop against the GradScaler contract.

``with audit_torch(scaler, optimizer, scheduler) as audit:`` runs the user's loop
unchanged while it watches, for the duration of the block:

* the GradScaler's ``unscale_`` and ``step`` (instance attributes that call the bound methods;
  ``step`` reaches ``unscale_`` through them too);
* each optimizer, through ``register_step_post_hook``, and its parameters, through a
  multi-grad hook that fires once per backward pass and a post-accumulate-grad hook that
  notes each gradient the backward leaves (their norms are taken together when the pass ends);
* the scheduler's ``step``;
* ``torch.nn.utils.clip_grad_norm_`` and ``clip_grad_value_``, patched wherever a loaded
  module holds them: ``torch.nn.utils``, ``torch.nn.utils.clip_grad`` and every module that
  imported them by name (``from torch.nn.utils import clip_grad_norm_ as clip`` included);
  a reference kept elsewhere (a local variable, a closure, a container) is not seen;
* autocast, through a global module forward pre-hook.

Other tools watch through the same instrumentation: an observer added with ``watch`` is told
of each scaled loss, each first unscale_ of an attempt (the gradients still scaled), each finished
attempt and each ``scaler.update`` (``fpemu.record_torch`` records the run this way), and
``paused()`` hides an extra pass (the recorder's float32 shadow pass) from every hook.

Everything is restored on exit.  The wrappers pass the loop's own arguments to the real
calls, and every measurement works on copies, so the loop computes what it computes
unaudited.  Reading the scale costs a device sync per backward pass: an audit is for a
debugging run.  Steps are counted per optimizer: a finding's ``step`` is the index of that
optimizer's update attempt.  torch is imported on first use.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import inspect
import math
import sys
import warnings
from typing import Optional

from fpemu.audits.distributed import rank_check
from fpemu.audits.findings import AuditResult, LoopAccounting, make_finding
from fpemu.formats import RangeStats, range_stats

# clipping function -> the name of its limit argument
_CLIPS = {"clip_grad_norm_": "max_norm", "clip_grad_value_": "clip_value"}


def import_torch():
    """torch, imported on first use (the audit and the recorder run where torch is installed)."""
    import torch
    return torch


def _module_references(values) -> dict:
    """id(value) -> [(module, name)] for every global name of a loaded module bound to one of ``values`` itself
    (one pass over every loaded module's names: ~20 ms with torch and transformers loaded)."""
    found = {id(value): [] for value in values}
    modules = {id(module): module for module in list(sys.modules.values())}  # one module may have two keys
    for module in modules.values():
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            for name, bound in list(namespace.items()):
                if id(bound) in found:
                    found[id(bound)].append((module, name))
    return found


def _rebind(pairs) -> None:
    """Point every loaded module's global names bound to ``old`` at ``new``, for each (old, new) of ``pairs``."""
    new_of = {id(old): new for old, new in pairs}
    for key, references in _module_references([old for old, _ in pairs]).items():
        for module, name in references:
            setattr(module, name, new_of[key])


def _flat(tensors):
    """The tensors' values as one float64 vector."""
    torch = import_torch()
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])


# Gradient elements copied to the host at once for the first update's range statistics: small gradients
# are measured together up to this many (one call instead of one per tensor), a larger one alone.
_HOST_BATCH = 1 << 22


def _host_batches(grads):
    """The gradients as float32 host arrays, consecutive small ones concatenated up to _HOST_BATCH elements."""
    torch = import_torch()
    batch, size = [], 0
    for grad in grads:
        if batch and size + grad.numel() > _HOST_BATCH:
            yield torch.cat(batch).numpy()
            batch, size = [], 0
        batch.append(grad.detach().float().reshape(-1).cpu())
        size += grad.numel()
    if batch:
        yield torch.cat(batch).numpy()


def _range_stats_per_tensor(params, fmt) -> RangeStats:
    """range_stats of all the parameters' gradients together (no gradient: zeros), read a few at a time
    (range_stats counts element by element, so the parts add up), so the host holds at most one
    gradient's copy or _HOST_BATCH elements."""
    parts = [range_stats(values, fmt) for values in _host_batches([p.grad for p in params if p.grad is not None])]
    missing = sum(p.numel() for p in params if p.grad is None)
    counts = {name: sum(getattr(part, name) for part in parts) for name in ("total", "zeros", "underflow",
                                                                            "subnormal", "overflow", "nan")}
    counts["total"] += missing
    counts["zeros"] += missing
    return RangeStats(fmt, 1.0, max_abs=max((part.max_abs for part in parts), default=0.0),
                      min_nonzero_abs=min((part.min_nonzero_abs for part in parts), default=math.inf), **counts)


def _norm(tensors) -> float:
    """Euclidean norm of all the tensors' values together, in float64."""
    return float(import_torch().linalg.vector_norm(_flat(tensors)))


@dataclasses.dataclass
class _OptimizerLog:
    """What the audit tracks for one optimizer while the loop runs."""

    index: int
    optimizer: object
    param_ids: frozenset
    attempts: int = 0
    completed: int = 0
    scaled: bool = False  # its gradients hold scaled values: a backward ran since the last unscale_
    unscaled: bool = False  # unscale_ ran since the last backward pass
    unscaled_in: int = -1  # the update attempt in which unscale_ last ran
    adds_to_unscaled: bool = False  # the running backward pass adds into gradients unscaled this attempt
    # ... into gradients an earlier attempt unscaled and stepped with, never zeroed: their norm
    carried_norm: Optional[float] = None
    # id(param) -> the norm of its .grad as the last backward pass left it (a 0-d float64 tensor)
    accumulated_norms: dict = dataclasses.field(default_factory=dict)
    # (param, its .grad) the running backward pass has accumulated: their norms are taken at its end;
    # the id of the autograd graph task whose end takes them
    pending_norms: list = dataclasses.field(default_factory=list)
    norms_task: Optional[int] = None
    # id(param) -> (id of its .grad, the grad's version counter) as the last backward pass left it
    left_as: dict = dataclasses.field(default_factory=dict)
    # id(param) -> its .grad tensor as a backward pass of this attempt left it (kept, so that gradients a
    # zero_grad between microbatches drops can still be measured); the dropped passes and their sum
    left_grads: dict = dataclasses.field(default_factory=dict)
    dropped_passes: int = 0
    dropped_unmeasured: int = 0
    dropped_sum: Optional[object] = None
    stepping: bool = False  # inside scaler.step(optimizer)
    update_ran: bool = False  # the real update ran inside the current scaler.step
    nonfinite_grads: int = 0  # inf/NaN gradient elements the running optimizer.step applies
    # the scale of each backward pass since the last unscale_, and (backward index, flat gradients
    # before it) at each backward pass whose scale differs from the one before
    window: list = dataclasses.field(default_factory=list)
    snapshots: list = dataclasses.field(default_factory=list)
    attempts_at_scheduler_step: int = 0
    completed_at_scheduler_step: int = 0
    # a clip before unscale_ in this attempt: (its finding's index, id(param) -> the correctly clipped
    # gradient), and (parameters, optimizer state) just before the real update, to measure the update
    clip_check: Optional[tuple] = None
    before_update: Optional[list] = None
    scales: list = dataclasses.field(default_factory=list)  # the scale of each attempt
    skipped: list = dataclasses.field(default_factory=list)  # the attempts whose update did not run

    @property
    def name(self) -> str:
        return f"optimizer[{self.index}]"

    def params(self) -> list:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def grads(self) -> list:
        """Each parameter's gradient, zeros where it has none."""
        torch = import_torch()
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params()]

    def start_window(self) -> None:
        self.window, self.snapshots = [], []
        self.left_grads = {}


def _as_list(value, name: str, check, expected: str) -> list:
    """``value`` (one object or a sequence of them) as a list, each item passing ``check``."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    for index, item in enumerate(items):
        if not check(item):
            where = f"{name}[{index}]" if isinstance(value, (list, tuple)) else name
            raise TypeError(f"{where} must be {expected}, got {type(item).__name__}")
    return items


def _counterfactual_update(optimizer, before: list, state: dict, grads: dict) -> list:
    """The update ``optimizer`` would have made from parameters ``before`` and its ``state_dict``
    ``state`` (both from before its step) with ``grads`` (id(param) -> gradient; the others keep
    their own): a twin of the optimizer steps copies of the parameters."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    copies = iter([old.clone() for old in before])
    groups = []
    for group in optimizer.param_groups:
        members = []
        for param in group["params"]:
            twin = next(copies)
            grad = grads.get(id(param), param.grad)
            twin.grad = None if grad is None else grad.detach().clone()
            members.append(twin)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
    twin_optimizer = type(optimizer)(groups)
    twin_optimizer.load_state_dict(state)
    twin_optimizer.step()
    stepped = [p for group in twin_optimizer.param_groups for p in group["params"]]
    return [new.detach() - old for new, old, _ in zip(stepped, before, params)]


class TorchLoopAudit:
    """Records one run of a torch training loop and what it did against the mixed-precision contract.

    Use :func:`audit_torch` to create one.  While the ``with`` block runs, :attr:`findings` and
    :attr:`accounting` show what has been seen so far; the run-level findings (every update
    skipped, fp16 autocast without a scaler, a scaler under bf16 autocast) are added on exit.
    """

    def __init__(self, scaler, optimizers, scheduler=None, *, batch_size: Optional[int] = None):
        torch = import_torch()
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"scaler must be a torch.amp.GradScaler or None, got {type(scaler).__name__}")
        optimizers = _as_list(optimizers, "optimizers", lambda o: isinstance(o, torch.optim.Optimizer),
                              "a torch.optim.Optimizer")
        if not optimizers:
            raise ValueError("optimizers must name at least one torch.optim.Optimizer")
        self._schedulers = [] if scheduler is None else _as_list(
            scheduler, "scheduler", lambda s: callable(getattr(s, "step", None)),
            "an LR scheduler with a step() method")
        if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        self._scaler = scaler
        self._batch_size = batch_size
        self._logs = [_OptimizerLog(i, opt, frozenset(id(p) for g in opt.param_groups for p in g["params"]))
                      for i, opt in enumerate(optimizers)]
        self._findings: list = []
        self._scheduler_steps = [0] * len(self._schedulers)
        self._backward_passes = 0
        self._updates = 0  # scaler.update() calls
        self._first_scale: Optional[float] = None
        self._autocast: dict = {}  # autocast dtype -> attempt index where first seen
        self._grad_stats: Optional[dict] = None  # format -> RangeStats of the first update's gradients
        self._devices: set = set()  # device types of the parameters, where autocast is looked for
        self._undo: list = []
        self._ranks = None
        self._observers: list = []
        self._paused = 0  # > 0 while an observer's own pass runs: every hook lets it through unseen
        self._state = "new"

    # --- results -------------------------------------------------------------------

    @property
    def findings(self) -> tuple:
        return tuple(self._findings)

    @property
    def accounting(self) -> LoopAccounting:
        attempts = sum(log.attempts for log in self._logs)
        completed = sum(log.completed for log in self._logs)
        return LoopAccounting(
            attempts=attempts, completed_updates=completed, skipped_updates=attempts - completed,
            backward_passes=self._backward_passes,
            examples=None if self._batch_size is None else self._backward_passes * self._batch_size,
            scheduler_steps=sum(self._scheduler_steps))

    @property
    def result(self) -> AuditResult:
        """Findings, accounting, and the first optimizer's skipped attempts and scale at each attempt."""
        first = self._logs[0]
        return AuditResult(self.findings, self.accounting, skipped_steps=tuple(first.skipped),
                           scales=tuple(first.scales))

    def summary(self) -> str:
        return self.result.summary()

    # --- observers ------------------------------------------------------------------

    def watch(self, observer) -> None:
        """Tell ``observer`` what the loop does, through the methods it has of ``scaled(outputs)``,
        ``before_unscale(log)``, ``attempt_finished(log, completed)`` and ``updated()``."""
        if self._state != "new":
            raise RuntimeError("add observers before the audit starts")
        self._observers.append(observer)

    def _notify(self, event: str, *args) -> None:
        for observer in self._observers:
            handler = getattr(observer, event, None)
            if handler is not None:
                handler(*args)

    @contextlib.contextmanager
    def paused(self):
        """Hooks and wrappers let everything inside the block through without recording it."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    # --- instrumenting ---------------------------------------------------------------

    def __enter__(self) -> "TorchLoopAudit":
        if self._state != "new":
            raise RuntimeError("an audit records one run; create a new one with audit_torch(...)")
        self._state = "running"
        try:
            self._instrument()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self._restore()
        self._state = "closed"
        self._findings.extend(self._run_findings())

    def _restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _set(self, owner, name: str, value) -> None:
        """Set ``owner.name`` to ``value`` until the audit ends."""
        own = vars(owner)
        had, old = name in own, own.get(name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def _instrument(self) -> None:
        torch = import_torch()
        graph = torch.autograd.graph
        trainable = [p for log in self._logs for p in log.params() if p.requires_grad]
        if trainable and len(self._logs) > 1:  # one optimizer: its own hook counts the passes (one hook less)
            hook = graph.register_multi_grad_hook(trainable, self._count_backward, mode="any")
            self._undo.append(hook.remove)
        for log in self._logs:
            params = [p for p in log.params() if p.requires_grad]
            if params:
                on_backward = functools.partial(self._on_backward, log)
                hook = graph.register_multi_grad_hook(params, on_backward, mode="any")
                self._undo.append(hook.remove)
                for param in params:
                    hook = param.register_post_accumulate_grad_hook(functools.partial(self._on_accumulated, log))
                    self._undo.append(hook.remove)
            self._undo.append(log.optimizer.register_step_pre_hook(self._before_update).remove)
            self._undo.append(log.optimizer.register_step_post_hook(self._on_update).remove)
        self._devices = {p.device.type for p in trainable}
        self._ranks = rank_check(self._scaler, trainable)  # None on one rank (fpemu.audits.distributed)
        self._findings.extend(self._ranks.start() if self._ranks else [])
        self._undo.append(torch.nn.modules.module.register_module_forward_pre_hook(self._on_forward).remove)
        if self._scaler is not None:
            scaler = self._scaler
            unscale, step = scaler.unscale_, scaler.step
            self._set(scaler, "unscale_", lambda optimizer: self._unscale(unscale, optimizer))
            self._set(scaler, "step", lambda optimizer, *a, **k: self._scaler_step(step, optimizer, *a, **k))
            update = scaler.update  # counted always: a finding says whether the scale could have changed
            self._set(scaler, "update", lambda *a, **k: self._updated(update, *a, **k))
            if self._observers:
                scale = scaler.scale
                self._set(scaler, "scale", lambda outputs: self._scaled(scale, outputs))
        for index, scheduler in enumerate(self._schedulers):
            real = scheduler.step
            self._set(scheduler, "step",
                      lambda *a, index=index, real=real, **k: self._scheduler_step(real, index, *a, **k))
        reals = {name: getattr(torch.nn.utils.clip_grad, name) for name in _CLIPS}
        wrappers = {name: self._clip_wrapper(real, name, _CLIPS[name]) for name, real in reals.items()}
        references = _module_references(reals.values())
        for name, real in reals.items():
            for module, attribute in references[id(real)]:
                self._set(module, attribute, wrappers[name])
        # a module that imports a wrapper while the audit runs gets the real function back
        self._undo.append(functools.partial(_rebind, [(wrappers[name], reals[name]) for name in _CLIPS]))

    # --- state --------------------------------------------------------------------

    @property
    def _scaling(self) -> bool:
        return self._scaler is not None and self._scaler.is_enabled()

    def _scale(self) -> float:
        return float(self._scaler.get_scale()) if self._scaling else 1.0

    def _log_for(self, optimizer) -> Optional[_OptimizerLog]:
        return next((log for log in self._logs if log.optimizer is optimizer), None)

    def _add(self, kind: str, step: int, call: str, effect: dict, detail: str) -> None:
        self._findings.append(make_finding(kind, step, call, effect, detail))

    def _finish_attempt(self, log: _OptimizerLog, completed: bool) -> None:
        self._report_dropped(log, f"{log.name}.step()")  # an attempt that never unscaled
        self._notify("attempt_finished", log, completed)
        log.scales.append(self._scale())
        if self._first_scale is None:  # gradients set by hand: no backward pass read the scale
            self._first_scale = log.scales[-1]
        if not completed:
            log.skipped.append(log.attempts)
        log.clip_check = log.before_update = None
        log.attempts += 1
        log.completed += int(completed)
        log.start_window()

    # --- hooks and wrappers --------------------------------------------------------

    def _count_backward(self, _grads) -> None:
        if not self._paused:
            self._backward_passes += 1

    def _on_backward(self, log: _OptimizerLog, _grads) -> None:
        """Runs before this backward pass adds into the optimizer's .grad tensors."""
        if self._paused:
            return
        if len(self._logs) == 1:  # the same parameters as the counting hook's, which is left out
            self._count_backward(_grads)
        scale = self._scale()
        if self._first_scale is None:
            self._first_scale = scale
        # Adding into gradients unscaled in this attempt (a skipped step's zero_grad clears them;
        # autograd.grad adds nothing): confirmed when the pass really accumulates.
        holds_unscaled = log.unscaled and self._scaling and any(
            p.grad is not None and bool(p.grad.any()) for p in log.params())
        log.adds_to_unscaled = holds_unscaled and log.unscaled_in == log.attempts
        if holds_unscaled and log.unscaled_in < log.attempts:
            log.carried_norm = _norm([p.grad for p in log.params() if p.grad is not None])
        if log.window and not log.unscaled and log.left_grads:
            self._check_dropped(log)
        if log.window and scale != log.window[-1]:
            log.snapshots.append((len(log.window), _flat(log.grads())))
        log.window.append(scale)
        log.scaled, log.unscaled = self._scaling, False

    def _on_accumulated(self, log: _OptimizerLog, param) -> None:
        """Runs after a backward pass added into ``param.grad``."""
        torch = import_torch()
        task = torch._C._current_graph_task_id()
        if task != log.norms_task:  # the pass's first accumulation: take all its norms when it ends
            log.norms_task = task
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._take_norms, log))
        log.pending_norms.append((param, param.grad))
        log.left_as[id(param)] = (id(param.grad), param.grad._version)
        log.left_grads[id(param)] = param.grad
        if log.carried_norm is not None:
            self._report_carried(log, log.carried_norm)
            log.carried_norm = None
        if log.adds_to_unscaled:
            log.adds_to_unscaled = False
            scale = self._scale()
            self._add("backward_after_unscale", log.attempts, f"backward after scaler.unscale_({log.name})",
                      {"scale": scale, "weight_of_this_backward": scale},
                      f"this backward pass adds gradients multiplied by the scale {scale:g} to gradients "
                      f"already unscaled, and scaler.step will neither unscale them nor check them for "
                      f"inf/NaN: they count {scale:g}x too much")

    def _check_dropped(self, log: _OptimizerLog) -> None:
        """Before a backward pass of an attempt that already ran one: every gradient the last pass left
        is gone (set to None, replaced, or zeroed in place: a zero_grad between microbatches), so the
        update will hold only the passes after it.  Keeps the dropped sum to measure the error."""
        params = [p for p in log.params() if id(p) in log.left_grads]
        left = [(p, log.left_grads[id(p)]) for p in params]
        if any(p.grad is grad and log.left_as[id(p)][1] == grad._version for p, grad in left):
            return  # something the last pass left is still there: no zero_grad
        in_place = [grad for p, grad in left if p.grad is grad]
        if any(bool(grad.any()) for grad in in_place):
            return  # changed in place but not zeroed (a clip between microbatches): not a zero_grad
        log.dropped_passes += 1
        if in_place:  # zeroed in place: the values are gone
            log.dropped_unmeasured += 1
        else:
            by_id = {id(p): grad for p, grad in left}
            dropped = _flat([by_id.get(id(p), import_torch().zeros_like(p)) for p in log.params()])
            log.dropped_sum = dropped if log.dropped_sum is None else log.dropped_sum + dropped
        log.left_grads = {}

    def _report_dropped(self, log: _OptimizerLog, call: str) -> None:
        """File the attempt's zero_grad_between_microbatches finding (once), with the gradient's error."""
        dropped, total = log.dropped_passes, len(log.window)
        if not dropped:
            return
        effect = {"microbatches": total, "dropped_microbatches": dropped}
        detail = (f"the gradients of {dropped} of {total} accumulated microbatches were cleared (zero_grad between "
                  f"backward passes) before {call}, so the update holds only the last {total - dropped}")
        if log.dropped_sum is not None and not log.dropped_unmeasured:
            kept = _flat(log.grads())
            intended = float((kept + log.dropped_sum).norm())
            lost = float(log.dropped_sum.norm())
            if math.isfinite(intended) and intended:
                effect["relative_gradient_error"] = error = lost / intended
                detail += f": the gradient is off by {error:.1%} of the accumulated gradient's norm"
            else:
                detail += "; a microbatch overflowed, so the size of the error was not measured"
        else:
            detail += "; they were zeroed in place, so the size of the error was not measured"
        log.dropped_passes = log.dropped_unmeasured = 0
        log.dropped_sum = None
        self._add("zero_grad_between_microbatches", log.attempts, call, effect, detail)

    def _take_norms(self, log: _OptimizerLog) -> None:
        """At the end of a backward pass, the norm of each gradient it accumulated, in one call (the same
        values as one torch.linalg.vector_norm per gradient; kept on the device: read only if an unscale_
        follows, so no sync here)."""
        torch = import_torch()
        pending, log.pending_norms, log.norms_task = log.pending_norms, [], None
        norms = torch._foreach_norm([grad.detach() for _, grad in pending], 2, dtype=torch.float64)
        log.accumulated_norms.update((id(param), norm) for (param, _), norm in zip(pending, norms))

    def _report_carried(self, log: _OptimizerLog, carried: float) -> None:
        """A backward pass adds scaled gradients to ones the last attempt unscaled and stepped with (or, where it
        overflowed and was skipped, to its inf/NaN)."""
        scale = self._scale()
        call = f"backward after scaler.step({log.name}) without zero_grad"
        effect = {"scale": scale, "carried_weight": 1 / scale, "carried_grad_norm": carried}
        if log.unscaled_in in log.skipped or not math.isfinite(carried):
            self._add("gradients_carried_across_steps", log.attempts, call, {**effect, "carried_nonfinite": 1.0},
                      f"this backward pass adds to the gradients of attempt {log.unscaled_in}, which overflowed "
                      f"(they hold inf/NaN, so its update was skipped) and were never zeroed: the inf/NaN stays in "
                      f"every later microbatch's sum, so each later attempt of this window overflows and is "
                      f"skipped too")
            return
        self._add("gradients_carried_across_steps", log.attempts, call, effect,
                  f"this backward pass adds gradients multiplied by the scale {scale:g} to the gradients "
                  f"of attempt {log.unscaled_in}, which scaler.step already unscaled and applied; the next "
                  f"unscale_ divides both by {scale:g}, so the update mixes g_old / {scale:g} + g_new and "
                  f"applies g_old a second time")

    def _on_forward(self, _module, _args) -> None:
        torch = import_torch()
        if self._paused:
            return
        for device in self._devices:
            if torch.is_autocast_enabled(device):
                self._autocast.setdefault(torch.get_autocast_dtype(device), self._logs[0].attempts)

    def _before_update(self, optimizer, _args, _kwargs) -> None:
        """Step pre-hook: after a clip before unscale_, keep the parameters as they are now; an update about to
        run on an overflowed step is counted."""
        log = self._log_for(optimizer)
        log.nonfinite_grads = self._nonfinite_grads(log) if self._scaling else 0
        if log.clip_check is not None:
            log.before_update = ([p.detach().clone() for p in log.params()],
                                 copy.deepcopy(optimizer.state_dict()))

    def _nonfinite_grads(self, log: _OptimizerLog) -> int:
        """The inf/NaN gradient elements an update about to run applies: inside scaler.step only where the
        scaler found inf and still stepped (a fused optimizer that skips by itself is told found_inf); outside
        it (optimizer.step() called directly) nothing checked them, so they are counted (one pass)."""
        torch = import_torch()
        optimizer = log.optimizer
        if log.stepping:
            if getattr(optimizer, "_step_supports_amp_scaling", False) or getattr(optimizer, "found_inf", None) is not None:
                return 0
            state = self._scaler._per_optimizer_states.get(id(optimizer), {})
            if not any(float(v) for v in state.get("found_inf_per_device", {}).values()):
                return 0
        grads = [p.grad for p in log.params() if p.grad is not None]
        return sum(int((~torch.isfinite(grad)).sum()) for grad in grads)

    def _report_nonfinite_update(self, log: _OptimizerLog) -> None:
        """The update ran on inf/NaN gradients: how many parameter elements it left non-finite."""
        torch = import_torch()
        params = log.params()
        broken = sum(int((~torch.isfinite(p.detach())).sum()) for p in params)
        elements = sum(p.numel() for p in params)
        call = f"scaler.step({log.name})" if log.stepping else f"{log.name}.step() outside scaler.step"
        self._add("update_on_nonfinite_grads", log.attempts, call,
                  {"nonfinite_grad_elements": log.nonfinite_grads, "nonfinite_param_elements": broken,
                   "param_elements": elements, "scale": self._scale()},
                  f"the optimizer's update ran on gradients holding {log.nonfinite_grads} inf/NaN elements (an "
                  f"overflowed step, which scaler.step(optimizer) would have skipped); it left {broken} of "
                  f"{elements} parameter elements inf/NaN")
        log.nonfinite_grads = 0

    def _on_update(self, optimizer, _args, _kwargs) -> None:
        """Step post-hook: the optimizer's real update ran (unless a fused optimizer found infs)."""
        log = self._log_for(optimizer)
        if log.nonfinite_grads:
            self._report_nonfinite_update(log)
        if log.before_update is not None:
            self._measure_clip_update(log)
        found_inf = getattr(optimizer, "found_inf", None)
        ran = found_inf is None or float(found_inf) == 0
        if self._autocast and self._grad_stats is None and ran:
            self._grad_stats = {fmt: _range_stats_per_tensor(log.params(), fmt) for fmt in ("fp16", "bf16")}
        if log.stepping:
            log.update_ran = ran
        else:
            self._finish_attempt(log, completed=True)

    def _measure_clip_update(self, log: _OptimizerLog) -> None:
        """Amend the clip finding with the update the optimizer made and the one the correct order
        makes: the same optimizer, from the same state, stepped on the correctly clipped gradients.
        Under Adam-like optimizers the two differ far less than the gradients do."""
        index, correct_grads = log.clip_check
        (before, state), log.before_update, log.clip_check = log.before_update, None, None
        made = [p.detach() - old for p, old in zip(log.params(), before)]
        correct = _counterfactual_update(log.optimizer, before, state, correct_grads)
        finding = self._findings[index]
        this_order, right_order = _norm(made), _norm(correct)
        shrink = right_order / this_order if this_order else (1.0 if not right_order else float("inf"))
        effect = {**finding.effect, "update_norm_this_order": this_order, "update_norm_correct_order": right_order,
                  "shrink": shrink}
        optimizer = type(log.optimizer).__name__
        update = (f"{optimizer} made an update of norm {this_order:.4g} instead of {right_order:.4g} "
                  f"({shrink:.4g}x too small)" if right_order else
                  f"{optimizer}'s update is 0 in either order this step (learning rate "
                  f"{float(log.optimizer.param_groups[0]['lr']):g})")
        self._findings[index] = dataclasses.replace(finding, effect=effect, detail=(
            f"clipped gradients still multiplied by the scale {effect['scale']:g}: the clipped gradient's norm is "
            f"{effect['grad_norm_this_order']:.4g} instead of {effect['grad_norm_correct_order']:.4g}, and {update}"))

    def _scaler_step(self, real, optimizer, *args, **kwargs):
        log = self._log_for(optimizer)
        if log is None:
            return real(optimizer, *args, **kwargs)
        log.stepping, log.update_ran = True, False
        try:
            result = real(optimizer, *args, **kwargs)
        finally:
            log.stepping = False
        self._finish_attempt(log, completed=log.update_ran)
        if self._ranks is not None:
            self._findings.extend(self._ranks.after_attempt(log.attempts - 1, log.update_ran))
        return result

    def _unscale(self, real, optimizer) -> None:
        log = self._log_for(optimizer)
        if log is None:
            return real(optimizer)
        call = f"scaler.step({log.name}) (its own unscale_)" if log.stepping else f"scaler.unscale_({log.name})"
        if log.unscaled:
            return self._unscale_again(real, log, call)
        if log.scaled:
            self._check_manual_unscale(log, call)
        if len(set(log.window)) > 1:
            self._record_scale_change(log, call)
        self._report_dropped(log, call)
        self._notify("before_unscale", log)
        real(optimizer)
        log.scaled, log.unscaled, log.unscaled_in = False, True, log.attempts
        log.start_window()
        return None

    def _check_manual_unscale(self, log: _OptimizerLog, call: str) -> None:
        """Gradients already divided by the scale since the backward pass left them: unscale_ is
        about to divide them again."""
        scale = self._scale()
        with_grads = [p for p in log.params() if p.grad is not None]
        if any(log.left_as.get(id(p)) == (id(p.grad), p.grad._version) for p in with_grads):
            return  # a gradient as the backward left it: not all were divided (and nothing is read here)
        pairs = [(log.accumulated_norms.get(id(p)), p.grad) for p in with_grads]
        pairs = [(float(norm), grad) for norm, grad in pairs if norm is not None]
        pairs = [(after_backward, grad) for after_backward, grad in pairs if after_backward]
        if scale == 1.0 or not pairs:
            return
        after_backward = math.sqrt(sum(norm * norm for norm, _ in pairs))
        now = _norm([grad for _, grad in pairs])
        if all(abs(_norm([grad]) * scale / norm - 1) < 1e-3 for norm, grad in pairs):
            self._add("manual_unscale", log.attempts, call,
                      {"scale": scale, "grad_norm_after_backward": after_backward, "grad_norm_before_unscale": now,
                       "update_norm_factor": 1 / scale},
                      f"the gradients were already divided by the scale {scale:g} (norm {after_backward:.4g} -> "
                      f"{now:.4g}) and {call} divides them again: the update is {scale:g}x too small")

    def _unscale_again(self, real, log: _OptimizerLog, call: str) -> None:
        """unscale_ on gradients already unscaled since the last backward pass: measure and pass on."""
        scale, before = self._scale(), _norm(log.grads())
        try:
            real(log.optimizer)
        except RuntimeError as error:
            self._add("unscale_twice", log.attempts, call, {"scale": scale, "grad_norm": before},
                      f"unscale_ ran again on gradients already unscaled since the last backward pass; "
                      f"torch raised: {error}")
            raise
        after = _norm(log.grads())
        self._add("unscale_twice", log.attempts, call,
                  {"scale": scale, "grad_norm_before": before, "grad_norm_after": after},
                  f"gradients already unscaled were divided by the scale {scale:g} again: "
                  f"norm {before:.4g} -> {after:.4g}")

    def _record_scale_change(self, log: _OptimizerLog, call: str) -> None:
        """The accumulated microbatches carry different scales; one division by the current scale
        weights microbatch i by S_i / S.  Measures the weights and the gradient's relative error."""
        scale = self._scale()
        total = _flat(log.grads())
        bounds = [0] + [index for index, _ in log.snapshots] + [len(log.window)]
        cumulative = [import_torch().zeros_like(total)] + [snapshot for _, snapshot in log.snapshots] + [total]
        intended = sum((cumulative[r + 1] - cumulative[r]) / log.window[bounds[r]]  # each run at its own scale
                       for r in range(len(bounds) - 1))
        weights = tuple(s / scale for s in log.window)
        effect = {"scales": tuple(log.window), "unscale_scale": scale, "weights": weights}
        detail = (f"{len(log.window)} accumulated microbatches were scaled by {list(log.window)} and "
                  f"unscaled once by {scale:g}: they weigh {list(weights)} instead of 1 each")
        if bool(import_torch().isfinite(total).all()):
            actual = total / scale
            reference = float(intended.norm())
            effect["relative_gradient_error"] = error = (float((actual - intended).norm()) / reference
                                                         if reference else float("inf"))
            detail += f", and the gradient is off by {error:.1%} of its norm"
        else:  # an overflowed microbatch: the error of an inf/NaN gradient has no size
            detail += ("; a microbatch overflowed, so the gradients hold inf/NaN and scaler.step skips "
                       "this update (the misweighting hits the updates that do run)")
        self._add("scale_changed_in_accumulation", log.attempts, call, effect, detail)

    def _scaled(self, real, outputs):
        self._notify("scaled", outputs)
        return real(outputs)

    def _updated(self, real, *args, **kwargs):
        result = _at_callers_line(real, *args, **kwargs)
        self._updates += 1
        self._notify("updated")
        return result

    def _scheduler_step(self, real, index: int, *args, **kwargs):
        result = _at_callers_line(real, *args, **kwargs)
        self._scheduler_steps[index] += 1
        scheduler = self._schedulers[index]
        log = self._log_for(getattr(scheduler, "optimizer", None))
        if log is None and len(self._logs) == 1:
            log = self._logs[0]
        if log is None:
            return result
        if log.attempts > log.attempts_at_scheduler_step and log.completed == log.completed_at_scheduler_step:
            lr = float(log.optimizer.param_groups[0]["lr"])
            self._add("scheduler_on_skipped_update", log.attempts - 1, f"{type(scheduler).__name__}.step()",
                      {"scheduler_steps": self._scheduler_steps[index], "completed_updates": log.completed,
                       "skipped_updates": log.attempts - log.completed, "lr": lr},
                      f"the scheduler advanced although {log.name}'s update was skipped: "
                      f"{self._scheduler_steps[index]} scheduler steps for {log.completed} completed updates "
                      f"(lr now {lr:g})")
        log.attempts_at_scheduler_step, log.completed_at_scheduler_step = log.attempts, log.completed
        return result

    def _clip_wrapper(self, real, name: str, limit_name: str):
        signature = inspect.signature(real)

        def clip(parameters, *args, **kwargs):
            torch = import_torch()
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            ids = {id(p) for p in params}
            owners = [log for log in self._logs if log.scaled and log.param_ids & ids]
            if not owners:
                return real(params, *args, **kwargs)
            limit = float(signature.bind(params, *args, **kwargs).arguments[limit_name])
            scale = self._scale()
            inv_scale = torch.tensor(scale, dtype=torch.float64).reciprocal().float()  # as unscale_ computes it
            grads = [p.grad for p in params if p.grad is not None]
            stand_ins = []  # parameters holding the unscaled gradients: the correct order, on copies
            for grad in grads:
                stand_in = torch.zeros_like(grad)
                stand_in.grad = grad.detach() * inv_scale.to(grad.device)
                stand_ins.append(stand_in)
            true_norm = _norm([s.grad for s in stand_ins])
            result = real(params, *args, **kwargs)
            real(stand_ins, *args, **kwargs)
            correct = _norm([s.grad for s in stand_ins])
            this_order = _norm([g * inv_scale.to(g.device) for g in grads])
            shrink = correct / this_order if this_order else float("inf")
            call = f"torch.nn.utils.{name}({limit_name}={limit:g})"
            effect = {"scale": scale, "limit": limit, "true_grad_norm": true_norm,
                      "grad_norm_correct_order": correct, "grad_norm_this_order": this_order, "grad_shrink": shrink}
            if not math.isfinite(true_norm):
                detail = (f"clipped gradients still multiplied by the scale {scale:g}, at a step whose gradients hold "
                          f"inf/NaN (it overflowed, and scaler.step skips its update), so the error has no size here")
            else:
                detail = (f"clipped gradients still multiplied by the scale {scale:g}: the clipped gradient's norm "
                          f"is {this_order:.4g} instead of {correct:.4g} ({shrink:.4g}x too small; the update was "
                          f"skipped, so its size was not measured)")
            self._add("clip_before_unscale", owners[0].attempts, call, effect, detail)
            # measured when the optimizer steps (the finding's text above stands if it never does)
            owners[0].clip_check = (len(self._findings) - 1, {id(p): s.grad for p, s in
                                                               zip([p for p in params if p.grad is not None],
                                                                   stand_ins)})
            return result

        return clip

    # --- run-level findings ---------------------------------------------------------

    def _run_findings(self) -> list:
        """Findings about the whole run: every update skipped, and the scaler against the autocast dtype."""
        torch = import_torch()
        accounting, found = self.accounting, []
        if self._scaling and accounting.attempts and not accounting.completed_updates:
            last = max(self._logs, key=lambda log: log.attempts)
            found.append(make_finding(
                "all_updates_skipped", last.attempts - 1, f"scaler.step({last.name})",
                {"attempts": accounting.attempts, "first_scale": self._first_scale,
                 "final_scale": self._scale()},
                f"all {accounting.attempts} updates were skipped for non-finite gradients; "
                f"{self._scale_history()}"))
        if torch.float16 in self._autocast and not self._scaling:
            found.append(self._autocast_finding(
                "fp16_autocast_without_scaler", torch.float16, "torch.autocast(dtype=torch.float16)",
                "fp16", {},
                "fp16 autocast ran with no loss scaling, so gradients below about 2^-25 rounded to zero"))
        if torch.bfloat16 in self._autocast and torch.float16 not in self._autocast and self._scaling:
            found.append(self._autocast_finding(
                "scaler_under_bf16", torch.bfloat16,
                "torch.amp.GradScaler under torch.autocast(dtype=torch.bfloat16)", "bf16",
                {"attempts": accounting.attempts, "skipped_updates": accounting.skipped_updates},
                f"a GradScaler ran under bf16 autocast, whose range is float32's, and skipped "
                f"{accounting.skipped_updates} of {accounting.attempts} updates"))
        return found

    def _scale_history(self) -> str:
        """What the scale did over the run, in words (it cannot fall where scaler.update() never ran)."""
        first, last = self._first_scale, self._scale()
        if not self._updates:
            return f"scaler.update() was never called, so the scale stayed at {last:g}"
        if first == last:
            return f"the scale stayed at {last:g} through {self._updates} scaler.update() calls"
        return f"the scale {'fell' if last < first else 'rose'} from {first:g} to {last:g}"

    def _autocast_finding(self, kind: str, dtype, call: str, fmt: str, effect: dict, detail: str):
        """A finding about the autocast dtype, with what ``fmt`` did to the first update's gradients."""
        if self._grad_stats is not None:
            stats = self._grad_stats[fmt]
            effect = {**effect, "zero_share": stats.zeros_share,
                      f"{fmt}_subnormal_share": stats.subnormal_share,
                      f"{fmt}_underflow_share": stats.underflow_share}
            detail += (f"; at the first update {stats.zeros_share:.1%} of gradient elements were zero, and "
                       f"{fmt} would round {stats.underflow_share:.1%} more to zero and "
                       f"{stats.subnormal_share:.1%} to subnormals")
        return make_finding(kind, self._autocast[dtype], call, effect, detail)


def _at_callers_line(real, *args, **kwargs):
    """``real(*args, **kwargs)`` as the loop called it: a warning ``real`` attributes to its caller
    (``stacklevel=2``, torch's "lr_scheduler.step() before optimizer.step()") names the user's line, not the
    audit's wrapper; every other warning is issued as it was, through the user's warning filters."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = real(*args, **kwargs)
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename == __file__:
        frame = frame.f_back
    for caught_warning in caught:
        filename, lineno = caught_warning.filename, caught_warning.lineno
        if filename == __file__ and frame is not None:
            filename, lineno = frame.f_code.co_filename, frame.f_lineno
        warnings.warn_explicit(caught_warning.message, caught_warning.category, filename, lineno)
    return result


def audit_torch(scaler, optimizers, scheduler=None, *, batch_size: Optional[int] = None) -> TorchLoopAudit:
    """Watch a torch training loop for breaches of the mixed-precision contract.

    Args:
      scaler: the loop's ``torch.amp.GradScaler`` (or subclass), or None where the loop has none.
      optimizers: the loop's optimizer, or a list of them.
      scheduler: the loop's LR scheduler, a list of them, or None.
      batch_size: examples per backward pass, to count examples processed; None to leave them uncounted.

    Returns:
      A :class:`TorchLoopAudit` to use as a context manager around the loop; after the block its
      ``findings``, ``accounting`` and ``summary()`` tell what the loop did.

    Example:
      >>> import torch
      >>> weight = torch.nn.Parameter(torch.zeros(2))
      >>> optimizer = torch.optim.SGD([weight], lr=0.1)
      >>> scaler = torch.amp.GradScaler("cpu", init_scale=100.0)
      >>> with audit_torch(scaler, optimizer) as audit:
      ...     scaler.scale((weight * torch.tensor([3.0, 4.0])).sum()).backward()
      ...     norm = torch.nn.utils.clip_grad_norm_([weight], max_norm=2.0)   # before unscale_
      ...     scaler.step(optimizer)
      ...     scaler.update()
      >>> finding = audit.findings[0]
      >>> finding.kind, finding.step, finding.call
      ('clip_before_unscale', 0, 'torch.nn.utils.clip_grad_norm_(max_norm=2)')
      >>> [round(finding.effect[k], 6) for k in ("grad_norm_correct_order", "grad_norm_this_order")]
      [2.0, 0.02]
      >>> [round(finding.effect[k], 6) for k in ("update_norm_correct_order", "update_norm_this_order")]  # SGD, lr 0.1
      [0.2, 0.002]
    """
    return TorchLoopAudit(scaler, optimizers, scheduler, batch_size=batch_size)


__all__ = ["TorchLoopAudit", "audit_torch"]
