"""Multi-rank specs under the harness: the model's prediction, the real ranks, and the verdicts.

For every case of every [ranks] spec (a world size x an injection point) :func:`run_ranks`
writes a trace v1 per rank of the reference model and of the real run, compares each rank
with the model bit for bit and the ranks with each other, and returns one
:class:`~fpemu.compare.diff.Verdict` per case:

* ``match``: every rank equals the model, and the ranks agree;
* ``known divergence``: every rank equals the model, and the ranks part at the step the spec
  declares (or the run aborts there, as declared);
* ``diverged``: a rank differs from the model, or the ranks part where the spec declares
  nothing (the note names the step, the ranks that skipped and those that did not, and the
  parameter drift), or a declared divergence did not happen;
* ``skipped`` / ``cannot run``: the layout's adapter cannot run here, or the run crashed or hung
  where the spec declares no abort.

All cases of one world size and device run in one process group (fpemu.adapters.torch_ranks): forked
here by the built-in launcher, or, under torchrun (``world``: fpemu.adapters.torch_ranks.env_world), the
world torchrun formed, where every rank calls :func:`run_ranks` and rank 0 writes the traces.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Optional

import numpy as np

from fpemu.adapters.observed import observed_trace
# These import no torch (a GPU count is asked for on cuda only).
from fpemu.adapters.torch_ranks import default_case_timeout, unavailable
from fpemu.compare import compare_traces
from fpemu.compare.diff import CANNOT_RUN, DIVERGED, KNOWN, MATCH, SKIPPED, Divergence, Verdict
from fpemu.errors import FpemuInputError
from fpemu.harness.jobs import job_failure, matches, parse_implementation, skip_reason
from fpemu.adapters import adapter_versions, package_versions
from fpemu.kinds import explain
from fpemu.traces.layout import REFERENCE, trace_metadata, trace_steps, trace_summary
from fpemu.ranks import LAYOUTS, SCALERS, cross_rank_verdict, group_members, predict
from fpemu.ranks.model import DP
from fpemu.scalers.profiles import get_profile
from fpemu.specs import Implementation, RanksScenario, load_specs
from fpemu.traces import Trace, trace_filename, write_golden_trace, write_trace


@dataclasses.dataclass(frozen=True)
class CaseOutcome:
    """One case, as the model predicts it and the real ranks ran it.

    Attributes:
      name: ``spec.injection.Nranks``.
      scenario, case, declared: the spec, its fpemu.ranks.RanksCase and its declared RanksDivergence.
      implementation: ``torch_ddp@cpu``, ...
      prediction: fpemu.ranks.RanksPrediction.
      reference: per rank, the model's Trace.
      observed: per rank, the real run's Trace (empty when it did not run or failed).
      verdict: the case's Verdict.
      drift: replicated layouts: (first step at which the ranks' parameters differ, the largest
        final |difference|); None for sharded layouts, whose ranks hold different shards.
      seconds: the case's wall time in its process group.
    """

    name: str
    scenario: RanksScenario
    case: object
    declared: object
    implementation: str
    prediction: object
    reference: tuple
    observed: tuple
    verdict: Verdict
    drift: Optional[tuple] = None
    seconds: float = 0.0


def ranks_scenarios(scenarios) -> list:
    """The [ranks] scenarios among ``scenarios``."""
    return [s for s in scenarios if isinstance(s, RanksScenario)]


def ranks_left_out(spec_paths, command: str) -> Optional[str]:
    """What ``fpemu {command}`` (golden, diff) says of the [ranks] specs among ``spec_paths``, which it
    does not run: their per-rank references and real ranks run together under ``fpemu run``.  None
    when there are none; FpemuInputError (exit 2) when they are all there is, as nothing asked can be done."""
    scenarios = load_specs(spec_paths)
    files = [scenario.path for scenario in ranks_scenarios(scenarios)]
    if not files:
        return None
    message = (f"{', '.join(files)}: [ranks] spec{'s' * (len(files) > 1)}, which `fpemu {command}` does not "
               "run; `fpemu run --specs FOLDER_OR_FILE` writes their per-rank golden traces and drives their "
               "real ranks")
    if len(files) == len(scenarios):
        raise FpemuInputError(message)
    return message


def _implementation(scenario: RanksScenario, requested, excluded) -> Optional[Implementation]:
    """The layout's adapter on the device ``--impl`` names (cpu by default), or None when not selected."""
    device = "cpu"
    if requested:
        chosen = [parse_implementation(name) for name in requested]
        devices = [dev for adapter, dev in chosen if adapter == scenario.adapter]
        if not devices:
            return None
        device = devices[0]
    impl = Implementation(scenario.adapter, dict(scenario.params), device)
    return None if excluded and matches(impl.key, excluded) else impl


