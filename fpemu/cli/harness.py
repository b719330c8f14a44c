"""The harness commands: golden, record, diff, audit, compare, report, run (the main job) and ranks."""

from __future__ import annotations

import json
import math
import pathlib

from fpemu.cli import output
from fpemu.errors import FpemuInputError


def _ranks_left_out(args) -> None:
    from fpemu.harness.ranks import ranks_left_out
    left_out = ranks_left_out(args.specs, args.command)  # raises (exit 2) when only [ranks] specs were given
    if left_out:
        output.note(args, f"note: {left_out}")


def _cmd_golden(args) -> int:
    from fpemu.harness import write_golden
    _ranks_left_out(args)
    unmade = []
    written = write_golden(args.specs, args.out, output.progress(args), unmade)
    made = [path for path in written if path not in {kept for _, _, kept in unmade}]
    lines = output.written_lines(made, "golden traces") + [
        f"{'kept ' + str(kept) if kept else 'no golden'} for {name}: {why}" for name, why, kept in unmade]
    output.emit(args, {"written": [str(p) for p in made], "unmade": [[name, why, kept and str(kept)]
                                                                for name, why, kept in unmade]}, lines)
    return 1 if any("(--timeout)" in why for _, why, _ in unmade) else 0


def _cmd_record(args) -> int:
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import record
    _ranks_left_out(args)
    done = record(args.specs, args.out, args.impl, output.progress(args), excluded=args.exclude)
    lines = output.written_lines(done.written, "traces")
    lines += [output.job_line(v) for v in done.unrecorded]
    if done.removed:
        lines.append(f"removed {len(done.removed)} stale trace{'s' * (len(done.removed) != 1)} from {args.out} "
                     f"(not written by this run): {', '.join(p.name for p in done.removed)}")
    jobs = len(done.written) + len(done.unrecorded)
    lines.append(f"{jobs} job{'s' * (jobs != 1)}: {len(done.written)} recorded"
                 + (f", {output.status_counts(done.unrecorded)}" if done.unrecorded else ""))
    code = output.failure_code(done.unrecorded) or (0 if done.written else output.nothing_compared(args, done.unrecorded,
                                                                                       "recorded"))
    output.emit(args, {"written": [str(p) for p in done.written], "removed": [str(p) for p in done.removed],
                 "unrecorded": [v.as_dict() for v in done.unrecorded],
                 "skipped": [[v.spec, v.implementation, v.note] for v in done.unrecorded if v.status == SKIPPED],
                 "exit_code": code}, lines)
    return code


def _cmd_diff(args) -> int:
    from fpemu.harness import diff
    _ranks_left_out(args)
    verdicts = diff(args.specs, args.golden, args.impl, args.save, output.progress(args), excluded=args.exclude)
    code = output.failure_code(verdicts) or output.nothing_compared(args, verdicts)
    output.emit(args, {"verdicts": [v.as_dict() for v in verdicts], "exit_code": code}, output.verdict_lines(verdicts))
    return code


def _audit_change_lines(changes) -> list:
    """The changes grouped by the package versions that differ (only those are printed), each with
    its first divergence, its impact verdict, the fields that differ and the summary entries that do."""
    groups = {}
    for change in changes:
        versions = ", ".join(p.describe() for p in change.impact.packages) or "no package version differs"
        groups.setdefault(versions, []).append(change)
    lines = []
    for versions, members in groups.items():
        lines.append(f"{versions}: {len(members)} change{'s' * (len(members) != 1)}")
        for change in members:
            impact = change.impact
            lines.append(f"CHANGED {change.spec} / {change.implementation}: "
                         f"{impact.divergence.describe('baseline', 'now')}")
            lines.append(f"        impact: {impact.verdict()}")
            lines += [f"        {row}" for row in impact.field_lines()] if impact.fields else []
            summary = [c.describe() for c in impact.summary if c.changed]
            lines += [f"        summary: {', '.join(summary)}"] if summary else []
    return lines


