"""Real multi-rank loss scaling on torch.distributed: DDP, FSDP1, FSDP2, DeepSpeed ZeRO 1/2 and
megatron-core, each rank a process.

:func:`run_cases` forks ``world_size`` processes that join one process group (gloo on the
CPU, NCCL on CUDA) through a ``file://`` rendezvous and run every case of the batch in it,
with a barrier between cases (cheaper than a launch per case: see reports/bench_ranks.md).
Each rank builds the same model (a probe, Linear(8, 16), Tanh, Linear(16, 4), SGD), runs it in
the case's layout (fpemu.ranks.LAYOUTS: a torch wrapper and scaler, ``deepspeed.initialize``
with ZeRO, or megatron-core's Float16OptimizerWithFloat16Params in torch DDP), drives the real
scaler for the case's steps and injects the case's non-finite value at its point
(fpemu.ranks.INJECTIONS), recording per step the scale used, its found-inf as its scaler saw it
(after its reduction), whether the update ran, the growth tracker and a checksum of its local
parameters, and once the scaler's parameters as the real object holds them.  With
``model_parallel`` the layouts that take groups run on real data- and model-parallel subgroups.

A case that crashes a rank (gloo aborts a collective mismatch) or hangs (NCCL does) is one
:class:`CaseResult` with its error: the parent kills the group, and the cases after it run in a
fresh one.  The frameworks are imported in the functions that need them (and, for forked ranks,
once in the parent before forking: see ``_PRELOAD``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import importlib
import os
import queue as queue_errors
import tempfile
import time
import warnings
from datetime import timedelta
from typing import Optional

_HIDDEN, _OUT = 16, 4
_JOIN_TIMEOUT_S = 180.0  # forking and joining the group: slow on a loaded machine, never a hang of the case
# A case's default timeout: a base for a fresh group's first case (its lazy initialisation took up to
# 21 s under a load average of 12) plus a cost per step and rank.  Measured on 2 shared cores at a load
# average of 5-8 (torch 2.13.0, gloo): DDP 8-11 ms a step at 2 ranks and 23 ms at 4, FSDP2 24 ms at 2,
# FSDP1 78 ms at 4, so up to 20 ms a step and rank; 50 ms leaves 2.5x.  A healthy 8,000-step DDP case
# (131 s reported) gets 60 + 0.05 * 8,000 * 2 = 860 s at 2 ranks, where a fixed 60 s called it a hang.
CASE_TIMEOUT_BASE_S, CASE_TIMEOUT_PER_RANK_STEP_S = 60.0, 0.05
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
    scaler_params: dict = dataclasses.field(default_factory=dict)
    recorded: object = None  # the fpemu.record_torch trace of a case run with ``record``
    overrides: tuple = ()  # what the run answered differently from the framework's view of this machine
    sub_scales: list = dataclasses.field(default_factory=list)  # ``chained``: per step, each sub-scaler's scale


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


def _model(torch, world_size: int, seed: int = 0):
    """Probe + Linear + Tanh + Linear, the same on every rank of a data-parallel group (seeded by the
    rank's model-parallel index: each model-parallel rank holds another slice)."""
    nn = torch.nn

    class Poison(torch.autograd.Function):
        """Forward adds nothing; backward writes inf into one element of the probe's gradient, before any
        hook of DDP or FSDP sees it (so the gradient reduction carries it)."""

        @staticmethod
        def forward(ctx, weight, index):
            ctx.index, ctx.shape, ctx.device, ctx.dtype = index, weight.shape, weight.device, weight.dtype
            return weight.sum() * 0.0

        @staticmethod
        def backward(ctx, _upstream):
            grad = torch.zeros(ctx.shape, device=ctx.device, dtype=ctx.dtype)  # fp16 under DeepSpeed
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

    torch.manual_seed(seed)
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


def _batch(torch, generator, device: str, dtype):
    return (torch.randn(4, 8, generator=generator).to(device, dtype),
            torch.randn(4, _OUT, generator=generator).to(device))


class _TorchRig:
    """One rank's model in a torch wrapper (DDP, FSDP1, FSDP2), SGD (``calls`` counts its real steps) and a
    torch scaler."""

    def __init__(self, torch, case: dict, rank: int, device: str):
        model, probe_type = _model(torch, torch.distributed.get_world_size())
        self.torch, self.case, self.rank, self.device = torch, case, rank, device
        self.probe = model[0]  # before wrapping: FSDP1's auto-wrap puts its own module in that slot
        self.wrapped = _wrap(torch, case["layout"], model, probe_type, device)
        self.optimizer = torch.optim.SGD(self.wrapped.parameters(), lr=0.05)
        self.calls = []
        real_step = self.optimizer.step
        self.optimizer.step = lambda *args, **kwargs: (self.calls.append(True), real_step(*args, **kwargs))[1]
        self.scaler = _scaler(torch, case["scaler"], case["params"], device)
        self.data = torch.Generator().manual_seed(1000 + rank)
        from fpemu.recorders.grad_scaler import grad_scaler_params
        self.read_back = grad_scaler_params(self.scaler)

    def running(self):
        """The context the case's steps run in: fpemu.record_torch or fpemu.audit_torch when the case asks."""
        if self.case.get("record"):
            from fpemu.recorders.torch_run import record_torch
            return record_torch(self.scaler, self.optimizer, statistics=False, name=f"rank{self.rank}")
        return _audit(self.scaler, self.optimizer) if self.case.get("audit") else contextlib.nullcontext()

    def scale(self) -> float:
        return float(self.scaler._scale.item())

    def step(self, bad: bool) -> tuple:
        """One training step, the inf injected where the case says when ``bad``; (scale used, found-inf,
        applied, growth tracker)."""
        torch, case = self.torch, self.case
        x, y = _batch(torch, self.data, self.device, torch.float32)
        self.probe.poison = _probe_index(case["inject"], self.rank) if bad else None
        self.optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(self.wrapped(x), y)
        if bad and case["inject"] == "loss":
            loss = loss * float("inf")
        scaled = self.scaler.scale(loss)  # the scale exists from the first call on (GradScaler is lazy)
        scale = self.scale()
        scaled.backward()
        if bad and case["inject"] == "grad_after_reduce":
            _poison_after_reduce(self.wrapped)
        before = len(self.calls)
        self.scaler.step(self.optimizer)
        found = sum(float(v.item()) for v in self.scaler._found_inf_per_device(self.optimizer).values())
        self.scaler.update()
        applied = len(self.calls) > before
        if case.get("step_keyed_collective") and applied and len(self.calls) % _SYNC_EVERY == 0:
            # As periodic-sync optimizers do: a collective every N updates, counted by this rank alone.
            torch.distributed.all_reduce(torch.zeros(_SYNC_SIZE, device=self.device))
        return scale, found > 0, applied, int(self.scaler._growth_tracker.item())

    def local_params(self) -> list:
        return [_local(p.detach()).reshape(-1).double().cpu() for p in self.wrapped.parameters()]


_HELD = []


@functools.lru_cache(maxsize=None)
def _deepspeed(rank: int) -> tuple:
    """DeepSpeed's communication on this rank's process group (already joined), without building
    deepspeed_shm_comm, and its CPU accelerator's fp16 probe answered True for the rank's life (both as
    fpemu.adapters.deepspeed_scaler does); (deepspeed, whether the probe had to be answered)."""
    from fpemu.adapters.deepspeed_scaler import _fp16_on_this_cpu
    import logging
    os.environ.setdefault("LOCAL_RANK", str(rank))  # the engine asserts that a launcher set it (torchrun does)
    import deepspeed
    import deepspeed.ops
    from deepspeed.utils import logger
    logger.setLevel(logging.WARNING)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    held = _fp16_on_this_cpu()
    overridden = held.__enter__()  # never left: the forked rank ends with its cases
    _HELD.append(held)  # (a context manager collected would leave itself, undoing the answer)
    return deepspeed, overridden


@dataclasses.dataclass(frozen=True)
class _Mpu:
    """The model-parallel unit DeepSpeed's ``mpu`` argument reads (Megatron's parallel_state names), over
    real torch.distributed subgroups (fpemu.ranks.group_members)."""

    data_group: object
    data_ranks: tuple
    model_group: object
    model_ranks: tuple

    def get_data_parallel_group(self):
        return self.data_group

    def get_data_parallel_group_ranks(self):
        return list(self.data_ranks)

    def get_data_parallel_world_size(self):
        return len(self.data_ranks)

    def get_data_parallel_rank(self):
        return self.data_ranks.index(_dist_rank())

    def get_model_parallel_group(self):
        return self.model_group

    def get_model_parallel_world_size(self):
        return len(self.model_ranks)

    def get_model_parallel_rank(self):
        return self.model_ranks.index(_dist_rank())


def _dist_rank() -> int:
    import torch.distributed as dist
    return dist.get_rank()


_SUBGROUPS = {}  # (kind, ranks) -> the process group, made once per process (every rank makes every group)


def _subgroups(torch, world: int, model_parallel: int, kind: str) -> dict:
    """rank -> (its group of ``kind``, that group's ranks); every rank creates every group, in one order."""
    from fpemu.ranks import group_members
    out = {}
    for ranks in group_members(world, model_parallel, kind):
        key = (kind, tuple(ranks))
        if key not in _SUBGROUPS:
            _SUBGROUPS[key] = torch.distributed.new_group(list(ranks))
        out.update({rank: (_SUBGROUPS[key], tuple(ranks)) for rank in ranks})
    return out


def _mpu(torch, case: dict, rank: int) -> Optional[_Mpu]:
    """The case's data- and model-parallel groups as an mpu (None for pure data parallelism with the
    framework's own groups).  ``reduce_over`` without ``mp``: the model-parallel group handed over is the
    rank alone, so DeepSpeed skips that collective (it all-reduces only over a group of several ranks)."""
    from fpemu.ranks.model import DP, MP
    model_parallel, over = case.get("model_parallel", 1), case.get("reduce_over")
    if model_parallel == 1 and over is None:
        return None
    world = torch.distributed.get_world_size()
    data = _subgroups(torch, world, model_parallel, DP)[rank]
    model = _subgroups(torch, world, model_parallel if over is None or MP in over else 1, MP)[rank]
    return _Mpu(*data, *model)


def _zero_partition(optimizer):
    """The first non-empty gradient of the rank's partition, as ZeRO's overflow check reads it
    (``averaged_gradients``: a list per group, or one compact flat buffer)."""
    for grads in optimizer.averaged_gradients.values():
        for grad in [grads] if hasattr(grads, "view") else grads or ():
            if grad is not None and grad.numel():
                return grad
    raise RuntimeError("ZeRO holds no gradient partition on this rank after backward")


# What a real run had to answer differently from the framework's own view of this machine (kept in the
# rank's trace metadata, ``ranks.overrides``).
_FP16_PROBE = ("DeepSpeed's CPU accelerator.is_fp16_supported() answered True (this CPU's oneDNN has no fp16 "
               "kernels; torch computes fp16 anyway)")
_MEGATRON_CPU = ("megatron-core on the CPU: a CPU tensor's type() named as its CUDA twin while the optimizer is "
                 "built, device='cuda' allocations moved to the CPU")


class _ZeroRig:
    """One rank's model under ``deepspeed.initialize`` (fp16, ZeRO stage 1 or 2, torch SGD).

    The scaled gradients are fp16, so the case's scale must leave them finite (a scale of 2^16 on a
    gradient of 1.0 is 65536, above fp16's 65504: ZeRO then skips step 0 on every rank, as a world of
    one does; that is a real overflow, not a cross-rank effect)."""

    def __init__(self, torch, case: dict, rank: int, device: str):
        from fpemu.adapters.deepspeed_scaler import _engine_config, _stable_counter, loss_scaler_read_back
        from fpemu.ranks import LAYOUTS
        deepspeed, overridden = _deepspeed(rank)
        self.torch, self.case, self.rank, self.device, self.counter = torch, case, rank, device, _stable_counter
        self.overrides = (_FP16_PROBE,) if overridden else ()
        world, mpu = torch.distributed.get_world_size(), _mpu(torch, case, rank)
        model, _ = _model(torch, world, rank % case.get("model_parallel", 1))
        self.probe = model[0]
        config = {"train_batch_size": mpu.get_data_parallel_world_size() if mpu else world,
                  "fp16": {"enabled": True, **_engine_config("deepspeed", case["params"])},
                  "zero_optimization": {"stage": LAYOUTS[case["layout"]].zero_stage},
                  "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0}
        # The engine copies an mpu into deepspeed.utils.groups.mpu and never clears it (0.19.8, engine.py
        # _configure_distributed_model), so an engine built after one with an mpu would take the old groups:
        # each case's engine starts from its own, as one per process would.
        deepspeed.utils.groups.mpu = mpu
        self.wrapped, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
                                                config=config, mpu=mpu)
        self.data = torch.Generator().manual_seed(1000 + rank)
        self.read_back = loss_scaler_read_back(self.wrapped.optimizer.loss_scaler, "deepspeed")

    def running(self):
        return contextlib.nullcontext()

    def scale(self) -> float:
        return float(self.wrapped.optimizer.loss_scale)

    def step(self, bad: bool) -> tuple:
        torch, case, engine = self.torch, self.case, self.wrapped
        scale = self.scale()
        x, y = _batch(torch, self.data, self.device, torch.float16)
        self.probe.poison = _probe_index(case["inject"], self.rank) if bad else None
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        if bad and case["inject"] == "loss":
            loss = loss * float("inf")
        engine.backward(loss)  # the gradient reduction; the rank's partition is in averaged_gradients after it
        if bad and case["inject"] == "grad_after_reduce":
            _zero_partition(engine.optimizer).view(-1)[0] = float("inf")
        engine.step()
        scaler = engine.optimizer.loss_scaler
        return (scale, bool(engine.optimizer.overflow), engine.was_step_applied(),
                self.counter(scaler.cur_iter, scaler.last_overflow_iter, scaler.scale_window))

    def local_params(self) -> list:
        return [p.detach().reshape(-1).double().cpu() for p in self.wrapped.module.parameters()]


class _MegatronRig:
    """One rank's fp16 model in torch DDP over its data-parallel group, megatron-core's
    Float16OptimizerWithFloat16Params and DynamicGradScaler (built on the CPU under the adapter's modes:
    fpemu.adapters.megatron_scaler), its found-inf all-reduced (MAX) over ``grad_stats_parallel_group``,
    which get_megatron_optimizer sets to the model-parallel group for the non-distributed optimizer."""

    def __init__(self, torch, case: dict, rank: int, device: str):
        from megatron.core.optimizer import OptimizerConfig
        from megatron.core.optimizer.grad_scaler import DynamicGradScaler
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params
        from fpemu.adapters.megatron_scaler import _cuda_typed, _on_device, read_back
        from fpemu.ranks.model import DP, MP
        from fpemu.scalers.profiles import get_profile
        self.torch, self.case, self.rank, self.device = torch, case, rank, device
        self.overrides = (_MEGATRON_CPU,) if device == "cpu" else ()
        world, model_parallel = torch.distributed.get_world_size(), case.get("model_parallel", 1)
        data = _subgroups(torch, world, model_parallel, DP)[rank]
        grad_stats = _subgroups(torch, world, model_parallel, MP)[rank]
        model, _ = _model(torch, world, rank % model_parallel)
        self.probe = model[0]
        model = model.to(device).half()
        self.wrapped = model
        if len(data[1]) > 1:
            from torch.nn.parallel import DistributedDataParallel
            self.wrapped = DistributedDataParallel(model, process_group=data[0])
        self.cpu = _on_device(device)  # megatron allocates its found_inf and scale with device='cuda'
        config = OptimizerConfig(fp16=True, lr=0.05, clip_grad=0.0)
        # ``chained``: the probe and the rest in two sub-optimizers of a ChainedOptimizer, each with its own
        # grad scaler (as megatron chains dense and expert parameters)
        params = list(self.wrapped.parameters())
        parts = [params[:1], params[1:]] if case.get("chained") else [params]
        subs = []
        with self.cpu, _cuda_typed():
            for part in parts:
                scaler = DynamicGradScaler(**{**get_profile("megatron").defaults, **case["params"]})
                subs.append(Float16OptimizerWithFloat16Params(torch.optim.SGD(part, lr=0.05), config, scaler,
                                                              lambda *_: None))
                subs[-1].grad_stats_parallel_group = grad_stats[0]
                # the chain's grad norm asks which parameters are tensor-parallel duplicates: the explicit
                # tp_group (megatron's pg_collection path), here the model-parallel group, else parallel_state
                subs[-1].tp_group = grad_stats[0]
        if case.get("chained"):
            from megatron.core.optimizer.optimizer import ChainedOptimizer
            self.optimizer = ChainedOptimizer(subs)
        else:
            self.optimizer = subs[0]
        self.subs, self.scaler = subs, subs[0].grad_scaler  # get_loss_scale() is the first sub-optimizer's
        self.sub_scales = []  # per step, each sub-optimizer's scale after it
        self.data = torch.Generator().manual_seed(1000 + rank)
        self.read_back = read_back(self.scaler)

    def running(self):
        return contextlib.nullcontext()

    def scale(self) -> float:
        return float(self.scaler.scale.item())

    def step(self, bad: bool) -> tuple:
        torch, case = self.torch, self.case
        scale = self.scale()
        x, y = _batch(torch, self.data, self.device, torch.float16)
        self.probe.poison = _probe_index(case["inject"], self.rank) if bad else None
        self.optimizer.zero_grad()
        with self.cpu:
            loss = torch.nn.functional.mse_loss(self.wrapped(x).float(), y)
            if bad and case["inject"] == "loss":
                loss = loss * float("inf")
            (loss * self.optimizer.get_loss_scale()).backward()
            if bad and case["inject"] == "grad_after_reduce":
                _poison_after_reduce(self.wrapped)  # the model's fp16 gradient, which prepare_grads copies to main
            applied, _, _ = self.optimizer.step()
        self.sub_scales.append([float(sub.grad_scaler.scale.item()) for sub in self.subs])
        found = any(sub.found_inf.item() > 0 for sub in self.subs)
        return scale, found, bool(applied), int(self.scaler._growth_tracker)

    def local_params(self) -> list:
        return [p.detach().reshape(-1).double().cpu() for p in self.wrapped.parameters()]


_RIGS = {"torch": _TorchRig, "deepspeed": _ZeroRig, "megatron": _MegatronRig}  # fpemu.ranks.Layout.engine


def _rig(torch, case: dict, rank: int, device: str):
    from fpemu.ranks import LAYOUTS
    return _RIGS[LAYOUTS[case["layout"]].engine](torch, case, rank, device)


def _run_case(torch, case: dict, rank: int, device: str) -> RankRecord:
    """Drive one case on this rank (every rank runs the same collectives unless the scaler lets them part)."""
    rig = _rig(torch, case, rank, device)
    record = RankRecord(rank, [], [], [], [], [], 0.0, [], scaler_params=rig.read_back)
    with rig.running() as watcher:
        for bad in case["overflow"][rank]:
            scale, found, applied, growth = rig.step(bad)
            record.scales.append(scale)
            record.found_inf.append(found)
            record.applied.append(applied)
            record.growth_tracker.append(growth)
            record.checksums.append(float(torch.cat(rig.local_params()).sum()))
    audit = getattr(watcher, "audit", watcher)  # a recorder holds the audit that watched the run
    findings = tuple((f.kind, f.step) for f in audit.findings) if audit is not None else ()
    return dataclasses.replace(record, final_scale=rig.scale(), final_params=torch.cat(rig.local_params()).tolist(),
                               findings=findings, recorded=getattr(watcher, "trace", None),
                               sub_scales=getattr(rig, "sub_scales", []), overrides=getattr(rig, "overrides", ()))


def _rank_main(rank: int, world_size: int, join, backend: str, device: str, cases: list,
               results, timeout_s: float, log: str) -> None:
    """A rank: one process group for every case, a barrier between cases.  ``join`` forms the world (the
    built-in launcher's ``file://`` rendezvous, or torchrun's store: :class:`EnvWorld`); ``results`` is
    the queue the rank reports on (a multiprocessing queue, or the store under torchrun).  Everything after
    joining is the same for both launchers."""
    descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(descriptor, 2)  # the C++ side's last words (gloo's abort) land here, for the parent to read
    os.dup2(descriptor, 1)  # and what a framework prints (DeepSpeed logs to stdout), not into the parent's output
    if faulthandler.is_enabled():  # (pytest enables it on a copy of the old stderr): its dumps go here too
        faulthandler.enable(file=descriptor)  # a descriptor: sys.stderr may be a capture without one
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)  # ranks share the machine's cores
    code = 0
    try:
        if device == "cuda":
            torch.cuda.set_device(join.gpu(torch, rank))
        join.init(dist, backend, rank, world_size, timedelta(seconds=timeout_s))
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


