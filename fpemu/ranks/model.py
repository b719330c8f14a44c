"""The reference model of loss scaling across ranks: who sees an overflow, how found-inf is reduced.

A multi-rank step has two collectives that matter to a loss scaler: the gradient reduction
(DDP's all-reduce, FSDP's reduce-scatter, ZeRO's reduce into partitions) over the data-parallel
group, and the found-inf reduction (none, a MAX or a SUM, over the world, the data-parallel or the
model-parallel group: :data:`GROUPS`).  Where an inf enters relative to the first, and over which
groups the second runs, decide which ranks skip.  The model:

1. ``visible_overflow``: per rank and step, whether the rank's own (reduced or sharded) gradients
   hold a non-finite value, from the layout (:data:`LAYOUTS`), the injection point
   (:data:`INJECTIONS`), the data-parallel groups and which ranks overflowed;
2. ``found_inf``: that flag after the scaler's found-inf collectives (:data:`FOUND_INF_REDUCTIONS`),
   each within its group (``reduce_found_inf``);
3. each rank's trajectory: :func:`fpemu.simulate_scaler` on its found-inf sequence (measured on
   torch 2.13, DeepSpeed 0.19.8 and megatron-core 0.16.1: each rank equals simulate_scaler on its
   found-inf sequence, and agreeing ranks on the any-rank overflow sequence);
4. :func:`cross_rank_verdict`: the first step at which ranks' scales or skips differ.

numpy only (the core); the real runs are in :mod:`fpemu.adapters.torch_ranks`.

Example:
  >>> case = RanksCase(world_size=2, layout="ddp", scaler="torch", inject="grad_after_reduce",
  ...                  overflow=((False,) * 3, (False, False, True)), params={"growth_interval": 3})
  >>> prediction = predict(case)
  >>> [t.skipped for t in prediction.traces], prediction.verdict.step, prediction.verdict.skipped
  ([[], [2]], 2, (1,))
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from fpemu.scalers import simulate_scaler

EVERY, FIRST_SHARD, OWN_SHARD = "every element", "element 0", "own shard"
MAX, SUM = "max", "sum"
# The groups a found-inf collective runs over.  With ``model_parallel`` m the world is dp x m ranks, the
# model-parallel ranks adjacent (megatron's default order): rank r is model-parallel rank r % m of
# data-parallel rank r // m.  "dp" is the ranks holding the same parameters (the gradient reduction's
# group), "mp" the ranks holding the other slices of one replica.
WORLD, DP, MP = "world", "dp", "mp"
GROUPS = (WORLD, DP, MP)


@dataclasses.dataclass(frozen=True)
class Layout:
    """A data-parallel layout: what each rank holds of the gradient after the reduction.

    Attributes:
      name: its name in specs (``[ranks] layout``).
      sharded: each rank keeps only its shard of the reduced gradient (reduce-scatter), not all of it.
      dtensor: gradients are DTensors, whose found-inf check reduces over their mesh itself.
      adapter: the fpemu.adapters.ADAPTERS row that runs it for real.
      wraps: what that run wraps the model in.
      replicas: every rank holds all parameters after the step although gradients are sharded
        (ZeRO 1/2 all-gather the updated partitions), so parameter drift between ranks is measurable.
      probe_per_rank: the probe parameter's elements fall one per rank's shard (FSDP's units); ZeRO's
        flat partitions put the whole probe in rank 0's, so the ``shard`` injection cannot be placed.
      engine: what drives a rank of the real run: ``torch`` (a torch wrapper and scaler), ``deepspeed``
        (``deepspeed.initialize``) or ``megatron`` (megatron-core's optimizer); zero_stage: DeepSpeed's.
      devices: where the real run can run (DeepSpeed is driven with its CPU accelerator only).
      groups: the real run builds data- and model-parallel subgroups (``model_parallel``, ``reduce_over``).
      packages: the distributions the real run imports; verified: the versions it was checked with
        beyond torch's.
    """

    name: str
    sharded: bool
    dtensor: bool
    adapter: str
    wraps: str
    replicas: bool = False
    probe_per_rank: bool = False
    engine: str = "torch"
    zero_stage: Optional[int] = None
    devices: tuple = ("cpu", "cuda")
    groups: bool = False
    packages: tuple = ("torch",)
    verified: tuple = ()


LAYOUTS = {layout.name: layout for layout in [
    Layout("ddp", False, False, "torch_ddp", "torch.nn.parallel.DistributedDataParallel (gradients all-reduced in backward)"),
    Layout("fsdp1", True, False, "torch_fsdp1", "torch.distributed.fsdp.FullyShardedDataParallel (reduce-scatter; a FlatParameter "
                                 "shard per rank; the probe wrapped as its own unit)", probe_per_rank=True),
    Layout("fsdp2", True, True, "torch_fsdp2",
           "torch.distributed.fsdp.fully_shard (DTensor gradients sharded on dim 0)", probe_per_rank=True),
    *(Layout(f"zero{stage}", True, False, f"deepspeed_zero{stage}_ranks",
             f"deepspeed.initialize, fp16, ZeRO stage {stage} ({what}; the updated fp16 parameters all-gathered "
             "to every rank)", replicas=True, engine="deepspeed", zero_stage=stage, devices=("cpu",), groups=True,
             packages=("deepspeed", "torch"), verified=("deepspeed 0.19.8",))
      for stage, what in ((1, "optimizer state partitioned, gradients reduced at the accumulation boundary, "
                              "each rank keeping its partition"),
                          (2, "gradients reduced into each rank's partition during backward"))),
    Layout("megatron", False, False, "megatron_ranks",
           "fp16 parameters in torch DDP over the data-parallel group (when it has several ranks), megatron-core's "
           "Float16OptimizerWithFloat16Params + DynamicGradScaler, its grad_stats_parallel_group the model-parallel "
           "group (as get_megatron_optimizer sets it for the non-distributed optimizer)", engine="megatron",
           groups=True, packages=("megatron-core", "torch"), verified=("megatron-core 0.16.1",)),
]}


@dataclasses.dataclass(frozen=True)
class Injection:
    """Where an overflowing rank's non-finite value enters its step.

    Attributes:
      name: its name in specs (``[ranks] inject``).
      reduced: the value enters before the gradient reduction, so the reduction carries it.
      lands_on: which gradient elements it makes non-finite: every element (an inf loss), element
        0 of the probe parameter (in rank 0's shard under FSDP), or the probe element in the
        overflowing rank's own shard.
      how: what the real run does.
    """

    name: str
    reduced: bool
    lands_on: str
    how: str
    needs_shards: bool = False


INJECTIONS = {injection.name: injection for injection in [
    Injection("loss", True, EVERY, "the rank's loss is multiplied by inf before backward"),
    Injection("grad_before_reduce", True, FIRST_SHARD,
              "the probe's backward writes inf into its gradient element 0 (rank 0's shard), before the reduction"),
    Injection("shard", True, OWN_SHARD,
              "the probe's backward writes inf into the gradient element of the rank's own shard, before the "
              "reduction", needs_shards=True),
    Injection("grad_after_reduce", False, EVERY,
              "element 0 of the rank's local gradient (full under DDP, its shard under FSDP) is set to inf "
              "after the reduction, before scaler.step"),
]}


@dataclasses.dataclass(frozen=True)
class Scaler:
    """A loss scaler usable across ranks: its profile (one rank's state machine) and what it is."""

    name: str
    profile: str
    real: str


SCALERS = {scaler.name: scaler for scaler in [
    Scaler("torch", "torch", "torch.amp.GradScaler"),
    Scaler("torch_sharded", "torch_sharded", "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler"),
    Scaler("deepspeed", "deepspeed", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    Scaler("megatron", "megatron", "megatron.core.optimizer.grad_scaler.DynamicGradScaler"),
]}


@dataclasses.dataclass(frozen=True)
class FoundInfReduction:
    """How one framework's scaler reduces found-inf across ranks (read in the installed source).

    Attributes:
      framework: the scaler (a :data:`SCALERS` key, or another framework's check: ``deepspeed_fp16``, ...).
      layouts: the layouts the row holds for (``*`` for any).
      ops: the collectives in order, each (op, group, the framework's name for it): MAX or SUM (a SUM
        of 0/1 flags cannot overflow; a check that sums the gradients themselves can, see ``check``)
        over a :data:`GROUPS` key.
      when: where it runs relative to the gradient reduction.
      check: how a rank decides its own found-inf before any reduction.
      versions: the versions read, and how others differ.
      source: file and function.
    """

    framework: str
    layouts: tuple
    ops: tuple
    when: str
    check: str
    versions: str
    source: str


_AMP_CHECK = "_amp_foreach_non_finite_check_and_unscale_ (elementwise isfinite) on the local gradients"
FOUND_INF_REDUCTIONS = (
    FoundInfReduction("torch", ("ddp", "fsdp1"), (), "none: GradScaler runs no collective", _AMP_CHECK,
                      "torch 2.13.0", "torch/amp/grad_scaler.py: GradScaler._unscale_grads_"),
    FoundInfReduction("torch", ("fsdp2",), ((MAX, DP, "the first gradient's mesh, its non-Replicate dims"),),
                      "inside unscale_, after the reduce-scatter: the DTensor dispatch of the check",
                      _AMP_CHECK + ", on each DTensor's local shard",
                      "torch 2.13.0 (added by PR #132816, 'GradScaler for DTensor')",
                      "torch/distributed/tensor/_dispatch.py: found_inf_reduce_handler (Partial('max'), full_tensor)"),
    FoundInfReduction("torch_sharded", ("ddp", "fsdp1"), ((SUM, WORLD, "process_group (default: the world)"),),
                      "in unscale_, after the gradient reduction; the CPU update tests found_inf >= 1.0",
                      _AMP_CHECK, "torch 2.13.0 (PR #115710 made the copy wait for the async all-reduce)",
                      "torch/distributed/fsdp/sharded_grad_scaler.py: ShardedGradScaler.unscale_"),
    FoundInfReduction("torch_sharded", ("fsdp2",), ((MAX, DP, "the first gradient's mesh (DTensor dispatch)"),
                                                    (SUM, WORLD, "process_group (default: the world)")),
                      "in unscale_, after the reduce-scatter: found-inf is reduced twice (torch warns that it "
                      "is implicitly replicated)", _AMP_CHECK, "torch 2.13.0",
                      "torch/distributed/tensor/_dispatch.py and fsdp/sharded_grad_scaler.py"),
    FoundInfReduction("deepspeed", ("zero1", "zero2"), ((MAX, DP, "dp_process_group (the mpu's data-parallel group)"),
                                                        (MAX, MP, "model_parallel_group (the mpu's; skipped when "
                                                                  "it has one rank)")),
                      "after the gradient reduction, on the rank's partition of the averaged gradients",
                      "0.19.8: has_inf_or_nan (amax/amin of each gradient); 0.17.0: elementwise isnan or isinf, then max",
                      "deepspeed 0.19.8 and 0.17.0",
                      "deepspeed/runtime/zero/stage_1_and_2.py: DeepSpeedZeroOptimizer.has_overflow"),
    FoundInfReduction("deepspeed_fp16", ("*",),
                      ((MAX, WORLD, "expert-parallel group (MoE); world if zero_reduce_scatter; DP then MP with an mpu "
                             "when backward all-reduce is off; else MP, or none"),),
                      "after the gradient all-reduce; plain data parallelism relies on identical gradients",
                      "0.17.0: float(x.float().sum()) is non-finite, which finite float32 gradients whose sum "
                      "overflows also are ([3e38, 3e38]); 0.19.8: amax/amin, no such false overflow",
                      "deepspeed 0.19.8 and 0.17.0", "deepspeed/runtime/utils.py: CheckOverflow.has_overflow"),
    FoundInfReduction("megatron", ("megatron",), ((MAX, MP, "get_grad_stats_parallel_group(): the model-parallel "
                                                          "group for the ordinary optimizer (DP x MP for the "
                                                          "distributed one, not driven here)"),),
                      "after the gradient reduction, on the main (fp32) gradients; a ChainedOptimizer ORs its "
                      "sub-optimizers' flags to skip, but each updates its own grad scaler with its own flag",
                      _AMP_CHECK.replace("local gradients", "main gradients"), "megatron-core 0.16.1",
                      "megatron/core/optimizer/optimizer.py: _unscale_main_grads_and_check_for_nan, "
                      "ChainedOptimizer.prepare_grads"),
)


def found_inf_reduction(scaler: str, layout: str) -> FoundInfReduction:
    """The :data:`FOUND_INF_REDUCTIONS` row of ``scaler`` on ``layout``.

    Example:
      >>> [(op, group) for op, group, _ in found_inf_reduction("torch_sharded", "fsdp2").ops]
      [('max', 'dp'), ('sum', 'world')]
    """
    for row in FOUND_INF_REDUCTIONS:
        if row.framework == scaler and (layout in row.layouts or "*" in row.layouts):
            return row
    raise ValueError(f"no found-inf reduction known for scaler {scaler!r} on layout {layout!r}")


@dataclasses.dataclass(frozen=True)
class RanksCase:
    """One multi-rank run: a layout, a scaler, an injection point and each rank's overflow flags.

    Attributes:
      world_size: the number of ranks.
      layout, scaler, inject: keys of :data:`LAYOUTS`, :data:`SCALERS`, :data:`INJECTIONS`.
      overflow: per rank, per step, whether the rank overflows at that step.
      params: the scaler's parameters (its profile's names).
      model_parallel: ranks per model replica (see :data:`GROUPS`); 1 is pure data parallelism.
      reduce_over: the :data:`GROUPS` the real run's found-inf collectives are configured over (None:
        the framework's own, its :data:`FOUND_INF_REDUCTIONS` row); a collective over another group
        is left out, as when the framework is handed a model-parallel group of one rank.
    """

    world_size: int
    layout: str
    scaler: str
    inject: str
    overflow: tuple
    params: dict = dataclasses.field(default_factory=dict)
    model_parallel: int = 1
    reduce_over: Optional[tuple] = None

    @property
    def steps(self) -> int:
        return len(self.overflow[0])


def group_members(world_size: int, model_parallel: int, group: str) -> list:
    """The ranks of each group of kind ``group`` (a :data:`GROUPS` key), a partition of the world.

    Example:
      >>> group_members(4, 2, "dp"), group_members(4, 2, "mp"), group_members(4, 1, "mp")
      ([[0, 2], [1, 3]], [[0, 1], [2, 3]], [[0], [1], [2], [3]])
    """
    ranks = list(range(world_size))
    if group == WORLD:
        return [ranks]
    if group == DP:
        return [ranks[index::model_parallel] for index in range(model_parallel)]
    return [ranks[start:start + model_parallel] for start in range(0, world_size, model_parallel)]


def _within(flags: np.ndarray, members: list, combine) -> np.ndarray:
    """``combine`` (axis 0) of ``flags`` within each group of ``members``, given back to every member."""
    out = flags.copy()
    for ranks in members:
        out[ranks] = combine(flags[ranks])
    return out


def visible_overflow(case: RanksCase) -> np.ndarray:
    """(world_size, steps) bools: whether each rank's own gradients hold a non-finite value after
    the gradient reduction (over its data-parallel group), before any found-inf reduction.

    Example:
      >>> case = RanksCase(2, "fsdp1", "torch", "grad_before_reduce", ((False,), (True,)))
      >>> visible_overflow(case).tolist()   # the shard owner sees the other rank's inf
      [[True], [False]]
    """
    layout, injection = LAYOUTS[case.layout], INJECTIONS[case.inject]
    bad = np.array(case.overflow, dtype=bool)
    replicas = group_members(case.world_size, case.model_parallel, DP)
    if not injection.reduced:
        return bad
    if not layout.sharded or injection.lands_on == EVERY:
        return _within(bad, replicas, lambda rows: rows.any(axis=0))
    if injection.lands_on == FIRST_SHARD:  # element 0 is in the replica group's first rank's shard
        return _within(bad, replicas, lambda rows: np.eye(len(rows), 1, dtype=bool) & rows.any(axis=0))
    return bad


def reduce_found_inf(visible: np.ndarray, reduction: FoundInfReduction, model_parallel: int = 1,
                     reduce_over: Optional[tuple] = None) -> np.ndarray:
    """Each rank's found-inf after the reduction's collectives, each within its group (those in
    ``reduce_over`` only, when given).

    Example:
      >>> row = found_inf_reduction("deepspeed", "zero1")
      >>> seen = np.array([[False], [True], [False], [False]])   # rank 1 of 2 dp x 2 mp
      >>> reduce_found_inf(seen, row, 2).ravel().tolist(), reduce_found_inf(seen, row, 2, ("dp",)).ravel().tolist()
      ([True, True, True, True], [False, True, False, True])
    """
    flags = visible.astype(np.float32)
    for op, group, _ in reduction.ops:
        if reduce_over is not None and group not in reduce_over:
            continue
        # A SUM of 0/1 flags is at most world_size; the scalers test it as >= 1 (sharded) or > 0.
        combine = (lambda rows: rows.max(axis=0)) if op == MAX else (lambda rows: rows.sum(axis=0, dtype=np.float32))
        flags = _within(flags, group_members(len(flags), model_parallel, group), combine)
    return flags > 0


@dataclasses.dataclass(frozen=True)
class CrossRankVerdict:
    """Whether ranks agree, and where they first do not.

    Attributes:
      agree: every rank used the same scale and skipped the same steps.
      step: the first step at which two ranks' scale or skip differ (None when they agree).
      field: ``applied`` or ``scale`` at that step.
      skipped, applied: at that step, the ranks that skipped the update and those that ran it.
      scales: at that step, each rank's scale.
    """

    agree: bool
    step: Optional[int] = None
    field: Optional[str] = None
    skipped: tuple = ()
    applied: tuple = ()
    scales: tuple = ()

    def describe(self) -> str:
        """One line: 'ranks agree' or where and how they part."""
        if self.agree:
            return "ranks agree: every rank used the same scales and skipped the same steps"
        scales = ", ".join(f"rank {r} {s:g}" for r, s in enumerate(self.scales))
        if self.field == "applied":
            return (f"ranks disagree from step {self.step}: rank{'s' * (len(self.skipped) > 1)} "
                    f"{', '.join(map(str, self.skipped))} skipped the update, rank{'s' * (len(self.applied) > 1)} "
                    f"{', '.join(map(str, self.applied))} applied it (scales {scales})")
        return f"ranks disagree from step {self.step}: their scales differ ({scales})"


def cross_rank_verdict(scales, applied) -> CrossRankVerdict:
    """Compare ranks with rank 0, step by step, on the scale used (bit for bit) and the skip.

    Args:
      scales: per rank, the scale used at each step.
      applied: per rank, whether each step's update ran.

    Returns:
      The :class:`CrossRankVerdict`; a skip that differs is named before a scale that differs at the
      same step.

    Example:
      >>> cross_rank_verdict([[4.0, 4.0], [4.0, 4.0]], [[True, True], [True, False]]).describe()
      'ranks disagree from step 1: rank 1 skipped the update, rank 0 applied it (scales rank 0 4, rank 1 4)'
    """
    steps = min(len(s) for s in scales)
    for step in range(steps):
        at = [bool(a[step]) for a in applied]
        used = [float(s[step]) for s in scales]
        for field, values in (("applied", at), ("scale", [v.hex() for v in used])):
            if len(set(values)) > 1:
                return CrossRankVerdict(False, step, field,
                                        tuple(r for r, ok in enumerate(at) if not ok),
                                        tuple(r for r, ok in enumerate(at) if ok), tuple(used))
    return CrossRankVerdict(True)


@dataclasses.dataclass(frozen=True)
class RanksPrediction:
    """What the model says a case does.

    Attributes:
      visible: (ranks, steps) each rank's own non-finite gradients (before found-inf reduction).
      found_inf: (ranks, steps) each rank's found-inf after the reduction (its scaler's input).
      traces: per rank, :func:`fpemu.simulate_scaler` on its found-inf.
      verdict: the cross-rank verdict of those traces.
      reduction: the found-inf reduction row the prediction used.
    """

    visible: np.ndarray
    found_inf: np.ndarray
    traces: tuple
    verdict: CrossRankVerdict
    reduction: FoundInfReduction


def predict(case: RanksCase) -> RanksPrediction:
    """Per rank the scale, skips and growth counter, and whether ranks agree (see the module doc)."""
    reduction = found_inf_reduction(case.scaler, case.layout)
    visible = visible_overflow(case)
    found = reduce_found_inf(visible, reduction, case.model_parallel, case.reduce_over)
    profile = SCALERS[case.scaler].profile
    traces = tuple(simulate_scaler(flags, profile, **case.params) for flags in found)
    verdict = cross_rank_verdict([t.scales for t in traces], [t.applied for t in traces])
    return RanksPrediction(visible, found, traces, verdict, reduction)


def chained_scales(flags_per_optimizer, profile: str = "megatron", **params) -> tuple:
    """Megatron's ChainedOptimizer: the chain skips when any sub-optimizer found an inf, but each
    sub-optimizer updates its own grad scaler with its own flag (megatron-core 0.16.1,
    ChainedOptimizer.prepare_grads), so their scales drift apart when only some overflow.

    Args:
      flags_per_optimizer: per sub-optimizer, its found-inf at each step (after its own group's MAX).
      profile: the scalers' profile; params: its parameters.

    Returns:
      (per sub-optimizer ScalerTrace, the chain's applied flags, the CrossRankVerdict between the
      sub-optimizers' scales: ``get_loss_scale()`` returns only the first one's).

    Example:
      >>> traces, applied, drift = chained_scales([[False, False], [True, False]], initial_scale=8.0,
      ...                                         min_scale=1.0, growth_interval=4, hysteresis=1)
      >>> [t.final_scale for t in traces], applied.tolist(), drift.step, drift.field
      ([8.0, 4.0], [False, True], 1, 'scale')
    """
    flags = np.array(flags_per_optimizer, dtype=bool)
    traces = tuple(simulate_scaler(row, profile, **params) for row in flags)
    chain_applied = ~flags.any(axis=0)
    drift = cross_rank_verdict([t.scales for t in traces], [chain_applied] * len(traces))
    return traces, chain_applied, drift