def _case_trace(scenario, name: str, rank: int, implementation: str, scaler_trace, versions, device,
                world_size: int, inject: str, overrides: tuple = ()) -> Trace:
    """A rank's trace; its parameters are the scaler trace's (the real scaler's, read back, for a real run),
    ``overrides`` what the real run answered differently from the framework's view of the machine."""
    profile = get_profile(SCALERS[scenario.scaler].profile)
    extra = {"ranks": {"case": name, "rank": rank, "world_size": world_size, "layout": scenario.layout,
                       "scaler": scenario.scaler, "inject": inject,
                       **({"model_parallel": scenario.model_parallel} if scenario.model_parallel > 1 else {}),
                       **({"reduce_over": list(scenario.reduce_over)} if scenario.reduce_over else {}),
                       **({"overrides": list(overrides)} if overrides else {})}}
    if implementation == REFERENCE:
        extra["verified"] = profile.verified
    metadata = trace_metadata(scenario, implementation, profile.name, scaler_trace.params, versions, device, **extra)
    return Trace(metadata, trace_steps(scaler_trace, scenario.record), trace_summary(scaler_trace))


def _reference_traces(scenario, name, case, prediction) -> tuple:
    versions = package_versions(["numpy", "ml_dtypes"])
    return tuple(_case_trace(scenario, name, rank, REFERENCE, trace, versions, "cpu", case.world_size, case.inject)
                 for rank, trace in enumerate(prediction.traces))


def _observed_traces(scenario, name, case, impl, result) -> tuple:
    from fpemu.adapters import get_adapter
    versions = adapter_versions(get_adapter(impl.name))
    profile = SCALERS[scenario.scaler].profile
    out = []
    for record in result.ranks:
        trace = observed_trace(profile, scenario.params, record.found_inf, record.scales, record.applied,
                               record.growth_tracker, record.final_scale, read_back=record.scaler_params or None)
        out.append(_case_trace(scenario, name, record.rank, impl.key, trace, versions, impl.device,
                               case.world_size, case.inject, record.overrides))
    return tuple(out)


def _drift(case, result) -> Optional[tuple]:
    """(first step whose parameter checksums differ between replicas, largest final |difference|) for a
    replicated layout, the replicas being each data-parallel group's ranks; None for a sharded one."""
    layout = LAYOUTS[case.layout]
    if (layout.sharded and not layout.replicas) or not result.ranks:
        return None
    firsts, largest = [], 0.0
    for ranks in group_members(case.world_size, case.model_parallel, DP):
        sums = [[float(v).hex() for v in result.ranks[r].checksums] for r in ranks]
        firsts += [step for step in range(len(sums[0])) if len({s[step] for s in sums}) > 1][:1]
        final = np.array([result.ranks[r].final_params for r in ranks], dtype=np.float64)
        largest = max(largest, float(np.max(np.abs(final - final[0]))))
    return min(firsts, default=None), largest


def _describe_drift(drift, model_parallel: int = 1) -> str:
    if drift is None:
        return "the ranks hold different shards: each shard was updated at other steps than its peers"
    step, size = drift
    slices = (" (compared within each data-parallel group: model-parallel ranks hold other slices)"
              if model_parallel > 1 else "")
    if step is None:
        return "the replicas' parameters stay identical" + slices
    return f"the replicas' parameters differ from step {step} (final max |difference| {size:.6g})" + slices


def _cross_rank_divergence(verdict) -> Divergence:
    first = verdict.applied[0] if verdict.field == "applied" else 0
    other = verdict.skipped[0] if verdict.field == "applied" else next(
        r for r, s in enumerate(verdict.scales) if s != verdict.scales[0])
    expected = True if verdict.field == "applied" else verdict.scales[first]
    got = False if verdict.field == "applied" else verdict.scales[other]
    return Divergence(verdict.step, f"{verdict.field} (rank {first} vs rank {other})", expected, got,
                      f"across ranks: {verdict.describe()}")


# What a failed multi-rank run's error says happened, in words that do not change from run to run
# (the raw errors hold ports and build paths): substring -> ending.
_ENDINGS = {"doesn't match expected size": "gloo aborted a collective mismatch (a rank died with "
                                           "'Received data size doesn't match expected size')",
            "timeout": "a hang (no result within the case timeout)",
            "Timed out": "a hang (a collective timed out)"}


_CASE_HANG = "timeout: no result within"  # torch_ranks' words for a case past its timeout
_HANG_HINT = ("; a longer healthy case needs a longer timeout: ranks.timeout_s in the spec, or "
              "`fpemu run --rank-timeout SECONDS` "
              "(`fpemu ranks --rank-timeout` too)")


