"""Real multi-rank loss scaling on torch.distributed: DDP, FSDP1 and FSDP2, each rank a process.

:func:`run_cases` forks ``world_size`` processes that join one process group (gloo on the
CPU, NCCL on CUDA) through a ``file://`` rendezvous and run every case of the batch in it,
with a barrier between cases (cheaper than a launch per case: see reports/bench_ranks.md).
Each rank builds the same model (a probe, Linear(8, 16), Tanh, Linear(16, 4), SGD), wraps it
in the case's layout, drives the real scaler for the case's steps and injects the case's
non-finite value at its point (fpemu.ranks.INJECTIONS), recording per step the scale used,
its found-inf as its scaler saw it, whether ``optimizer.step`` ran, the growth tracker and a
checksum of its local parameters.

A case that crashes a rank (gloo aborts a collective mismatch) or hangs (NCCL does) is one
:class:`CaseResult` with its error: the parent kills the group, and the cases after it run in a
fresh one.  torch is imported in the function that needs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import os
import queue as queue_errors
import tempfile
import time
from datetime import timedelta
from typing import Optional

_HIDDEN, _OUT = 16, 4
_JOIN_TIMEOUT_S = 180.0  # forking and joining the group: slow on a loaded machine, never a hang of the case
_SYNC_EVERY, _SYNC_SIZE = 2, 7  # the step-keyed collective: every 2nd update, 7 floats


@dataclasses.dataclass(frozen=True)
class RankRecord:
    """What one rank did over a case, step by step (see the module doc)."""

    rank: int
    scales: list
    found_inf: list
    applied: list
    growth_tracker: list
    checksums: list
    final_scale: float
    final_params: list
    findings: tuple = ()


@dataclasses.dataclass(frozen=True)
class CaseResult:
    """One case's outcome: every rank's record, or why there is none.

    Attributes:
      ranks: per rank, a :class:`RankRecord` (empty when the case failed).
      error: None, or what ended it: a rank's exception (a gloo 'collective mismatch' abort), a
        rank that died, or ``timeout`` (a hang).
      seconds: wall time of the case in its process group.
    """

    ranks: tuple
    error: Optional[str] = None
    seconds: float = 0.0


# --- in each rank ------------------------------------------------------------------------


def _model(torch, world_size: int):
    """Probe + Linear + Tanh + Linear, the same on every rank (seeded)."""
    nn = torch.nn

    class Poison(torch.autograd.Function):
        """Forward adds nothing; backward writes inf into one element of the probe's gradient, before any
        hook of DDP or FSDP sees it (so the gradient reduction carries it)."""

        @staticmethod
        def forward(ctx, weight, index):
            ctx.index, ctx.shape, ctx.device = index, weight.shape, weight.device
            return weight.sum() * 0.0

        @staticmethod
        def backward(ctx, _upstream):
            grad = torch.zeros(ctx.shape, device=ctx.device)
            if ctx.index is not None:
                grad[ctx.index] = float("inf")
            return grad, None

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            # One element per rank: under FSDP (dim-0 or flat sharding of its own unit) rank r owns element r.
            self.weight = nn.Parameter(torch.zeros(world_size))
            self.poison = None

        def forward(self, x):
            return x + Poison.apply(self.weight, self.poison)

    torch.manual_seed(0)
    return nn.Sequential(Probe(), nn.Linear(8, _HIDDEN), nn.Tanh(), nn.Linear(_HIDDEN, _OUT)), Probe


def _wrap(torch, layout: str, model, probe_type, device: str):
    if layout == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model.to(device))
    if layout == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        return FullyShardedDataParallel(model.to(device), auto_wrap_policy=ModuleWrapPolicy({probe_type}),
                                        device_id=torch.device(device))  # None means "an accelerator"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    model = model.to(device)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _scaler(torch, name: str, params: dict, device: str):
    if name == "torch":
        return torch.amp.GradScaler(device, **params)
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    return ShardedGradScaler(device, **params)


def _local(tensor):
    """The rank's own part of a tensor: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _poison_after_reduce(model) -> None:
    """inf into element 0 of the first local gradient that has one (the rank's shard under FSDP)."""
    for param in model.parameters():
        if param.grad is not None and _local(param.grad).numel():
            _local(param.grad).view(-1)[0] = float("inf")
            return


