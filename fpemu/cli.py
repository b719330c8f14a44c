"""The ``fpemu`` command line.

Exit codes: 0 success, 1 a divergence (or, for audit, a behaviour change) was
found, 2 bad usage or input (a broken spec, a tampered trace: the message names
the file), 3 an unexpected error (a bug in fpemu, or a framework that crashed):
never mistaken for a divergence.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import traceback

from fpemu.errors import FpemuInputError

DEFAULT_SPECS = pathlib.Path("specs")
DEFAULT_REPORTS = pathlib.Path("reports")


def _progress(args):
    from fpemu.harness import stderr_progress
    return (lambda *a: None) if args.quiet else stderr_progress


def _emit(args, payload: dict, lines) -> None:
    if args.json:
        print(json.dumps(payload, indent=1, sort_keys=True))
    else:
        for line in lines:
            print(line)


def _cmd_golden(args) -> int:
    from fpemu.harness import write_golden
    written = write_golden(args.specs, args.out, _progress(args))
    _emit(args, {"written": [str(p) for p in written]}, [f"wrote {p}" for p in written])
    return 0


def _cmd_record(args) -> int:
    from fpemu.harness import record
    written, skipped = record(args.specs, args.out, args.impl, _progress(args))
    skips = [f"skipped {spec} / {impl}: {why}" for spec, impl, why in skipped]
    if not written:
        return _fail(args, "nothing recorded, every implementation was skipped: " + "; ".join(skips))
    _emit(args, {"written": [str(p) for p in written], "skipped": [list(s) for s in skipped]},
          [f"wrote {p}" for p in written] + skips)
    return 0


def _verdict_lines(verdicts) -> list:
    lines = []
    for v in verdicts:
        line = f"{v.status:>16}  {v.spec} / {v.implementation}"
        if v.divergence is not None:
            line += f": first divergence at {v.divergence.describe()}"
        if v.note:
            line += f" [{v.note}]"
        lines.append(line)
    failed = sum(v.failed for v in verdicts)
    lines.append(f"{len(verdicts)} comparisons, {failed} diverged")
    return lines


def _cmd_diff(args) -> int:
    from fpemu.harness import diff
    verdicts = diff(args.specs, args.golden, args.impl, args.save, _progress(args))
    _emit(args, {"verdicts": [v.as_dict() for v in verdicts]}, _verdict_lines(verdicts))
    return 1 if any(v.failed for v in verdicts) else 0


def _cmd_audit(args) -> int:
    from fpemu.harness import audit
    changes, unchanged, skipped = audit(args.baseline, _progress(args))
    lines = [f"{unchanged} recorded behaviours unchanged, {len(changes)} changed, {len(skipped)} skipped"]
    for change in changes:
        before = ", ".join(f"{k} {v}" for k, v in sorted(change.packages_before.items()))
        now = ", ".join(f"{k} {v}" for k, v in sorted(change.packages_now.items()))
        lines.append(f"CHANGED {change.spec} / {change.implementation}: "
                     f"{change.verdict.divergence.describe('baseline', 'now')}")
        lines.append(f"        baseline: {before}  ->  now: {now}")
    lines += [f"skipped {path}: {reason}" for path, reason in skipped]
    payload = {"unchanged": unchanged, "skipped": [list(s) for s in skipped],
               "changes": [{"spec": c.spec, "implementation": c.implementation, "baseline": c.baseline_path,
                            "packages_before": c.packages_before, "packages_now": c.packages_now,
                            "divergence": c.verdict.as_dict()["divergence"]} for c in changes]}
    _emit(args, payload, lines)
    return 1 if changes else 0


def _cmd_report(args) -> int:
    from fpemu.reports import write_all
    for name, path, folder in (("--golden", args.golden, True), ("--observed", args.observed, True),
                               ("--diff", args.diff, False)):
        if path is not None and not (path.is_dir() if folder else path.is_file()):
            raise FpemuInputError(f"{name} {path}: no such {'folder' if folder else 'file'}")
    written = write_all(args.reports, golden_dir=args.golden, observed_dir=args.observed, diff_file=args.diff)
    _emit(args, {"written": [str(p) for p in written]}, [f"wrote {p}" for p in written])
    return 0


def _cmd_run(args) -> int:
    from fpemu.compare import SKIPPED
    from fpemu.harness import diff, write_golden
    from fpemu.reports import write_all
    from fpemu.traces import trace_filename
    from fpemu.fileio import atomic_write
    reports = args.reports
    golden_dir, observed_dir = reports / "golden", reports / "observed"
    progress = _progress(args)
    fresh = set(write_golden([args.specs], golden_dir, progress))
    verdicts = diff([args.specs], golden_dir, None, observed_dir, progress, allow_none=True)
    fresh |= {observed_dir / trace_filename(v.spec, v.implementation) for v in verdicts if v.status != SKIPPED}
    for folder in (golden_dir, observed_dir):  # traces of specs that no longer exist would haunt the report
        for stale in set(folder.glob("*.json")) - fresh:
            stale.unlink()
    diff_file = atomic_write(reports / "diff.json",
                             json.dumps({"verdicts": [v.as_dict() for v in verdicts]}, indent=1, sort_keys=True) + "\n")
    written = write_all(reports, golden_dir=golden_dir, observed_dir=observed_dir, diff_file=diff_file)
    _emit(args, {"verdicts": [v.as_dict() for v in verdicts], "written": [str(p) for p in written]},
          _verdict_lines(verdicts) + [f"wrote {p}" for p in written])
    return 1 if any(v.failed for v in verdicts) else 0


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
    parser = argparse.ArgumentParser(prog="fpemu", description="Bit-exact emulation of number formats and loss "
                                     "scaling, and a differential harness against real implementations.")
    from fpemu import __version__
    parser.add_argument("--version", action="version", version=f"fpemu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help_text, handler):
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("--json", action="store_true", help="print a JSON result on stdout (for CI)")
        cmd.add_argument("--quiet", action="store_true", help="no progress bar on stderr")
        cmd.set_defaults(handler=handler)
        return cmd

    specs_help = "spec files or folders of *.toml specs"
    from fpemu.adapters import adapters_of_kind
    impl_help = (f"implementations to drive: {', '.join(adapters_of_kind('scaler'))}, and "
                 f"{', '.join(adapters_of_kind('step'))} for [step] specs (add @cuda for the GPU)")
    golden = command("golden", "write the reference (golden) trace of each spec", _cmd_golden)
    golden.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    golden.add_argument("--out", type=pathlib.Path, required=True, help="folder for the golden traces")

    record = command("record", "record real implementations' traces (a baseline for `fpemu audit`)", _cmd_record)
    record.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    record.add_argument("--out", type=pathlib.Path, required=True, help="folder for the recorded traces")
    record.add_argument("--impl", nargs="+", help=impl_help)

    diff = command("diff", "drive real implementations through the specs and compare with golden traces", _cmd_diff)
    diff.add_argument("specs", nargs="+", type=pathlib.Path, help=specs_help)
    diff.add_argument("--golden", type=pathlib.Path, required=True, help="folder of golden traces")
    diff.add_argument("--impl", nargs="+", help=impl_help + " (default: each spec's own)")
    diff.add_argument("--save", type=pathlib.Path, help="also write the observed traces into this folder")

    audit = command("audit", "re-record a baseline's implementations here and list every behaviour change",
                    _cmd_audit)
    audit.add_argument("--baseline", type=pathlib.Path, required=True, help="folder written by `fpemu record`")

    report = command("report", "write reports/ from traces, diff results and benchmark results", _cmd_report)
    report.add_argument("--reports", type=pathlib.Path, default=DEFAULT_REPORTS, help="output folder")
    report.add_argument("--golden", type=pathlib.Path, help="folder of golden traces")
    report.add_argument("--observed", type=pathlib.Path, help="folder of observed traces")
    report.add_argument("--diff", type=pathlib.Path, help="diff.json written by `fpemu run`")

    run = command("run", "the main job: golden traces, diff against every installed implementation, reports",
                  _cmd_run)
    run.add_argument("--specs", type=pathlib.Path, default=DEFAULT_SPECS, help="spec folder (default: specs/)")
    run.add_argument("--reports", type=pathlib.Path, default=DEFAULT_REPORTS, help="output folder (default: reports/)")
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