def ending(error: str) -> str:
    """How a failed run ended, stably worded (:data:`_ENDINGS`), else the error itself."""
    return next((words for marker, words in _ENDINGS.items() if marker in error), error)


def _judge(name, impl, declared, prediction, result, reference, observed, drift, case) -> Verdict:
    """The case's Verdict (see the module doc)."""
    key = impl.key
    if result.error is not None:
        if declared is not None and declared.ends == "abort" and not prediction.verdict.agree \
                and prediction.verdict.step == declared.step:
            return Verdict(name, key, KNOWN, note=f"{declared.reason}; the run ended as declared: {ending(result.error)}")
        hint = _HANG_HINT if result.error.startswith(_CASE_HANG) else ""
        return Verdict(name, key, CANNOT_RUN, note=f"the multi-rank run ended: {result.error}{hint}")
    if declared is not None and declared.ends == "abort":
        return Verdict(name, key, DIVERGED, note=f"declared an abort at step {declared.step} ({declared.reason}); "
                                                 "the run completed")
    for rank, (ref, obs) in enumerate(zip(reference, observed)):
        against_model = compare_traces(ref, obs, explain=explain)
        if against_model.status != MATCH:
            return dataclasses.replace(against_model, spec=name, note=f"rank {rank} differs from fpemu's model of "
                                                                       f"the found-inf reduction")
    ranks = cross_rank_verdict([t.column("scale") for t in observed], [t.column("applied") for t in observed])
    steps = len(reference[0].steps)
    if ranks.agree:
        if declared is not None:
            return Verdict(name, key, DIVERGED, steps_compared=steps,
                           note=f"declared a cross-rank divergence at step {declared.step} ({declared.reason}); "
                                "the ranks agree")
        return Verdict(name, key, MATCH, steps_compared=steps)
    divergence = _cross_rank_divergence(ranks)
    detail = _describe_drift(drift, case.model_parallel)
    if declared is not None and declared.step == ranks.step:
        return Verdict(name, key, KNOWN, divergence, note=f"{declared.reason}; {detail}", steps_compared=steps)
    what = (f"declared at step {declared.step} ({declared.reason}), found at step {ranks.step} instead"
            if declared is not None else "undeclared cross-rank divergence")
    return Verdict(name, key, DIVERGED, divergence, note=f"{what}: {ranks.describe()}; {detail}",
                   steps_compared=steps)


def case_timeout(scenario: RanksScenario, case, rank_timeout: Optional[float] = None) -> float:
    """Seconds the case may run before it counts as a hang: ``rank_timeout`` (``--rank-timeout``), else the
    spec's ``ranks.timeout_s``, else the launcher's default for its steps and world size."""
    chosen = rank_timeout if rank_timeout is not None else scenario.timeout_s
    return chosen if chosen is not None else default_case_timeout(len(case.overflow[0]), case.world_size)


def case_payload(scenario: RanksScenario, case, rank_timeout: Optional[float] = None) -> dict:
    """What a rank needs of a case (plain values: it crosses into the forked ranks)."""
    return {"layout": case.layout, "scaler": case.scaler, "params": case.params, "inject": case.inject,
            "overflow": [list(flags) for flags in case.overflow], "model_parallel": case.model_parallel,
            "reduce_over": case.reduce_over, "step_keyed_collective": scenario.step_keyed_collective,
            "timeout_s": case_timeout(scenario, case, rank_timeout)}


def _run_group(jobs, world_size: int, device: str, rank_timeout: Optional[float], world=None) -> Optional[list]:
    """Every case of the group in one process group; one CaseResult per job, in order (None on a torchrun
    world's ranks other than 0)."""
    from fpemu.adapters import get_adapter
    payload = [case_payload(scenario, case, rank_timeout) for _, scenario, case, _, _ in jobs]
    run = get_adapter(jobs[0][4].name).function()
    return run(payload, world_size, device) if world is None else run(payload, world_size, device, world=world)


def _world_jobs(jobs: list, world, spec_paths, left_out: Optional[list]) -> list:
    """The jobs a torchrun world of ``world.world_size`` ranks runs; the others' names go to ``left_out``.
    FpemuInputError (exit 2) when none fits."""
    fit = [job for job in jobs if job[2].world_size == world.world_size]
    if left_out is not None:
        left_out += [job[0] for job in jobs if job[2].world_size != world.world_size]
    if jobs and not fit:
        sizes = ", ".join(map(str, sorted({job[2].world_size for job in jobs})))
        raise FpemuInputError(f"{', '.join(map(str, spec_paths))}: no selected [ranks] case has {world.world_size} "
                              f"ranks, the world torchrun formed (WORLD_SIZE={world.world_size}); their world "
                              f"sizes: {sizes}: run torchrun with --nnodes x --nproc-per-node equal to one of them")
    return fit