@dataclasses.dataclass(frozen=True)
class _FileJoin:
    """The built-in launcher's world: a ``file://`` rendezvous in the launch's folder (the store creates
    it: a fresh name per launch, no port to collide on between parallel CI jobs), a GPU per rank."""

    path: str

    def init(self, dist, backend: str, rank: int, world_size: int, timeout) -> None:
        dist.init_process_group(backend, init_method=f"file://{self.path}", rank=rank, world_size=world_size,
                                timeout=timeout)

    @staticmethod
    def gpu(torch, rank: int) -> int:
        return rank % torch.cuda.device_count()


def _last_words(log: str) -> str:
    """What a dead rank's C++ side said last: gloo's 'what():' line, else its last line."""
    try:
        with open(log, encoding="utf-8", errors="replace") as handle:
            lines = [line.strip() for line in handle if line.strip()]
    except OSError:
        return ""
    said = [line.partition("what():")[2].strip() for line in lines if "what():" in line]
    return (said or lines or [""])[-1][:300]


# Imported lazily by the first case on every rank at once (seconds each, measured on torch 2.13,
# DeepSpeed 0.19.8 and megatron-core 0.16.1): torch.optim's first optimizer imports torch._dynamo;
# deepspeed.initialize's ZeRO sanity check imports its Muon optimizer, which calls torch.compile.
# Imported before forking, the ranks inherit them.  Keyed by the layouts' packages.
_PRELOAD = {"torch": ("torch._dynamo",),
            "deepspeed": ("deepspeed", "deepspeed.runtime.zero.stage_1_and_2",
                          "deepspeed.runtime.zero.muon.muon_optimizer"),
            "megatron-core": ("megatron.core.optimizer.optimizer",)}