def _cmd_audit(args) -> int:
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import audit, skipped_summary
    changes, unchanged, problems = audit(args.baseline, output.progress(args), args.impl, args.exclude)
    skipped = [v for v in problems if v.status == SKIPPED]
    failed = [v for v in problems if v.status != SKIPPED]
    lines = [f"{unchanged} recorded behaviours unchanged, {len(changes)} changed, {len(skipped)} skipped"
             + (f", {len(failed)} failed ({output.status_counts(failed)})" if failed else "")]
    lines += _audit_change_lines(changes)
    lines += [output.job_line(v) for v in problems]
    code = max(output.failure_code(failed), 1 if changes else 0)
    if skipped and not code:
        message = (f"{len(skipped)} baseline behaviour{'s' * (len(skipped) != 1)} not audited, their "
                   f"implementation cannot run here: {skipped_summary(skipped)}")
        if args.allow_skips:
            output.note(args, f"note: {message} (accepted: --allow-skips)")
        else:
            output.note(args, f"error: {message}; pass --allow-skips to accept an audit that leaves them out")
            code = 1
    payload = {"unchanged": unchanged, "exit_code": code,
               "skipped": [[v.spec, v.implementation, v.note] for v in skipped],
               "failed": [v.as_dict() for v in failed],
               "changes": [{"spec": c.spec, "implementation": c.implementation, "baseline": c.baseline_path,
                            "packages_before": c.packages_before, "packages_now": c.packages_now,
                            "divergence": c.impact.divergence.as_dict("baseline", "now"),
                            "impact": c.impact.as_dict("baseline", "now")} for c in changes]}
    output.emit(args, payload, lines)
    return code


def _cmd_compare(args) -> int:
    from fpemu.compare import trace_changes
    from fpemu.kinds import explain, read_trace_checked
    before, after = read_trace_checked(args.before), read_trace_checked(args.after)
    try:
        changes = trace_changes(before, after, explain)
    except FpemuInputError as error:
        raise FpemuInputError(f"{args.before} vs {args.after}: {error}") from None
    code = 0 if changes.identical else 1
    lines = changes.lines() + ["", f"before: {args.before} ({changes.before})",
                               f"after: {args.after} ({changes.after})"]
    output.emit(args, {**changes.as_dict(), "files": [str(args.before), str(args.after)], "exit_code": code}, lines)
    return code


def _cmd_merge_traces(args) -> int:
    from fpemu.traces.merge import merge_traces
    for name in ("base", "ours", "theirs"):
        if not getattr(args, name).is_file():
            raise FpemuInputError(f"{name} {getattr(args, name)}: no such file")
    merge = merge_traces(args.base, args.ours, args.theirs)
    code = 0 if merge.clean else 1
    if merge.conflicts:
        line = (f"{args.ours}: {merge.conflicts} conflict(s) where both sides changed the same lines; resolve them "
                "(the checksum line is gone and comes back when the file is regenerated: `fpemu golden`)")
    elif merge.problem:
        line = f"{args.ours}: merged without conflicts but left unsealed: {merge.problem}"
    else:
        line = f"{args.ours}: merged and sealed"
    output.emit(args, {"file": str(args.ours), "conflicts": merge.conflicts, "problem": merge.problem,
                       "exit_code": code}, [line])
    return code


def _cmd_report(args) -> int:
    from fpemu.reports import write_all
    for name, path, folder in (("--golden", args.golden, True), ("--observed", args.observed, True),
                               ("--diff", args.diff, False)):
        if path is not None and not (path.is_dir() if folder else path.is_file()):
            raise FpemuInputError(f"{name} {path}: no such {'folder' if folder else 'file'}")
    if args.golden is not None and args.diff is None and not args.quiet:
        output.note(args, "note: no --diff: harness.md shows the golden traces but no comparisons; pass --diff with "
                    "the JSON of `fpemu diff ... --json > diff.json` (or reports/diff.json, written by `fpemu run`), "
                    "and --observed with the folder of `fpemu diff --save`")
    written = write_all(args.reports, golden_dir=args.golden, observed_dir=args.observed, diff_file=args.diff)
    output.emit(args, {"written": [str(p) for p in written]}, output.written_lines(written))
    return 0


def _rank_timeout(seconds):
    if seconds is not None and not 0 < seconds < math.inf:
        raise FpemuInputError(f"--rank-timeout {seconds:g}: expected seconds > 0 (a finite number)")
    return seconds


def _run_options(args) -> dict:
    """What a shard's results depend on besides the specs: a merge refuses shards run with other options."""
    return {"impl": args.impl, "exclude": args.exclude, "rank_timeout": args.rank_timeout}


