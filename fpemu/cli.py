"""The ``fpemu`` command line.

Exit codes: 0 success, 1 a divergence, a behaviour change (audit), a job that failed (api
changed, cannot run) or nothing compared (every job skipped; audit: a baseline implementation
that cannot run here) unless --allow-skips, 2 bad usage or input (a broken spec, a tampered
trace: the message names the file, key or argument), 3 an internal error (a bug in fpemu):
never mistaken for a divergence.  Every job (spec x implementation) is isolated: a framework
that fails inside one job is one result line, and the other jobs still run.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import traceback

from fpemu.errors import FpemuInputError

DEFAULT_SPECS = pathlib.Path("specs")
DEFAULT_REPORTS = pathlib.Path("reports")


def _epilog() -> str:
    from fpemu.compare.diff import STATUSES
    return ("exit codes:\n"
            "  0  success: every job compared matched (or met its declared divergence); audit: nothing changed\n"
            "  1  a divergence, a changed behaviour (audit), a failed job (api changed, cannot run), or\n"
            "     nothing compared: every job skipped, or (audit) a baseline implementation skipped here;\n"
            "     --allow-skips accepts skips\n"
            "  2  bad usage or input: the message names the file, key or argument\n"
            "  3  an internal error (a bug in fpemu; the traceback is printed); the other jobs still ran\n\n"
            "job statuses: " + ", ".join(STATUSES) + "\n\n"
            "spec format: one TOML scenario per file, described in README.md (\"The differential harness\")\n"
            "and in `python -m pydoc fpemu.specs.loader`; the checkout's specs/ holds examples of every kind.")


class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions; keeps the epilog's lines (the exit-code table) as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _progress(args):
    from fpemu.harness import stderr_progress
    return (lambda *a: None) if args.quiet else stderr_progress


def _emit(args, payload: dict, lines) -> None:
    if args.json:
        print(json.dumps(payload, indent=1, sort_keys=True))
    else:
        for line in lines:
            print(line)


def _written_lines(paths, what: str = "files") -> list:
    """One line per file for a few, else one line per run: 'wrote N files under DIR'."""
    paths = [pathlib.Path(p) for p in paths]
    if len(paths) <= 3:
        return [f"wrote {p}" for p in paths]
    root = pathlib.Path(os.path.commonpath([str(p.parent) for p in paths]))
    return [f"wrote {len(paths)} {what} under {root}"]


def _status_counts(verdicts) -> str:
    from fpemu.compare.diff import STATUSES
    counts = [(status, sum(v.status == status for v in verdicts)) for status in STATUSES]
    return ", ".join(f"{count} {status}" for status, count in counts if count) or "none"


def _job_line(v) -> str:
    """One result line: status, spec / implementation, and what happened."""
    from fpemu.compare.diff import JOB_FAILURES, SKIPPED
    line = f"{v.status:>16}  {v.spec} / {v.implementation}"
    if v.status in JOB_FAILURES or v.status == SKIPPED:
        if v.packages and v.status != SKIPPED:
            line += " (" + ", ".join(f"{k} {ver}" for k, ver in sorted(v.packages.items())) + ")"
        return line + (f": {v.note}" if v.note else "")
    if v.divergence is not None:
        line += f": first divergence at {v.divergence.describe()}"
    if v.note:
        line += f" [{v.note}]"
    return line


def _verdict_lines(verdicts) -> list:
    jobs = len(verdicts)
    return [_job_line(v) for v in verdicts] + [f"{jobs} job{'s' * (jobs != 1)}: {_status_counts(verdicts)}"]


def _failure_code(verdicts) -> int:
    """The exit code the jobs' statuses ask for: 3 for an internal error, 1 for any other failure."""
    from fpemu.compare.diff import STATUSES
    return max((STATUSES[v.status][2] for v in verdicts), default=0)


def _note(args, message: str) -> None:
    print(f"fpemu {args.command}: {message}", file=sys.stderr)


def _nothing_compared(args, verdicts, noun: str = "compared") -> int:
    """1 (with a message naming each skipped implementation and why) when every job was skipped,
    unless --allow-skips; else 0."""
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import skipped_summary
    if not verdicts or any(v.status != SKIPPED for v in verdicts):
        return 0
    message = f"nothing {noun}: every job was skipped: {skipped_summary(verdicts)}"
    if args.allow_skips:
        _note(args, f"note: {message} (accepted: --allow-skips)")
        return 0
    _note(args, f"error: {message}; pass --allow-skips to accept a run that compares nothing")
    return 1