def _preload(cases) -> None:
    """Import here, before forking, what the cases' first steps would import on every rank."""
    from fpemu.ranks import LAYOUTS
    needs = sorted({package for case in cases for package in LAYOUTS[case["layout"]].packages})
    for module in (name for need in needs for name in _PRELOAD[need]):
        # A version without that module: the rank imports what it needs.  Import-time notices (megatron's
        # 'Transformer Engine and Apex are not installed') would reach the user's console here, not a rank's log.
        with contextlib.suppress(ImportError), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            importlib.import_module(module)


def _start_rank(ctx, rank: int, world_size: int, join, device: str, cases: list, results, group_timeout_s: float,
                log: str):
    backend = "nccl" if device == "cuda" else "gloo"
    proc = ctx.Process(target=_rank_main, daemon=True,
                       args=(rank, world_size, join, backend, device, cases, results, group_timeout_s, log))
    proc.start()
    return proc


def _context(cases):
    import multiprocessing
    import torch.distributed as dist
    # Forking is 2-3x faster than spawning, but a fork of a process that holds a process group (the
    # world of one ShardedGradScaler needs, or the user's own) inherits it: its ranks could neither
    # make their own default group nor destroy the inherited one (a gloo destructor deadlocks after
    # fork).  Such a parent spawns fresh ranks instead.
    ctx = multiprocessing.get_context("spawn" if dist.is_available() and dist.is_initialized() else "fork")
    if ctx.get_start_method() == "fork":
        _preload(cases)
    return ctx