def _probe_index(inject: str, rank: int):
    return {"grad_before_reduce": 0, "shard": rank}.get(inject)


def _audit(scaler, optimizer):
    """The loop under fpemu.audit_torch, on every rank (its distributed checks gather across ranks)."""
    from fpemu.audits import audit_torch
    return audit_torch(scaler, optimizer)


@dataclasses.dataclass(frozen=True)
class _Rig:
    """One rank's model, its wrapped form, the optimizer (``calls`` counts its real steps), the scaler
    and this rank's data."""

    probe: object
    wrapped: object
    optimizer: object
    scaler: object
    calls: list
    data: object


def _rig(torch, case: dict, rank: int, device: str) -> _Rig:
    model, probe_type = _model(torch, torch.distributed.get_world_size())
    probe = model[0]  # before wrapping: FSDP1's auto-wrap puts its own module in that slot
    wrapped = _wrap(torch, case["layout"], model, probe_type, device)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.05)
    calls = []
    real_step = optimizer.step
    optimizer.step = lambda *args, **kwargs: (calls.append(True), real_step(*args, **kwargs))[1]
    scaler = _scaler(torch, case["scaler"], case["params"], device)
    return _Rig(probe, wrapped, optimizer, scaler, calls, torch.Generator().manual_seed(1000 + rank))


def _run_case(torch, case: dict, rank: int, device: str) -> RankRecord:
    """Drive one case on this rank (every rank runs the same collectives unless the scaler lets them part)."""
    rig = _rig(torch, case, rank, device)
    record = RankRecord(rank, [], [], [], [], [], 0.0, [])
    with _audit(rig.scaler, rig.optimizer) if case.get("audit") else contextlib.nullcontext() as audit:
        for bad in case["overflow"][rank]:
            _step(torch, case, rank, device, rig, bad, record)
    final = torch.cat([_local(p.detach()).reshape(-1).double().cpu() for p in rig.wrapped.parameters()])
    findings = tuple((f.kind, f.step) for f in audit.findings) if audit is not None else ()
    return dataclasses.replace(record, final_scale=float(rig.scaler._scale.item()), final_params=final.tolist(),
                               findings=findings)


def _step(torch, case: dict, rank: int, device: str, rig: _Rig, bad: bool, record: RankRecord) -> None:
    """One training step, the inf injected where the case says when ``bad``; appends to ``record``."""
    x, y = torch.randn(4, 8, generator=rig.data).to(device), torch.randn(4, _OUT, generator=rig.data).to(device)
    rig.probe.poison = _probe_index(case["inject"], rank) if bad else None
    rig.optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(rig.wrapped(x), y)
    if bad and case["inject"] == "loss":
        loss = loss * float("inf")
    scaled = rig.scaler.scale(loss)
    record.scales.append(float(rig.scaler._scale.item()))
    scaled.backward()
    if bad and case["inject"] == "grad_after_reduce":
        _poison_after_reduce(rig.wrapped)
    before = len(rig.calls)
    rig.scaler.step(rig.optimizer)
    found = sum(float(v.item()) for v in rig.scaler._found_inf_per_device(rig.optimizer).values())
    rig.scaler.update()
    record.found_inf.append(found > 0)
    record.applied.append(len(rig.calls) > before)
    record.growth_tracker.append(int(rig.scaler._growth_tracker.item()))
    local = [_local(p.detach()).reshape(-1).double().cpu() for p in rig.wrapped.parameters()]
    record.checksums.append(float(torch.cat(local).sum()))
    if case.get("step_keyed_collective") and len(rig.calls) > before and len(rig.calls) % _SYNC_EVERY == 0:
        # As periodic-sync optimizers do: a collective every N updates, counted by this rank alone.
        torch.distributed.all_reduce(torch.zeros(_SYNC_SIZE, device=device))