def _cmd_golden(args) -> int:
    from fpemu.harness import write_golden
    written = write_golden(args.specs, args.out, _progress(args))
    _emit(args, {"written": [str(p) for p in written]}, _written_lines(written, "golden traces"))
    return 0


def _cmd_record(args) -> int:
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import record
    done = record(args.specs, args.out, args.impl, _progress(args), excluded=args.exclude)
    lines = _written_lines(done.written, "traces")
    lines += [_job_line(v) for v in done.unrecorded]
    if done.removed:
        lines.append(f"removed {len(done.removed)} stale trace{'s' * (len(done.removed) != 1)} from {args.out} "
                     f"(not written by this run): {', '.join(p.name for p in done.removed)}")
    jobs = len(done.written) + len(done.unrecorded)
    lines.append(f"{jobs} job{'s' * (jobs != 1)}: {len(done.written)} recorded"
                 + (f", {_status_counts(done.unrecorded)}" if done.unrecorded else ""))
    code = _failure_code(done.unrecorded) or (0 if done.written else _nothing_compared(args, done.unrecorded,
                                                                                       "recorded"))
    _emit(args, {"written": [str(p) for p in done.written], "removed": [str(p) for p in done.removed],
                 "unrecorded": [v.as_dict() for v in done.unrecorded],
                 "skipped": [[v.spec, v.implementation, v.note] for v in done.unrecorded if v.status == SKIPPED],
                 "exit_code": code}, lines)
    return code


def _cmd_diff(args) -> int:
    from fpemu.harness import diff
    verdicts = diff(args.specs, args.golden, args.impl, args.save, _progress(args), excluded=args.exclude)
    code = _failure_code(verdicts) or _nothing_compared(args, verdicts)
    _emit(args, {"verdicts": [v.as_dict() for v in verdicts], "exit_code": code}, _verdict_lines(verdicts))
    return code


def _cmd_audit(args) -> int:
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import audit, skipped_summary
    changes, unchanged, problems = audit(args.baseline, _progress(args), args.impl, args.exclude)
    skipped = [v for v in problems if v.status == SKIPPED]
    failed = [v for v in problems if v.status != SKIPPED]
    lines = [f"{unchanged} recorded behaviours unchanged, {len(changes)} changed, {len(skipped)} skipped"
             + (f", {len(failed)} failed ({_status_counts(failed)})" if failed else "")]
    for change in changes:
        before = ", ".join(f"{k} {v}" for k, v in sorted(change.packages_before.items()))
        now = ", ".join(f"{k} {v}" for k, v in sorted(change.packages_now.items()))
        lines.append(f"CHANGED {change.spec} / {change.implementation}: "
                     f"{change.verdict.divergence.describe('baseline', 'now')}")
        lines.append(f"        baseline: {before}  ->  now: {now}")
    lines += [_job_line(v) for v in problems]
    code = max(_failure_code(failed), 1 if changes else 0)
    if skipped and not code:
        message = (f"{len(skipped)} baseline behaviour{'s' * (len(skipped) != 1)} not audited, their "
                   f"implementation cannot run here: {skipped_summary(skipped)}")
        if args.allow_skips:
            _note(args, f"note: {message} (accepted: --allow-skips)")
        else:
            _note(args, f"error: {message}; pass --allow-skips to accept an audit that leaves them out")
            code = 1
    payload = {"unchanged": unchanged, "exit_code": code,
               "skipped": [[v.spec, v.implementation, v.note] for v in skipped],
               "failed": [v.as_dict() for v in failed],
               "changes": [{"spec": c.spec, "implementation": c.implementation, "baseline": c.baseline_path,
                            "packages_before": c.packages_before, "packages_now": c.packages_now,
                            "divergence": c.verdict.as_dict()["divergence"]} for c in changes]}
    _emit(args, payload, lines)
    return code


def _cmd_report(args) -> int:
    from fpemu.reports import write_all
    for name, path, folder in (("--golden", args.golden, True), ("--observed", args.observed, True),
                               ("--diff", args.diff, False)):
        if path is not None and not (path.is_dir() if folder else path.is_file()):
            raise FpemuInputError(f"{name} {path}: no such {'folder' if folder else 'file'}")
    if args.golden is not None and args.diff is None and not args.quiet:
        _note(args, "note: no --diff: harness.md shows the golden traces but no comparisons; pass --diff with "
                    "the JSON of `fpemu diff ... --json > diff.json` (or reports/diff.json, written by `fpemu run`), "
                    "and --observed with the folder of `fpemu diff --save`")
    written = write_all(args.reports, golden_dir=args.golden, observed_dir=args.observed, diff_file=args.diff)
    _emit(args, {"written": [str(p) for p in written]}, _written_lines(written))
    return 0