def _check_specs_folder(args) -> None:
    if not args.specs.exists():
        where = "the current folder" if args.specs == output.DEFAULT_SPECS else str(args.specs.parent)
        raise FpemuInputError(f"{args.specs}: no such spec file or folder in {where}; `fpemu {args.command}` reads "
                              "the specs/ folder of an fpemu checkout: run it from the checkout's root, or pass "
                              "--specs FOLDER (and --reports FOLDER for the output)")


def _run_reports(reports, verdicts, ranks, golden_dir, observed_dir) -> tuple:
    """What belongs to the whole run, written once (by the run, or by the merge of its shards): diff.json
    and every report; returns (diff.json's path, the reports written)."""
    from fpemu.fileio import atomic_write
    from fpemu.reports import write_all
    from fpemu.reports.ranks import ranks_report
    diff_file = atomic_write(reports / "diff.json",
                             json.dumps({"verdicts": [v.as_dict() for v in verdicts]}, indent=1, sort_keys=True) + "\n")
    written = ranks_report(reports, ranks) if ranks else []  # before write_all: its index lists ranks.md
    written += write_all(reports, golden_dir=golden_dir, observed_dir=observed_dir, diff_file=diff_file)
    return diff_file, written


def _seed_kept_goldens(reports, golden_dir, scenarios) -> None:
    """A shard starts from the run's current goldens of its specs, so that one it cannot make here is kept,
    as the whole run keeps it (fpemu.harness.write_golden)."""
    from fpemu.fileio import atomic_write
    from fpemu.traces import trace_filename
    from fpemu.traces.layout import REFERENCE
    for scenario in scenarios:
        name = trace_filename(scenario.name, REFERENCE)
        if (reports / "golden" / name).is_file() and golden_dir != reports / "golden":
            atomic_write(golden_dir / name, (reports / "golden" / name).read_bytes(), "wb")


def _cmd_run(args) -> int:
    from fpemu.compare.diff import JOB_FAILURES, SKIPPED
    from fpemu.harness import diff, write_golden
    from fpemu.harness import shards
    from fpemu.harness.ranks import run_ranks
    from fpemu.specs import load_specs
    from fpemu.traces import trace_filename
    rank_timeout = _rank_timeout(args.rank_timeout)
    _check_specs_folder(args)
    shard = shards.requested_shard(args.shard)
    reports = args.reports
    out = reports / shards.FOLDER / shard.folder if shard else reports  # a shard writes its partial results only
    golden_dir, observed_dir = out / "golden", out / "observed"
    progress = output.progress(args)
    only, scenarios = None, None
    if shard is not None:
        scenarios = load_specs([args.specs])
        only = shards.shard_names([s.name for s in scenarios], shard)
        _seed_kept_goldens(reports, golden_dir, [s for s in scenarios if s.name in only])
    fresh = set(write_golden([args.specs], golden_dir, progress, only=only))
    ranks, ranks_written = run_ranks([args.specs], golden_dir / "ranks", observed_dir / "ranks", args.impl,
                                     args.exclude, progress, rank_timeout, only=only)
    jobs = diff([args.specs], golden_dir, args.impl, observed_dir, progress,
                allow_none=not args.impl or bool(ranks) or shard is not None, excluded=args.exclude, only=only)
    verdicts = jobs + [outcome.verdict for outcome in ranks]
    fresh |= {observed_dir / trace_filename(v.spec, v.implementation) for v in verdicts
              if v.status != SKIPPED and v.status not in JOB_FAILURES}
    shards.remove_stale((golden_dir, observed_dir), fresh)  # traces of specs that no longer exist would haunt the report
    fresh |= set(ranks_written)
    code = output.failure_code(verdicts) or output.nothing_compared(args, verdicts)
    if shard is not None:
        manifest = shards.write_partial(out, shard, scenarios, _run_options(args), fresh,
                                        [(v.spec, "diff", v) for v in jobs]
                                        + [(o.scenario.name, "ranks", o.verdict) for o in ranks])
        output.emit(args, {"shard": str(shard), "verdicts": [v.as_dict() for v in verdicts],
                           "written": sorted(map(str, fresh | {manifest})), "exit_code": code},
                    output.verdict_lines(verdicts)
                    + [f"shard {shard}: {len(only)} of {len(scenarios)} specs; wrote {len(fresh) + 1} files under {out} "
                       f"(merge the {shard.count} shards with `fpemu merge --reports {reports} --specs {args.specs}`)"])
        return code
    diff_file, written = _run_reports(reports, verdicts, ranks, golden_dir, observed_dir)
    output.emit(args, {"verdicts": [v.as_dict() for v in verdicts], "written": sorted(map(str, fresh | set(written))),
                 "exit_code": code},
          output.verdict_lines(verdicts) + output.written_lines(sorted(fresh | {diff_file} | set(written))))
    return code