def run_ranks(spec_paths, golden_dir, observed_dir, requested=None, excluded=None, progress=None,
              rank_timeout: Optional[float] = None, only=None, world=None,
              left_out: Optional[list] = None) -> tuple:
    """Predict and run every case of the [ranks] specs under ``spec_paths``.

    Args:
      spec_paths: spec files or folders (non-[ranks] specs are ignored).
      golden_dir, observed_dir: where each rank's reference and real traces are written (the folders'
        other traces are removed: they hold exactly this run's).
      requested, excluded: ``--impl`` / ``--exclude`` names (``torch_ddp``, ``torch_fsdp2@cuda``).
      progress: ``(done, total, label)`` callback.
      rank_timeout: seconds every case may run before it counts as a hang (``--rank-timeout``); None: each
        spec's ``ranks.timeout_s``, else the default for the case's steps and world size (:func:`case_timeout`).
      only: the names of the specs to run (a shard's, fpemu.harness.shards); None: all.
      world: None: the built-in launcher forks each world size's ranks here.  Under torchrun, this
        process's rank (fpemu.adapters.torch_ranks.env_world): every rank calls run_ranks with the same
        arguments, the cases of WORLD_SIZE ranks run on that world (FpemuInputError when there are none),
        and rank 0 writes the same traces and returns the same outcomes as the built-in launcher would for
        them; the other ranks return ``([], [])``.
      left_out: a list, under torchrun: the names of the cases left out (another world size) are added.

    Returns:
      (CaseOutcome per case, paths written).
    """
    from fpemu.adapters import get_adapter
    scenarios = [s for s in ranks_scenarios(load_specs(spec_paths)) if only is None or s.name in only]
    jobs, outcomes = [], {}
    for scenario in scenarios:
        impl = _implementation(scenario, requested, excluded)
        if impl is not None:
            jobs += [(name, scenario, case, declared, impl) for name, case, declared in scenario.cases()]
    if world is not None:
        jobs = _world_jobs(jobs, world, spec_paths, left_out)
    groups = {}
    for job in jobs:
        entry = get_adapter(job[4].name).entry  # the torch layouts share one launcher: one group for all
        # a GPU per rank: under torchrun, per rank of this node
        ranks_here = job[2].world_size if world is None else world.local_world_size
        reason = skip_reason(job[4]) or unavailable(ranks_here, job[4].device)
        groups.setdefault((job[2].world_size, job[4].device, entry, reason), []).append(job)
    results = {}
    for (world_size, device, _, reason), group in sorted(groups.items(), key=lambda item: item[0][:3]):
        if reason:
            results.update({job[0]: reason for job in group})
            continue
        if world is not None and world.rank != 0:  # a follower: its errors are the run's, not a case's
            _run_group(group, world_size, device, rank_timeout, world)
            continue
        try:
            results.update(zip((job[0] for job in group), _run_group(group, world_size, device, rank_timeout,
                                                                    world)))
        except Exception as error:  # noqa: BLE001 -- the launcher failing is every case's result line
            results.update({job[0]: error for job in group})
    if world is not None and world.rank != 0:
        return [], []
    golden_dir, observed_dir = pathlib.Path(golden_dir), pathlib.Path(observed_dir)
    written = []
    for index, (name, scenario, case, declared, impl) in enumerate(jobs, 1):
        prediction = predict(case)
        reference = _reference_traces(scenario, name, case, prediction)
        result = results[name]
        observed, drift, seconds = (), None, 0.0
        if isinstance(result, str):
            verdict = Verdict(name, impl.key, SKIPPED, note=result)
        elif isinstance(result, Exception):
            verdict = dataclasses.replace(job_failure(scenario, impl, result), spec=name)
        else:
            observed = _observed_traces(scenario, name, case, impl, result)
            drift, seconds = _drift(case, result), result.seconds
            verdict = _judge(name, impl, declared, prediction, result, reference, observed, drift, case)
        for rank, trace in enumerate(reference):
            written.append(write_golden_trace(trace, golden_dir / trace_filename(f"{name}.rank{rank}", REFERENCE)))
        for rank, trace in enumerate(observed):
            written.append(write_trace(trace, observed_dir / trace_filename(f"{name}.rank{rank}",
                                                                              verdict.implementation)))
        outcomes[name] = CaseOutcome(name, scenario, case, declared, verdict.implementation, prediction, reference,
                                     observed, verdict, drift, seconds)
        if progress is not None:
            progress(index, len(jobs), name)
    for folder in (golden_dir, observed_dir):
        for stale in set(folder.glob("*.json")) - set(written) if folder.is_dir() else ():
            stale.unlink()
    return list(outcomes.values()), written