def _cmd_run(args) -> int:
    from fpemu.compare.diff import JOB_FAILURES, SKIPPED
    from fpemu.harness import diff, write_golden
    from fpemu.reports import write_all
    from fpemu.traces import trace_filename
    from fpemu.fileio import atomic_write
    if not args.specs.exists():
        where = "the current folder" if args.specs == DEFAULT_SPECS else str(args.specs.parent)
        raise FpemuInputError(f"{args.specs}: no such spec file or folder in {where}; `fpemu run` reads the "
                              "specs/ folder of an fpemu checkout: run it from the checkout's root, or pass "
                              "--specs FOLDER (and --reports FOLDER for the output)")
    reports = args.reports
    golden_dir, observed_dir = reports / "golden", reports / "observed"
    progress = _progress(args)
    fresh = set(write_golden([args.specs], golden_dir, progress))
    verdicts = diff([args.specs], golden_dir, args.impl, observed_dir, progress, allow_none=not args.impl,
                    excluded=args.exclude)
    fresh |= {observed_dir / trace_filename(v.spec, v.implementation) for v in verdicts
              if v.status != SKIPPED and v.status not in JOB_FAILURES}
    for folder in (golden_dir, observed_dir):  # traces of specs that no longer exist would haunt the report
        for stale in set(folder.glob("*.json")) - fresh:
            stale.unlink()
    diff_file = atomic_write(reports / "diff.json",
                             json.dumps({"verdicts": [v.as_dict() for v in verdicts]}, indent=1, sort_keys=True) + "\n")
    written = write_all(reports, golden_dir=golden_dir, observed_dir=observed_dir, diff_file=diff_file)
    code = _failure_code(verdicts) or _nothing_compared(args, verdicts)
    _emit(args, {"verdicts": [v.as_dict() for v in verdicts], "written": sorted(map(str, fresh | set(written))),
                 "exit_code": code},
          _verdict_lines(verdicts) + _written_lines(sorted(fresh | {diff_file} | set(written))))
    return code


def _cmd_env_build(args) -> int:
    from fpemu.harness import environments
    built = environments.environment_python(args.name) is not None  # an unknown name fails here, exit 2
    if not built and not args.quiet:
        print(f"building {args.name}: {' '.join(environments.requirements_of(args.name))} (pip, minutes)",
              file=sys.stderr)
    folder = environments.build_environment(args.name)
    manifest = environments.environment_manifest(args.name)
    line = f"{args.name} is built at {folder}"
    if not built:
        line += f" ({manifest['build_seconds']:.0f} s, {manifest['size_bytes'] / 2**20:.0f} MiB)"
    _emit(args, {"name": args.name, "folder": str(folder), "built_now": not built, "manifest": manifest}, [line])
    return 0


def _cmd_env_list(args) -> int:
    from fpemu.harness import environments
    rows = []
    for name, requirements in environments.ENVIRONMENTS.items():
        python = environments.environment_python(name)
        rows.append({"name": name, "requirements": list(requirements), "python": python and str(python)})
    _emit(args, {"environments": rows},
          [f"{r['name']:<12} {r['python'] or 'not built'}  ({' '.join(r['requirements'])})" for r in rows])
    return 0


def _add_env_commands(sub) -> None:
    env_help = "isolated environments for packages that conflict with fpemu's own (paddle, tf_keras)"
    env = sub.add_parser("env", help=env_help, description=env_help)
    actions = env.add_subparsers(dest="env_command", required=True)
    for name, help_text, handler in (("build", "build an environment (instant when built)", _cmd_env_build),
                                     ("list", "list the environments and where they are built", _cmd_env_list)):
        action = actions.add_parser(name, help=help_text, description=help_text)
        action.add_argument("--json", action="store_true", help="print a JSON result on stdout (for CI)")
        action.add_argument("--quiet", action="store_true", help="no progress on stderr")
        action.set_defaults(handler=handler)
        if name == "build":
            action.add_argument("name", help="the environment's name (see `fpemu env list`)")