def _cmd_merge(args) -> int:
    from fpemu.harness import shards
    from fpemu.specs import load_specs
    _check_specs_folder(args)
    reports = args.reports
    scenarios = load_specs([args.specs])
    partials = shards.read_partials(shards.find_partials(args.shards, reports), scenarios)
    golden_dir, observed_dir = reports / "golden", reports / "observed"
    fresh = shards.merge_files(partials, reports)
    shards.remove_stale((golden_dir, observed_dir, golden_dir / "ranks", observed_dir / "ranks"), fresh)
    jobs, ranks_verdicts = shards.merged_verdicts(partials, scenarios)
    ranks = shards.ranks_outcomes(scenarios, ranks_verdicts, golden_dir / "ranks", observed_dir / "ranks")
    verdicts = jobs + [outcome.verdict for outcome in ranks]
    diff_file, written = _run_reports(reports, verdicts, ranks, golden_dir, observed_dir)
    code = output.failure_code(verdicts) or output.nothing_compared(args, verdicts)
    output.emit(args, {"merged": [str(p.path) for p in partials], "verdicts": [v.as_dict() for v in verdicts],
                       "written": sorted(map(str, fresh | {diff_file} | set(written))), "exit_code": code},
                output.verdict_lines(verdicts) + [f"merged {len(partials)} shards of {len(scenarios)} specs"]
                + output.written_lines(sorted(fresh | {diff_file} | set(written))))
    return code


SHARD_HELP = ("run shard I of N (--shard 2/4; `slurm`: the task of a SLURM job array, from $SLURM_ARRAY_TASK_ID and "
              "$SLURM_ARRAY_TASK_COUNT; default $FPEMU_SHARD): only its specs' jobs, written as partial results into "
              "REPORTS/shards/I-of-N/; `fpemu merge` then writes the reports one run writes, byte for byte")
def _cmd_ranks(args) -> int:
    """The [ranks] cases alone: forked here, or on the world torchrun formed (every rank runs this command;
    rank 0 writes and prints, the others print nothing but errors)."""
    from fpemu.adapters.torch_ranks import env_world
    from fpemu.harness.ranks import ranks_scenarios, run_ranks
    from fpemu.reports.ranks import ranks_report
    from fpemu.specs import load_specs
    rank_timeout = _rank_timeout(args.rank_timeout)
    world = env_world()  # None: the built-in launcher
    for path in args.specs:
        if not path.exists():
            raise FpemuInputError(f"{path}: no such spec file or folder")
    if not ranks_scenarios(load_specs(args.specs)):
        raise FpemuInputError(f"{', '.join(map(str, args.specs))}: no [ranks] spec (`fpemu ranks` runs [ranks] "
                              "specs only; `fpemu run` runs every kind)")
    lead = world is None or world.rank == 0
    left_out = []
    outcomes, written = run_ranks(args.specs, args.golden, args.out, args.impl, args.exclude,
                                  output.progress(args) if lead else None, rank_timeout, world=world,
                                  left_out=left_out)
    if not lead:
        return world.exit_code()  # rank 0's (see EnvWorld.exit_code)
    verdicts = [outcome.verdict for outcome in outcomes]
    if left_out:
        output.note(args, f"note: {len(left_out)} case{'s' * (len(left_out) != 1)} left out: their world size is not "
                    f"WORLD_SIZE={world.world_size} (torchrun's): {', '.join(left_out)}")
    if args.reports is not None:
        written = list(written) + ranks_report(args.reports, outcomes)
    code = output.failure_code(verdicts) or output.nothing_compared(args, verdicts)
    launcher = (f"torchrun (env://, rank 0 of {world.world_size})" if world is not None else "built-in (forked ranks)")
    output.emit(args, {"verdicts": [v.as_dict() for v in verdicts], "written": [str(p) for p in written],
                       "left_out": left_out, "launcher": launcher, "exit_code": code},
                output.verdict_lines(verdicts) + output.written_lines(written, "traces and reports"))
    return code if world is None else world.exit_code(code)


TIMEOUT_HELP = ("seconds each job (spec x implementation) may run; a job past it is one result line, 'timed out "
                "after N s' (cannot run), and the other jobs still run (default: no limit)")