class _Group:
    """The ranks of one launch (forked, or spawned from a parent holding a process group) and the queue they report on."""

    def __init__(self, cases, world_size: int, device: str, group_timeout_s: float, folder: str):
        ctx = _context(cases)
        self.results = ctx.Queue()
        self.logs = [os.path.join(folder, f"rank{rank}.log") for rank in range(world_size)]
        join = _FileJoin(os.path.join(folder, "rendezvous"))
        self.procs = [_start_rank(ctx, rank, world_size, join, device, cases, self.results, group_timeout_s,
                                  self.logs[rank]) for rank in range(world_size)]

    def next_message(self):
        try:
            return self.results.get(timeout=0.2)
        except queue_errors.Empty:
            return None

    def dead(self) -> list:
        return [rank for rank, proc in enumerate(self.procs) if proc.exitcode not in (None, 0)]

    def death(self, rank: int) -> tuple:
        """(exit code, last words) of a rank that died."""
        return self.procs[rank].exitcode, _last_words(self.logs[rank])

    def failure(self, reports: dict) -> str:
        """The case's error: every rank's report (``{rank: text}``, in the order they came), then the last words
        of ranks that died without one."""
        lines = [f"rank {rank}: {text}" for rank, text in reports.items()]
        for rank in (r for r in self.dead() if r not in reports):
            code, words = self.death(rank)
            lines.append(f"rank {rank} died (exit code {code})" + (f": {words}" if words else ""))
        return "; ".join(lines)

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        self.results.close()