def _rank_main(rank: int, world_size: int, init_file: str, backend: str, device: str, cases: list,
               results, timeout_s: float, log: str) -> None:
    """A rank: one process group for every case, a barrier between cases."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 2)  # the C++ side's last words (gloo's abort) land here, for the parent to read
    if faulthandler.is_enabled():  # (pytest enables it on a copy of the old stderr): its dumps go here too
        faulthandler.enable(file=descriptor)  # a descriptor: sys.stderr may be a capture without one
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # ranks share the machine's cores
    code = 0
    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        dist.barrier()
        results.put(("ready", -1, rank, None))  # the case clock starts once every rank is in the group
        for index, case in enumerate(cases):
            dist.barrier()
            started = time.perf_counter()
            try:
                record = _run_case(torch, case, rank, device)
            except Exception as error:  # noqa: BLE001 -- reported as the case's result
                results.put(("error", index, rank, f"{type(error).__name__}: {_first_line(str(error))}"))
                code = 1
                return  # the group may be broken: the parent relaunches the cases after this one
            results.put(("done", index, rank, (record, time.perf_counter() - started)))
        dist.barrier()  # before destroy: without it one SIGABRT at exit in ~30 launches
        dist.destroy_process_group()
    except Exception as error:  # noqa: BLE001 -- a rendezvous or barrier failure
        results.put(("error", -1, rank, f"{type(error).__name__}: {_first_line(str(error))}"))
        code = 1
    finally:
        results.close()
        results.join_thread()  # flush the queue's feeder thread before leaving
        os._exit(code)  # no atexit handlers of the parent (pytest, ...) in a forked child


def _first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:300]


# --- the launcher --------------------------------------------------------------------------


def _rendezvous_file(folder: str) -> str:
    # The store creates it: a fresh name per launch, no port to collide on between parallel CI jobs.
    return os.path.join(folder, "rendezvous")


def _last_words(log: str) -> str:
    """What a dead rank's C++ side said last: gloo's 'what():' line, else its last line."""
    try:
        with open(log, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return ""
    said = [line.partition("what():")[2].strip() for line in lines if "what():" in line]
    return (said or lines or [""])[-1][:300]


class _Group:
    """The ranks of one launch (forked, or spawned from a parent holding a process group) and the queue they report on."""

    def __init__(self, cases, world_size: int, device: str, case_timeout_s: float, folder: str):
        import multiprocessing
        import torch.distributed as dist
        # Forking is 2-3x faster than spawning, but a fork of a process that holds a process group (the
        # world of one ShardedGradScaler needs, or the user's own) inherits it: its ranks could neither
        # make their own default group nor destroy the inherited one (a gloo destructor deadlocks after
        # fork).  Such a parent spawns fresh ranks instead.
        ctx = multiprocessing.get_context("spawn" if dist.is_available() and dist.is_initialized() else "fork")
        self.results = ctx.Queue()
        self.logs = [os.path.join(folder, f"rank{rank}.log") for rank in range(world_size)]
        backend = "nccl" if device == "cuda" else "gloo"
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(rank, world_size, _rendezvous_file(folder), backend, device, cases,
                                        self.results, case_timeout_s, self.logs[rank]))
                      for rank in range(world_size)]
        for proc in self.procs:
            proc.start()

    def next_message(self):
        try:
            return self.results.get(timeout=0.2)
        except queue_errors.Empty:
            return None

    def dead(self) -> list:
        return [rank for rank, proc in enumerate(self.procs) if proc.exitcode not in (None, 0)]

    def failure(self, first: Optional[tuple]) -> str:
        """The case's error: the first rank's (rank, report), then every other rank's (after a short
        grace, as a rank's abort takes its peers down with it), then the last words of ranks that died."""
        deadline, reports = time.perf_counter() + 1.0, dict([first] if first else [])
        while time.perf_counter() < deadline:
            message = self.next_message()
            if message is not None and message[0] == "error":
                reports.setdefault(message[2], message[3])
        lines = [f"rank {rank}: {text}" for rank, text in reports.items()]
        for rank in (r for r in self.dead() if r not in reports):
            words = _last_words(self.logs[rank])
            lines.append(f"rank {rank} died (exit code {self.procs[rank].exitcode})" + (f": {words}" if words else ""))
        return "; ".join(lines)

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        self.results.close()