def build_parser() -> argparse.ArgumentParser:
    epilog = _epilog()
    parser = argparse.ArgumentParser(prog="fpemu", description="Bit-exact emulation of number formats and loss "
                                     "scaling, and a differential harness against real implementations.",
                                     epilog=epilog, formatter_class=_Formatter)
    from fpemu import __version__
    parser.add_argument("--version", action="version", version=f"fpemu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help_text, handler):
        cmd = sub.add_parser(name, help=help_text, description=help_text, epilog=epilog,
                             formatter_class=_Formatter)
        cmd.add_argument("--json", action="store_true", help="print a JSON result on stdout (for CI)")
        cmd.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
        cmd.set_defaults(handler=handler)
        return cmd

    specs_help = "spec files or folders of *.toml specs"
    from fpemu.adapters import adapters_of_kind
    impl_help = (f"implementations to drive: {', '.join(adapters_of_kind('scaler'))}, and "
                 f"{', '.join(adapters_of_kind('step'))} for [step] specs (add @cuda for the GPU)")
    exclude_help = "implementations to leave out (a name leaves out every device; name@cuda only that one)"
    skips_help = ("exit 0 even when every job was skipped (a framework, environment or device missing here)"
                  " instead of 1")

    def selection(cmd, impl_text, skips_text=skips_help):
        cmd.add_argument("--impl", nargs="+", help=impl_text)
        cmd.add_argument("--exclude", nargs="+", help=exclude_help)
        cmd.add_argument("--allow-skips", action="store_true", help=skips_text)

    golden = command("golden", "write the reference (golden) trace of each spec", _cmd_golden)
    golden.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    golden.add_argument("--out", type=pathlib.Path, required=True, help="folder for the golden traces")

    record = command("record", "record real implementations' traces (a baseline for `fpemu audit`); the folder "
                     "ends up holding exactly this run's traces: traces in it that this run did not write are "
                     "removed, and listed", _cmd_record)
    record.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    record.add_argument("--out", type=pathlib.Path, required=True, help="folder for the recorded traces")
    selection(record, impl_help, "exit 0 even when every job was skipped (nothing recorded) instead of 1")

    diff = command("diff", "drive real implementations through the specs and compare with golden traces", _cmd_diff)
    diff.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    diff.add_argument("--golden", type=pathlib.Path, required=True, help="folder of golden traces")
    selection(diff, impl_help + " (default: each spec's own)")
    diff.add_argument("--save", type=pathlib.Path, help="also write the observed traces into this folder")

    audit = command("audit", "re-record a baseline's implementations here and list every behaviour change",
                    _cmd_audit)
    audit.add_argument("--baseline", type=pathlib.Path, required=True, help="folder written by `fpemu record`")
    selection(audit, "audit only these implementations of the baseline (a name: every device)",
              "exit 0 even when baseline implementations cannot run here (skipped) instead of 1")

    report = command("report", "write reports/ from traces, diff results and benchmark results", _cmd_report)
    report.add_argument("--reports", type=pathlib.Path, default=DEFAULT_REPORTS, help="output folder")
    report.add_argument("--golden", type=pathlib.Path, help="folder of golden traces")
    report.add_argument("--observed", type=pathlib.Path, help="folder of observed traces (`fpemu diff --save`)")
    report.add_argument("--diff", type=pathlib.Path, help="diff results: reports/diff.json of `fpemu run`, or the "
                        "output of `fpemu diff --json`")

    run = command("run", "the main job: golden traces, diff against every installed implementation, reports",
                  _cmd_run)
    run.add_argument("--specs", type=pathlib.Path, default=DEFAULT_SPECS,
                     help="spec folder (default: specs/ of the current folder, i.e. run it from the checkout)")
    run.add_argument("--reports", type=pathlib.Path, default=DEFAULT_REPORTS, help="output folder (default: reports/)")
    selection(run, impl_help + " (default: each spec's own)")

    _add_env_commands(sub)
    return parser


def _fail(args, message: str, code: int = 2) -> int:
    print(f"fpemu {args.command}: error: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"error": message, "exit_code": code}))
    return code


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.handler(args)
    except FpemuInputError as error:
        return _fail(args, str(error))
    except OSError as error:  # an output path that cannot be written (a file where a folder must be, ...)
        where = f"{error.filename}: " if error.filename else ""
        return _fail(args, f"cannot write {where}{error.strerror or error}")
    except Exception as error:  # noqa: BLE001 -- anything else is a crash, reported as one
        traceback.print_exc(file=sys.stderr)
        return _fail(args, f"unexpected {type(error).__name__}: {error}", code=3)


if __name__ == "__main__":
    sys.exit(main())