def _launch(cases: list, world_size: int, device: str, timeouts: list, group_type=_Group) -> list:
    """Run ``cases`` in one fresh process group until one fails (each within its entry of ``timeouts``);
    returns their CaseResults so far.  ``group_type(cases, world_size, device, group timeout, folder)``
    starts the ranks: :class:`_Group` forks them all here, a torchrun world's starts this rank's
    (:meth:`EnvWorld.group`)."""
    out, pending, ready = [], {}, set()
    with tempfile.TemporaryDirectory(prefix="fpemu-ranks-") as folder:
        # The group's own timeout bounds joining and every collective: never under the join's, and the
        # parent, not gloo, tells a case's hang by its own limit.
        group = group_type(cases, world_size, device, _group_timeout(timeouts), folder)
        started = time.perf_counter()
        try:
            while len(out) < len(cases):
                message = group.next_message()
                reports, failed, timed_out = {}, False, None
                limit = timeouts[len(out)] if len(ready) == world_size else _JOIN_TIMEOUT_S
                if message is not None and message[0] == "error":
                    reports[message[2]], failed = message[3], True
                elif message is not None and message[0] == "ready":
                    ready.add(message[2])
                    started = time.perf_counter()
                elif message is not None:
                    pending.setdefault(message[1], {})[message[2]] = message[3]
                elif group.dead():
                    failed = True
                elif time.perf_counter() - started > limit:
                    timed_out = (f"timeout: no result within {limit:g} s (a hang: the ranks wait in different "
                                 "collectives)" if len(ready) == world_size else
                                 f"timeout: the ranks did not join the process group within {limit:g} s")
                    failed = True
                if failed:
                    _collect_in_flight(group, pending, reports)
                    started = _complete(out, pending, world_size, started)
                    if len(out) < len(cases):  # the failure is the first case some rank did not finish
                        error = timed_out or group.failure(reports)
                        out.append(CaseResult((), error, time.perf_counter() - started))
                    break
                started = _complete(out, pending, world_size, started)
        finally:
            group.close()
    return out


