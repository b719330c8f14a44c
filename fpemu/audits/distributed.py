"""The distributed part of the torch loop audit: is found-inf reduced across ranks, and do ranks agree?

Under torch.distributed with more than one rank, :func:`rank_check` returns a :class:`RankCheck`
that :class:`fpemu.audits.TorchLoopAudit` consults at two points:

* ``start``: which found-inf reduction the scaler will run (fpemu.ranks.FOUND_INF_REDUCTIONS): a
  ShardedGradScaler SUMs over its process group, a GradScaler over DTensor gradients (FSDP2) MAXes
  over their mesh, and a plain GradScaler over ordinary tensors reduces nothing, which is a
  ``found_inf_not_reduced`` finding (FSDP1's FlatParameter shards make it worse: a rank skips only
  when its own shard holds the inf);
* ``after_attempt``: every rank's scale and skip for the attempt, gathered (one small
  ``all_gather_object`` per attempt, which every rank makes as each calls ``scaler.step``); the first
  attempt at which they differ is a ``ranks_disagree`` finding naming the ranks.

torch is imported on first use.
"""

from __future__ import annotations

from typing import Optional

from fpemu.audits.findings import make_finding


def _dist():
    import torch.distributed as dist
    return dist


def _is_dtensor_sharded(param) -> bool:
    """A DTensor with a placement other than Replicate (its found-inf check reduces over the mesh)."""
    placements = getattr(param, "placements", None)
    return placements is not None and any(type(p).__name__ != "Replicate" for p in placements)


def found_inf_reduction(scaler, params) -> Optional[str]:
    """How ``scaler``'s found-inf is reduced across ranks for ``params`` (None: it is not).

    Example::

        found_inf_reduction(torch.amp.GradScaler("cpu"), ddp_model.parameters())   # None
    """
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    if isinstance(scaler, ShardedGradScaler):
        group = getattr(scaler, "process_group", None)
        return f"SUM over its process group ({_dist().get_world_size(group)} ranks)"
    if any(_is_dtensor_sharded(p) for p in params):
        return "MAX over the DTensor gradients' mesh (torch/distributed/tensor/_dispatch.py)"
    return None


class RankCheck:
    """The audit's cross-rank checks on one scaler (see the module doc)."""

    def __init__(self, scaler, params):
        self._scaler, self._params = scaler, list(params)
        self._world = _dist().get_world_size()
        self._rank = _dist().get_rank()
        self._reported = False

    def start(self) -> list:
        """A ``found_inf_not_reduced`` finding where the scaler reduces no found-inf, else none."""
        if found_inf_reduction(self._scaler, self._params) is not None:
            return []
        sharded = any(type(p).__name__ == "FlatParameter" for p in self._params)
        where = ("each rank holds an FSDP1 FlatParameter shard, so a rank skips only when its own shard holds "
                 "the inf: the shard owner skips, not the rank that overflowed" if sharded else
                 "ranks agree only while every non-finite value passes through the gradient all-reduce; one "
                 "that enters after it (a hook, an in-place edit) makes them skip different steps, silently")
        return [make_finding("found_inf_not_reduced", 0, f"{type(self._scaler).__name__}.step",
                             {"world_size": self._world, "sharded": int(sharded)},
                             f"{type(self._scaler).__name__} reduces no found-inf across the {self._world} ranks: "
                             f"{where}")]

    def after_attempt(self, step: int, applied: bool) -> list:
        """Gather every rank's (scale, applied) of attempt ``step``; a ``ranks_disagree`` finding at the
        first attempt where they differ."""
        mine = (float(self._scaler.get_scale()).hex(), bool(applied))
        every = [None] * self._world
        _dist().all_gather_object(every, mine)
        if self._reported or len(set(every)) == 1:
            return []
        self._reported = True
        skipped = tuple(r for r, (_, ok) in enumerate(every) if not ok)
        ran = tuple(r for r, (_, ok) in enumerate(every) if ok)
        scales = tuple(float.fromhex(s) for s, _ in every)
        return [make_finding("ranks_disagree", step, f"{type(self._scaler).__name__}.step",
                             {"skipped_ranks": skipped, "applied_ranks": ran, "scales": scales},
                             f"ranks disagree at attempt {step} (this is rank {self._rank}): "
                             f"skipped on ranks {list(skipped) or 'none'}, applied on ranks {list(ran) or 'none'}, "
                             f"scales {', '.join(f'{s:g}' for s in scales)}")]

    def metadata(self, findings, skipped: Optional[int] = None) -> dict:
        """What a recorded trace keeps of the ranks (fpemu.record_torch on a distributed run).

        Args:
          findings: the audit's findings so far (its ``ranks_disagree`` is this check's).
          skipped: this rank's skipped updates, to gather with every rank's final scale (one
            ``all_gather_object``, which every rank makes as it leaves the recorder); None gathers
            nothing (a rank leaving on an exception must not wait for its peers).

        Returns:
          ``rank``, ``world_size``, ``found_inf_reduction`` (None: not reduced), ``disagree``: None
          where every rank agreed, else the first attempt at which they did not, with the ranks that
          skipped and applied it and each rank's scale; with ``skipped``, ``skipped_per_rank`` and
          ``final_scales`` (every rank's).
        """
        disagree = next((f for f in findings if f.kind == "ranks_disagree"), None)
        out = {"rank": self._rank, "world_size": self._world,
               "found_inf_reduction": found_inf_reduction(self._scaler, self._params),
               "disagree": None if disagree is None else {"attempt": disagree.step, **{
                   key: list(disagree.effect[key]) for key in ("skipped_ranks", "applied_ranks", "scales")}}}
        if skipped is not None:
            every = [None] * self._world
            _dist().all_gather_object(every, (int(skipped), float(self._scaler.get_scale())))
            out.update(skipped_per_rank=[count for count, _ in every], final_scales=[scale for _, scale in every])
        return out


def rank_check(scaler, params) -> Optional[RankCheck]:
    """A :class:`RankCheck` when torch.distributed runs more than one rank and there is a scaler, else None."""
    if scaler is None:
        return None
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return None
    return RankCheck(scaler, params)