def _launch(cases: list, world_size: int, device: str, case_timeout_s: float) -> list:
    """Run ``cases`` in one fresh process group until one fails; returns their CaseResults so far."""
    out, pending, ready = [], {}, set()
    with tempfile.TemporaryDirectory(prefix="fpemu-ranks-") as folder:
        group = _Group(cases, world_size, device, case_timeout_s, folder)
        started = time.perf_counter()
        try:
            while len(out) < len(cases):
                message = group.next_message()
                error = None
                limit = case_timeout_s if len(ready) == world_size else _JOIN_TIMEOUT_S
                if message is not None and message[0] == "error":
                    error = group.failure((message[2], message[3]))
                elif message is not None and message[0] == "ready":
                    ready.add(message[2])
                    started = time.perf_counter()
                elif message is not None:
                    pending.setdefault(message[1], {})[message[2]] = message[3]
                elif group.dead():
                    error = group.failure(None)
                elif time.perf_counter() - started > limit:
                    error = (f"timeout: no result within {limit:g} s (a hang: the ranks wait in different "
                             "collectives)" if len(ready) == world_size else
                             f"timeout: the ranks did not join the process group within {limit:g} s")
                if error is not None:
                    out.append(CaseResult((), error, time.perf_counter() - started))
                    break
                if len(pending.get(len(out), {})) == world_size:
                    records = pending.pop(len(out))
                    seconds = max(s for _, s in records.values())
                    out.append(CaseResult(tuple(records[r][0] for r in range(world_size)), None, seconds))
                    started = time.perf_counter()
        finally:
            group.close()
    return out


def unavailable(world_size: int, device: str) -> Optional[str]:
    """Why ``world_size`` ranks cannot run on ``device`` here (NCCL needs a GPU per rank), or None."""
    if device != "cuda":
        return None
    import torch
    count = torch.cuda.device_count()
    return None if count >= world_size else f"{world_size} ranks need {world_size} GPUs (NCCL); this machine has {count}"


def run_cases(cases: list, world_size: int, device: str = "cpu", case_timeout_s: float = 60.0) -> list:
    """Run every case of one world size; one :class:`CaseResult` per case, in order.

    Args:
      cases: dicts with ``layout``, ``scaler``, ``params``, ``inject``, ``overflow`` (per rank, per
        step) and optionally ``step_keyed_collective`` and ``audit`` (run the loop under
        fpemu.audit_torch: each RankRecord's ``findings`` holds its (kind, step)s).
      world_size: the number of ranks (processes).
      device: ``cpu`` (gloo) or ``cuda`` (NCCL, a GPU per rank).
      case_timeout_s: a case with no result by then is a hang: the group is killed and the next
        cases run in a fresh one.

    Example::

        [result] = run_cases([{"layout": "ddp", "scaler": "torch", "params": {}, "inject": "loss",
                               "overflow": [[False, True], [False, False]]}], world_size=2)
        [r.applied for r in result.ranks]     # [[True, False], [True, False]]
    """
    out = []
    while len(out) < len(cases):
        out += _launch(cases[len(out):], world_size, device, case_timeout_s)
    return out