# How long results already sent are awaited once a case failed: a rank's abort takes its peers down with
# it, and a result sent before the failure may arrive after it (each rank reports on its own connection:
# under torchrun a 'done' of the case before came through the store after rank 0's own process was seen
# dead, and that case was blamed for the crash of the next).
_IN_FLIGHT_S = 2.0


def _collect_in_flight(group, pending: dict, reports: dict) -> None:
    """Read the group's messages for :data:`_IN_FLIGHT_S`: results into ``pending``, errors into ``reports``."""
    deadline = time.perf_counter() + _IN_FLIGHT_S
    while time.perf_counter() < deadline:
        message = group.next_message()
        if message is None:
            continue
        kind, index, rank, body = message
        if kind == "error":
            reports.setdefault(rank, body)
        elif kind == "done":
            pending.setdefault(index, {})[rank] = body


def _complete(out: list, pending: dict, world_size: int, started: float) -> float:
    """Append to ``out`` each next case every rank has finished; the clock of the case after them."""
    while len(pending.get(len(out), {})) == world_size:
        records = pending.pop(len(out))
        seconds = max(s for _, s in records.values())
        out.append(CaseResult(tuple(records[r][0] for r in range(world_size)), None, seconds))
        started = time.perf_counter()
    return started


def _group_timeout(timeouts: list) -> float:
    return max(_JOIN_TIMEOUT_S, *timeouts)


def default_case_timeout(steps: int, world_size: int) -> float:
    """Seconds a case of ``steps`` steps on ``world_size`` ranks may run before it counts as a hang."""
    return CASE_TIMEOUT_BASE_S + CASE_TIMEOUT_PER_RANK_STEP_S * steps * world_size


def _case_timeout(case: dict, world_size: int, override: Optional[float]) -> float:
    if override is not None:
        return override
    if case.get("timeout_s") is not None:
        return case["timeout_s"]
    return default_case_timeout(len(case["overflow"][0]), world_size)


def unavailable(world_size: int, device: str) -> Optional[str]:
    """Why ``world_size`` ranks cannot run on ``device`` here (NCCL needs a GPU per rank), or None; under
    torchrun ``world_size`` is this node's ranks (LOCAL_WORLD_SIZE)."""
    if device != "cuda":
        return None
    import torch
    count = torch.cuda.device_count()
    return None if count >= world_size else f"{world_size} ranks need {world_size} GPUs (NCCL); this machine has {count}"


def run_cases(cases: list, world_size: int, device: str = "cpu", case_timeout_s: Optional[float] = None,
              world: Optional["EnvWorld"] = None) -> Optional[list]:
    """Run every case of one world size; one :class:`CaseResult` per case, in order.

    Args:
      cases: dicts with ``layout``, ``scaler``, ``params``, ``inject``, ``overflow`` (per rank, per
        step) and optionally ``model_parallel``, ``reduce_over``, ``chained`` (megatron: a ChainedOptimizer
        of two), ``step_keyed_collective``, ``timeout_s`` (this case's ``case_timeout_s``), ``audit``
        (run the loop under fpemu.audit_torch: each RankRecord's ``findings`` holds its (kind, step)s) and ``record``
        (under fpemu.record_torch: each RankRecord's ``recorded`` is the rank's recorded trace, its
        ``findings`` the recorder's audit's).
      world_size: the number of ranks (processes).
      device: ``cpu`` (gloo) or ``cuda`` (NCCL, a GPU per rank).
      case_timeout_s: a case with no result by then is a hang: the group is killed and the next
        cases run in a fresh one.  None: each case's ``timeout_s``, else
        :func:`default_case_timeout` of its steps and the world size.
      world: None: fork ``world_size`` ranks here (a ``file://`` rendezvous).  An :class:`EnvWorld`
        (:func:`env_world`, under torchrun): this process is one rank of that world (its size must be
        ``world_size``), every rank calls ``run_cases`` with the same cases, and rank 0 gets the
        results (the others None).  Either way each rank runs the cases in a process of its own
        (:func:`_rank_main`, the same code), watched by its launcher, so a rank that crashes or
        hangs ends its case, not the run.

    Example::

        [result] = run_cases([{"layout": "ddp", "scaler": "torch", "params": {}, "inject": "loss",
                               "overflow": [[False, True], [False, False]]}], world_size=2)
        [r.applied for r in result.ranks]     # [[True, False], [True, False]]
    """
    timeouts = [_case_timeout(case, world_size, case_timeout_s) for case in cases]
    if world is not None:
        return world.run_cases(cases, world_size, device, timeouts)
    out = []
    while len(out) < len(cases):
        out += _launch(cases[len(out):], world_size, device, timeouts[len(out):])
    return out