def jobs_option(cmd, executor: bool = True) -> None:
    """--jobs N (and, with ``executor``, --executor): where the command's jobs run (fpemu.harness.pool)."""
    from fpemu.harness.pool import JOBS_ENV, usable_cores
    cmd.add_argument("--jobs", metavar="N", help=f"run N jobs at once, each in a worker process of its own (default: "
                     f"${JOBS_ENV} where set, else the usable cores, {usable_cores()} here); the results, output "
                     "and files are the same at any N, and a worker that dies is its job's result line")
    if executor:
        cmd.add_argument("--executor", metavar="WHERE", help="where the jobs run: 'local' (the default: --jobs worker "
                         "processes here) or 'dask:ADDRESS', a running Dask cluster's scheduler (dask:tcp://HOST:8786; "
                         "plain 'dask': $DASK_SCHEDULER_ADDRESS), whose workers need this fpemu; the results come "
                         "back here, and what is written is the same as a local run's")


def _timed(handler):
    """``handler`` with its jobs under the command's --timeout (fpemu.harness.limits), run on --jobs worker
    processes or on the --executor cluster (fpemu.harness.pool)."""
    def run(args) -> int:
        from fpemu.harness.limits import job_timeout
        from fpemu.harness.pool import checked_executor, checked_jobs, default_jobs, job_workers
        workers = default_jobs() if args.jobs is None else checked_jobs(args.jobs)
        with job_timeout(args.timeout), job_workers(workers, checked_executor(getattr(args, "executor", None))):
            return handler(args)
    return run