# --- torchrun: the world of an env:// launcher --------------------------------------------

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_POLL_S = 0.05


def env_world(environ=None) -> Optional["EnvWorld"]:
    """This process's rank in a torchrun (or any env:// launcher's) world, or None when it runs alone.

    torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and
    TORCHELASTIC_RUN_ID; RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are needed (FpemuInputError,
    naming the variable, when only some are set or one is not a number)."""
    from fpemu.errors import FpemuInputError
    environ = os.environ if environ is None else environ
    present = [name for name in _ENV if name in environ]
    if not present:
        return None
    missing = [name for name in _ENV if name not in environ]
    if missing:
        raise FpemuInputError(f"environment: {', '.join(present)} set but not {', '.join(missing)}: an env:// "
                              "launcher (torchrun) sets all of them; unset them to run with the built-in launcher")
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        if name in environ:
            try:
                numbers[name] = int(environ[name])
            except ValueError:
                raise FpemuInputError(f"environment: {name}={environ[name]!r}: expected an integer") from None
    if not 0 <= numbers["RANK"] < numbers["WORLD_SIZE"]:
        raise FpemuInputError(f"environment: RANK={numbers['RANK']}: expected 0 <= RANK < WORLD_SIZE "
                              f"({numbers['WORLD_SIZE']})")
    run = f"{environ.get('TORCHELASTIC_RUN_ID', 'env')}/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return EnvWorld(numbers["RANK"], numbers["WORLD_SIZE"], numbers.get("LOCAL_RANK", numbers["RANK"]),
                    numbers.get("LOCAL_WORLD_SIZE", numbers["WORLD_SIZE"]), environ["MASTER_ADDR"],
                    numbers["MASTER_PORT"], run)


def _store_client(host: str, port: int):
    """A client of the world's TCPStore (torchrun's agent hosts it, else rank 0: :meth:`EnvWorld.store`)."""
    import torch.distributed as dist
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=_JOIN_TIMEOUT_S))


@dataclasses.dataclass(frozen=True)
class _StoreJoin:
    """A torchrun world's process group for one launch: the world's store under the launch's prefix (each
    launch, the first and those after a case that failed, a fresh group), the GPU LOCAL_RANK names."""

    host: str
    port: int
    prefix: str
    local_rank: int

    def init(self, dist, backend: str, rank: int, world_size: int, timeout) -> None:
        store = dist.PrefixStore(f"{self.prefix}/pg", _store_client(self.host, self.port))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)

    def gpu(self, torch, rank: int) -> int:
        return self.local_rank


class _StoreQueue:
    """A rank's messages (``put``, as onto the built-in launcher's queue) as keys of the world's store:
    ``PREFIX/msg/RANK/N``, read (and deleted) by rank 0's launcher in order."""

    def __init__(self, host: str, port: int, prefix: str, rank: int):
        self.host, self.port, self.prefix, self.rank, self.sent, self.store = host, port, prefix, rank, 0, None

    def put(self, message) -> None:
        import pickle
        if self.store is None:  # connected in the rank's own process, after forking
            self.store = _store_client(self.host, self.port)
        self.store.set(f"{self.prefix}/msg/{self.rank}/{self.sent}", pickle.dumps(message))
        self.sent += 1

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass


class EnvWorld:
    """One rank of a torchrun world (:func:`env_world`).

    Each rank's process (the one torchrun started) is that rank's launcher: it forks the rank's own
    process, which joins the world's process group and runs the cases as the built-in launcher's
    ranks do (:func:`_rank_main`), and watches it.  Rank 0 runs the built-in launcher's loop
    (:func:`_launch`: the per-case timeouts, a failed case ends the group and the next cases run in a
    fresh one) over every rank's messages, which come through the world's store; a rank's launcher
    reports its process's death there, and kills it when rank 0 closes the group.  The store's keys
    (``fpemu/RUN_ID/RESTART/CALL/...``): ``plan{A}`` (rank 0: launch A runs the cases from this
    index, or ``done``), ``a{A}/msg/RANK/N``, ``a{A}/dead/RANK``, ``a{A}/close``, ``a{A}/closed``.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, local_world_size: int, host: str, port: int,
                 run: str):
        self.rank, self.world_size, self.local_rank, self.local_world_size = rank, world_size, local_rank, local_world_size
        self.host, self.port, self.run = host, port, run
        self._store, self._calls = None, 0

    def __repr__(self) -> str:
        return f"EnvWorld(rank {self.rank} of {self.world_size}, store {self.host}:{self.port})"

    @property
    def store(self):
        """The world's store: torchrun's agent hosts it (TORCHELASTIC_USE_AGENT_STORE), else rank 0 does."""
        if self._store is None:
            import torch.distributed as dist
            self._store, _, _ = next(dist.rendezvous("env://", timeout=timedelta(seconds=_JOIN_TIMEOUT_S)))
        return self._store

    def _get(self, key: str):
        import pickle
        return pickle.loads(self.store.get(key))

    def _set(self, key: str, value) -> None:
        import pickle
        self.store.set(key, pickle.dumps(value))

    def _has(self, key: str) -> bool:
        return self.store.check([key])

    def exit_code(self, code: Optional[int] = None) -> int:
        """Rank 0: publishes the command's exit ``code``; the others wait for it and return it.  Every rank
        exits with rank 0's code: torchrun's agents on other nodes would otherwise wait out their exit
        barrier (300 s) for an agent whose rank failed (a divergence, exit 1) while theirs succeeded."""
        key = f"fpemu/{self.run}/exit"
        if self.rank == 0:
            self._set(key, code)
            return code
        while not self._has(key):
            time.sleep(_POLL_S)
        return self._get(key)

    def run_cases(self, cases: list, world_size: int, device: str, timeouts: list) -> Optional[list]:
        """:func:`run_cases` on this world: rank 0 leads the launches, the others follow them."""
        if world_size != self.world_size:
            raise ValueError(f"cases of {world_size} ranks in a world of {self.world_size}")
        self._calls += 1
        call = f"fpemu/{self.run}/{self._calls}"
        if self.rank != 0:
            self._follow(call, cases, device, timeouts)
            return None
        out, launch = [], 0
        try:
            while len(out) < len(cases):
                self._set(f"{call}/plan{launch}", len(out))
                group = functools.partial(_WorldGroup, world=self, prefix=f"{call}/a{launch}")
                out += _launch(cases[len(out):], world_size, device, timeouts[len(out):], group)
                launch += 1
        finally:
            self._set(f"{call}/plan{launch}", "done")
        return out

    def _follow(self, call: str, cases: list, device: str, timeouts: list) -> None:
        """A rank other than 0: each launch rank 0 plans, this rank's process, until rank 0 says done."""
        launch = 0
        while True:
            key = f"{call}/plan{launch}"
            while not self._has(key):
                time.sleep(_POLL_S)
            start = self._get(key)
            if start == "done":
                return
            prefix = f"{call}/a{launch}"
            with tempfile.TemporaryDirectory(prefix="fpemu-ranks-") as folder:
                log = os.path.join(folder, f"rank{self.rank}.log")
                proc = self._start(cases[start:], device, _group_timeout(timeouts[start:]), prefix, log)
                reported = False
                while not self._has(f"{prefix}/close"):
                    if not reported and proc.exitcode not in (None, 0):
                        self._set(f"{prefix}/dead/{self.rank}", (proc.exitcode, _last_words(log)))
                        reported = True
                    time.sleep(_POLL_S)
                if proc.is_alive():
                    proc.kill()
                proc.join(5)
                self.store.add(f"{prefix}/closed", 1)
            launch += 1

    def _start(self, cases: list, device: str, group_timeout_s: float, prefix: str, log: str):
        self.store  # noqa: B018 -- rank 0 without torchrun's agent hosts the store: before forking
        return _start_rank(_context(cases), self.rank, self.world_size,
                           _StoreJoin(self.host, self.port, prefix, self.local_rank), device, cases,
                           _StoreQueue(self.host, self.port, prefix, self.rank), group_timeout_s, log)


class _WorldGroup(_Group):
    """Rank 0's view of one launch on a torchrun world (:class:`_Group`'s interface for :func:`_launch`):
    its own rank's process here, every rank's messages and deaths through the store."""

    def __init__(self, cases, world_size: int, device: str, group_timeout_s: float, folder: str, world=None,
                 prefix: str = ""):
        self.world, self.prefix, self.world_size = world, prefix, world_size
        self.log = os.path.join(folder, f"rank{world.rank}.log")
        self.read = [0] * world_size
        self.proc = world._start(cases, device, group_timeout_s, prefix, self.log)

    def next_message(self):
        for rank in range(self.world_size):
            key = f"{self.prefix}/msg/{rank}/{self.read[rank]}"
            if self.world._has(key):
                message = self.world._get(key)
                self.world.store.delete_key(key)
                self.read[rank] += 1
                return message
        time.sleep(_POLL_S)
        return None

    def dead(self) -> list:
        return [rank for rank in range(self.world_size)
                if (self.proc.exitcode not in (None, 0) if rank == self.world.rank
                    else self.world._has(f"{self.prefix}/dead/{rank}"))]

    def death(self, rank: int) -> tuple:
        if rank == self.world.rank:
            return self.proc.exitcode, _last_words(self.log)
        return self.world._get(f"{self.prefix}/dead/{rank}")

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.world._set(f"{self.prefix}/close", True)
        deadline = time.perf_counter() + 10.0  # the other ranks' processes gone before the next launch
        while self.world.store.add(f"{self.prefix}/closed", 0) < self.world_size - 1 and time.perf_counter() < deadline:
            time.sleep(_POLL_S)