def add_commands(registry) -> None:
    """golden, record, diff, audit, compare, report and run."""
    command, specs_help, impl_help, selection = (registry.command, registry.specs_help, registry.impl_help,
                                                 registry.selection)
    golden = command("golden", "write the reference (golden) trace of each spec", _timed(_cmd_golden))
    golden.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    golden.add_argument("--out", type=pathlib.Path, required=True, help="folder for the golden traces")
    golden.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="at most SECONDS for each spec's reference model: a spec past it gets no golden (its "
                             "current one is kept), one line naming it, exit 1; the other specs still run")
    jobs_option(golden)

    record = command("record", "record real implementations' traces (a baseline for `fpemu audit`); the folder "
                     "ends up holding exactly this run's traces: traces in it that this run did not write are "
                     "removed, and listed", _timed(_cmd_record))
    record.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    record.add_argument("--out", type=pathlib.Path, required=True, help="folder for the recorded traces")
    record.add_argument("--timeout", type=float, metavar="SECONDS", help=TIMEOUT_HELP)
    jobs_option(record)
    selection(record, impl_help, "exit 0 even when every job was skipped (nothing recorded) instead of 1")

    diff = command("diff", "drive real implementations through the specs and compare with golden traces",
                   _timed(_cmd_diff))
    diff.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    diff.add_argument("--golden", type=pathlib.Path, required=True, help="folder of golden traces")
    diff.add_argument("--timeout", type=float, metavar="SECONDS", help=TIMEOUT_HELP)
    jobs_option(diff)
    selection(diff, impl_help + " (default: each spec's own)")
    diff.add_argument("--save", type=pathlib.Path, help="also write the observed traces into this folder")

    audit = command("audit", "re-record a baseline's implementations here and list every behaviour change",
                    _timed(_cmd_audit))
    audit.add_argument("--baseline", type=pathlib.Path, required=True, help="folder written by `fpemu record`")
    audit.add_argument("--timeout", type=float, metavar="SECONDS", help=TIMEOUT_HELP)
    jobs_option(audit)
    selection(audit, "audit only these implementations of the baseline (a name: every device)",
              "exit 0 even when baseline implementations cannot run here (skipped) instead of 1")

    compare = command("compare", "compare any two trace files (a reference, a recording, a rerun, an upgrade, a "
                      "config change): the verdict, the first divergence, then what differs; exit 0 when identical, "
                      "1 when they differ", _cmd_compare)
    compare.add_argument("before", type=pathlib.Path, help="the first trace (e.g. the baseline)")
    compare.add_argument("after", type=pathlib.Path, help="the second trace")

    merge = command("merge-traces", "git's merge driver for trace files (base, ours, theirs): merges two branches' changes "
                    "to one golden line by line without its checksum line, then seals the result; exit 1 with "
                    "conflict markers where both changed the same lines (set-up: docs/golden.md)", _cmd_merge_traces)
    merge.add_argument("base", type=pathlib.Path, help="the common ancestor's version (%%O)")
    merge.add_argument("ours", type=pathlib.Path, help="this branch's version, replaced by the result (%%A)")
    merge.add_argument("theirs", type=pathlib.Path, help="the other branch's version (%%B)")

    report = command("report", "write reports/ from traces, diff results and benchmark results", _cmd_report)
    report.add_argument("--reports", type=pathlib.Path, default=output.DEFAULT_REPORTS, help="output folder")
    report.add_argument("--golden", type=pathlib.Path, help="folder of golden traces")
    report.add_argument("--observed", type=pathlib.Path, help="folder of observed traces (`fpemu diff --save`)")
    report.add_argument("--diff", type=pathlib.Path, help="diff results: reports/diff.json of `fpemu run`, or the "
                        "output of `fpemu diff --json`")

    run = command("run", "the main job: golden traces, diff against every installed implementation, reports",
                  _timed(_cmd_run))
    run.add_argument("--specs", type=pathlib.Path, default=output.DEFAULT_SPECS,
                     help="spec folder (default: specs/ of the current folder, i.e. run it from the checkout)")
    run.add_argument("--reports", type=pathlib.Path, default=output.RUN_REPORTS,
                     help="output folder (default: reports/local/, which git ignores; --reports reports rewrites the "
                          "committed reports, from a full install: rows that cannot run here would replace measured ones)")
    run.add_argument("--timeout", type=float, metavar="SECONDS", help=TIMEOUT_HELP)
    jobs_option(run)
    selection(run, impl_help + " (default: each spec's own)")
    run.add_argument("--rank-timeout", type=float, metavar="SECONDS",
                     help="seconds each [ranks] case may run before it counts as a hang (default: the spec's "
                          "ranks.timeout_s, else 60 + 0.05 x steps x ranks)")
    run.add_argument("--shard", metavar="I/N", help=SHARD_HELP)

    merge = command("merge", "merge the partial results of `fpemu run --shard I/N` (every shard 1..N) into the "
                    "reports one run writes, byte for byte; refuses (exit 2, naming the file) shards that do not fit "
                    "together: one missing, of another N, spec set, options (--impl, --exclude, --rank-timeout: the merge takes "
                    "the shards') or fpemu version", _cmd_merge)
    merge.add_argument("shards", nargs="*", type=pathlib.Path,
                       help="shard folders (with their shard.json), or folders of them (default: REPORTS/shards/)")
    merge.add_argument("--specs", type=pathlib.Path, default=output.DEFAULT_SPECS,
                       help="the spec folder the shards ran (default: specs/ of the current folder)")
    merge.add_argument("--reports", type=pathlib.Path, default=output.RUN_REPORTS,
                       help="output folder (default: reports/local/, as `fpemu run`)")
    merge.add_argument("--allow-skips", action="store_true",
                       help="exit 0 even when every job was skipped, as `fpemu run --allow-skips`")

    ranks = command("ranks", "run the [ranks] specs' cases on real ranks and compare every rank with fpemu's model "
                    "(as `fpemu run` does): ranks forked here, or, started by torchrun (`torchrun --nproc-per-node N "
                    "-m fpemu ranks SPEC...`), on the world torchrun formed (env://; NCCL for @cuda, gloo "
                    "otherwise): the cases of WORLD_SIZE ranks run, rank 0 writes the same per-rank traces, "
                    "verdicts and report", _cmd_ranks)
    ranks.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help + " (only [ranks] specs are run)")
    ranks.add_argument("--golden", type=pathlib.Path, required=True,
                       help="folder for fpemu's model's per-rank traces (its other traces are removed)")
    ranks.add_argument("--out", type=pathlib.Path, required=True,
                       help="folder for the real ranks' per-rank traces (its other traces are removed)")
    ranks.add_argument("--reports", type=pathlib.Path, help="also write ranks.md and plots/ranks.png into this folder")
    selection(ranks, impl_help + " (default: each spec's own)")
    ranks.add_argument("--rank-timeout", type=float, metavar="SECONDS",
                       help="seconds each case may run before it counts as a hang (default: the spec's "
                            "ranks.timeout_s, else 60 + 0.05 x steps x ranks); under torchrun rank 0 kills the "
                            "world's group past it and the next cases run in a fresh one")
