"""The environment commands: env (isolated environments for conflicting packages), matrix (a spec x version
matrix in one environment per version set) and bisect (where a recorded behaviour changed)."""

from __future__ import annotations

import pathlib
import sys

from fpemu.cli import output
from fpemu.errors import FpemuInputError


def _cmd_env_build(args) -> int:
    from fpemu import environments
    built = environments.environment_python(args.name) is not None  # an unknown name fails here, exit 2
    if not built and not args.quiet:
        print(f"building {args.name}: {' '.join(environments.requirements_of(args.name))} (pip, minutes)",
              file=sys.stderr)
    folder = environments.build_environment(args.name)
    manifest = environments.environment_manifest(args.name)
    line = f"{args.name} is built at {folder}"
    if not built:
        line += f" ({manifest['build_seconds']:.0f} s, {manifest['size_bytes'] / 2**20:.0f} MiB)"
    output.emit(args, {"name": args.name, "folder": str(folder), "built_now": not built, "manifest": manifest}, [line])
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return "just now"


def _env_row(entry, now: float) -> dict:
    return {"name": entry.name, "folder": str(entry.folder), "versions": entry.versions,
            "python": None if entry.building else str(entry.folder / "bin" / "python"),
            "size_bytes": entry.size_bytes, "last_used": entry.last_used, "building": entry.building,
            "text": f"{entry.name:<40} {'building' if entry.building else _age(now - entry.last_used):>12} "
                    f"{entry.size_bytes / 2**20:>8.0f} MiB  "
                    + (" ".join(f"{k} {v}" for k, v in entry.versions.items()) or "-")}


def _cmd_env_list(args) -> int:
    import time
    from fpemu import environments
    now = time.time()
    rows = [_env_row(entry, now) for entry in environments.cached_environments()]
    unbuilt = [name for name in environments.ENVIRONMENTS if environments.environment_python(name) is None]
    total = sum(r["size_bytes"] for r in rows)
    cap = environments.size_cap()
    output.emit(args, {"root": str(environments.environments_root()), "environments": rows, "unbuilt": unbuilt,
                       "total_bytes": total, "size_cap_bytes": cap},
                [f"{'environment':<40} {'last used':>12} {'size':>12}  versions"] + [r["text"] for r in rows]
                + [f"{len(rows)} environments, {total / 2**20:.0f} MiB in {environments.environments_root()}"
                   + (f" (cap {cap / 2**20:.0f} MiB)" if cap else "")]
                + ([f"not built: {', '.join(unbuilt)} (`fpemu env build NAME`)"] if unbuilt else []))
    return 0


def _cmd_env_prune(args) -> int:
    import time
    from fpemu import environments
    if not (args.all or args.older_than is not None or args.max_size is not None):
        raise FpemuInputError("fpemu env prune: give --older-than DAYS, --max-size SIZE or --all")
    if args.older_than is not None and not args.older_than >= 0:
        raise FpemuInputError(f"--older-than: expected a number of days >= 0, got {args.older_than!r}")
    max_bytes = environments.parse_size(args.max_size, "--max-size") if args.max_size is not None else None
    removed = environments.prune_environments(None if args.older_than is None else args.older_than * 86400,
                                              max_bytes, args.all, args.dry_run)
    now = time.time()
    rows = [_env_row(entry, now) for entry in removed]
    verb = "would remove" if args.dry_run else "removed"
    freed = sum(r["size_bytes"] for r in rows)
    output.emit(args, {"removed": rows, "dry_run": args.dry_run, "freed_bytes": freed},
                [f"{verb} {r['text']}" for r in rows] + [f"{verb} {len(rows)} environments, {freed / 2**20:.0f} MiB"])
    return 0


_ENV_HELP = ("isolated environments: the named ones for packages that conflict with fpemu's own (paddle, tf_keras) "
             "and those `fpemu matrix` and `fpemu bisect` build per version set.  They are cached in $FPEMU_ENV_DIR "
             "(default ~/.cache/fpemu/envs); $FPEMU_ENV_MAX_SIZE (20G, 512M) caps the cache: after each build the "
             "least recently used environments go until it fits")
_PRUNE_HELP = ("remove cached environments: by last use (--older-than), down to a size (--max-size, least recently "
               "used first) or all; never a build in progress or an environment used in the last 10 minutes")


def _add_env_commands(sub) -> None:
    env = sub.add_parser("env", help=_ENV_HELP, description=_ENV_HELP)
    actions = env.add_subparsers(dest="env_command", required=True)
    for name, help_text, handler in (("build", "build an environment (instant when built)", _cmd_env_build),
                                     ("list", "list the cached environments (name, last use, size, versions) and "
                                              "the named ones not built", _cmd_env_list),
                                     ("prune", _PRUNE_HELP, _cmd_env_prune)):
        action = actions.add_parser(name, help=help_text, description=help_text + f". {_ENV_HELP}")
        action.add_argument("--json", action="store_true", help="print a JSON result on stdout (for CI)")
        action.add_argument("--quiet", action="store_true", help="no progress on stderr")
        action.set_defaults(handler=handler)
        if name == "build":
            action.add_argument("name", help="the environment's name (see `fpemu env list`)")
        if name == "prune":
            action.add_argument("--older-than", type=float, metavar="DAYS", help="remove those last used before this")
            action.add_argument("--max-size", metavar="SIZE", help="then remove the least recently used until the "
                                                                   "cache is at most SIZE (20G, 512M)")
            action.add_argument("--all", action="store_true", help="remove every environment")
            action.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


_MATRIX_HELP = ("record the specs in one isolated environment per set of package versions and write "
                "reports/upgrades.md: a row per spec and implementation, a column per version, the change points "
                "marked.  Runs from a checkout or an installed fpemu (each environment imports the same fpemu files), "
                "on your own specs and, with a plan's [run] command, your own loop.  Refuses (exit 2) before any "
                "install when a set cannot run any job (--impl jmp with no jmp in the set).  Exit 0 when written "
                "(changes and failing cells are results), 1 when no cell was recorded (every set skipped or could "
                "not install), 3 when fpemu crashed in a set.  Writes upgrades/NAME.json, upgrades.md and the index "
                "README.md under --reports, and never overwrites an upgrades.md or README.md it did not write")
_BISECT_HELP = ("find each released version of a package where a recorded behaviour changed (changes may flip "
                "back); tests every --stride-th version, then bisects each gap whose ends differ; writes its "
                "section of reports/upgrades.md")


def _stderr_line(args):
    def show(text):
        if not args.quiet:
            print(f"fpemu {args.command}: {text}", file=sys.stderr, flush=True)
    return show


def _axes(args) -> dict:
    from fpemu.harness.matrix import PACKAGES
    return {package: getattr(args, _dest(package)) for package in PACKAGES if getattr(args, _dest(package))}


def _dest(package: str) -> str:
    return "versions_" + package.replace("-", "_")


def _column_lines(results) -> list:
    from fpemu.harness.matrix import RECORDED
    lines = []
    for index, column in enumerate(results["columns"]):
        statuses = {}
        for row in results["rows"]:
            status = row["cells"][index]["status"]
            statuses[status] = statuses.get(status, 0) + 1
        counts = ", ".join(f"{n} {s}" for s, n in sorted(statuses.items(), key=lambda item: item[0] != RECORDED))
        lines.append(f"{column['label']}: {counts or 'no jobs'}" + (f" ({column['problem']})" if column["problem"] else ""))
    return lines


def _timed_out_lines(results) -> list:
    """One line per job past --timeout: its cell says so (``cannot run``), and the other jobs still ran."""
    return [f"  {row['spec']} / {row['implementation']} in {column['label']}: {cell['status']}: {cell['note']}"
            for row in results["rows"] for column, cell in zip(results["columns"], row["cells"])
            if "(--timeout)" in cell["note"]]


def _recorded_nothing(results) -> bool:
    from fpemu.harness.matrix import RECORDED
    return not any(cell["status"] == RECORDED for row in results["rows"] for cell in row["cells"])


def _exit_code(results) -> int:
    """3 where fpemu crashed in a set, 1 where no cell was recorded (every set skipped or could not install:
    a matrix that compared nothing), else 0 (changes and failing cells are results)."""
    from fpemu.compare.diff import INTERNAL_ERROR
    crashed = any(c["problem_status"] == INTERNAL_ERROR for c in results["columns"])
    crashed |= any(cell["status"] == INTERNAL_ERROR for row in results["rows"] for cell in row["cells"])
    return 3 if crashed else 1 if _recorded_nothing(results) else 0


def _finish(args, results, extra_lines=()) -> int:
    from fpemu.reports.upgrades import change_lines, write_results
    written, left = write_results(args.reports, results)
    code = _exit_code(results)
    nothing = (["nothing was recorded: no set ran any job (see each set's cells above); no change can be read"]
               if _recorded_nothing(results) else [])
    output.emit(args, {**results, "written": [str(p) for p in written], "left_alone": [str(p) for p in left],
                       "exit_code": code},
                _column_lines(results) + _timed_out_lines(results) + list(extra_lines) + nothing
                + ([] if nothing else ["changes:"] + [f"  {line[2:]}" for line in change_lines(results)])
                + output.written_lines(written)
                + [f"left {p} as it is: fpemu did not write it" for p in left])
    return code


def _cmd_matrix(args) -> int:
    from fpemu.harness.matrix import load_plan, plan_from_options
    axes = _axes(args)
    if args.plan is not None:
        if axes or args.specs or args.name:
            raise FpemuInputError("give either a plan file or --name, --specs and version options, not both")
        plan = load_plan(args.plan)
    else:
        if not (args.name and args.specs and axes):
            raise FpemuInputError("without a plan file, give --name, --specs and at least one version option "
                                  "(e.g. --jax 0.4.31,0.10.2)")
        plan = plan_from_options(args.name, args.specs, axes, tuple(args.with_ or ()), args.impl)
    from fpemu.harness import shards
    from fpemu.harness.matrix import default_traces_root, plan_results, record_columns
    traces = args.traces or default_traces_root(plan.name)
    shard = shards.requested_shard(args.shard)
    if args.merge:
        if shard is not None:
            raise FpemuInputError(f"--merge merges every shard: give it without --shard (or ${shards.SHARD_ENV})")
        return _finish(args, plan_results(plan, shards.merge_matrix(traces, plan)))
    show = _stderr_line(args)
    sets = shards.matrix_shard_sets(plan, shard) if shard is not None else plan.sets
    show(f"{len(sets)} version sets" + (f" of {len(plan.sets)} (shard {shard})" if shard is not None else "")
         + "; environments are cached, a new one takes a pip install")
    columns = record_columns(plan, sets, traces, lambda done, total, label: show(f"[{done}/{total}] {label}"))
    if shard is None:
        return _finish(args, plan_results(plan, columns))
    manifest = shards.write_matrix_partial(traces, plan, shard, columns)
    from fpemu.harness.matrix import matrix_results
    results = matrix_results(plan.name, columns, {})  # this shard's columns, for the result lines and exit code
    code = _exit_code(results) if columns else 0
    output.emit(args, {**results, "shard": str(shard), "written": [str(manifest)], "exit_code": code},
                _column_lines(results) + _timed_out_lines(results) + [f"shard {shard}: {len(sets)} of {len(plan.sets)} sets; wrote {manifest.parent} "
                                          f"(merge the {shard.count} shards with `fpemu matrix ... --merge`"
                                          + (f" --traces {args.traces}" if args.traces else "") + ")"])
    return code


def _cmd_bisect(args) -> int:
    from fpemu.harness.bisect import bisect_package, bisection_results, pip_versions, versions_in_range
    from fpemu.harness.matrix import MatrixPlan, default_traces_root
    name = args.name or f"bisect_{args.package.replace('-', '_')}"
    listed = [v.strip() for v in args.versions.split(",") if v.strip()] if args.versions else pip_versions(args.package)
    versions = versions_in_range(listed, args.low, args.high, args.pre)
    from fpemu.specs import load_specs
    implementations = ", ".join(args.impl) if args.impl else "each spec's own implementations"
    described = (f"Where {args.package} changed the behaviour of {', '.join(s.name for s in load_specs(args.specs))} "
                 f"({implementations}): `fpemu bisect "
                 f"{args.package} --from {versions[0]} --to {versions[-1]} --stride {args.stride}`"
                 + (f" with {' '.join(args.with_)}." if args.with_ else "."))
    plan = MatrixPlan(name, tuple(str(pathlib.Path(s).resolve()) for s in args.specs), (),
                      tuple(args.impl) if args.impl else None, described)
    show = _stderr_line(args)
    first = len(dict.fromkeys(versions[::args.stride] + versions[-1:]))
    cost = ("one environment per version" if args.stride == 1 else
            f"{first} environments first, then about log2({args.stride}) more per change found")
    show(f"{len(versions)} versions of {args.package} ({versions[0]} to {versions[-1]}); stride {args.stride}: {cost}")
    found = bisect_package(plan, args.package, versions, args.stride, args.traces or default_traces_root(name),
                           tuple(args.with_ or ()), lambda done, version: show(f"[{done} tested] {args.package} {version}"))
    cost = (f"{len(found.tested)} environments for {len(versions)} versions"
            + (f"; {len(found.cannot_install)} could not install: {', '.join(found.cannot_install)}"
               if found.cannot_install else ""))
    return _finish(args, bisection_results(name, args.package, plan, found), [cost])


def _add_matrix_commands(command, specs_help: str, impl_help: str) -> None:
    """Add ``matrix`` and ``bisect`` through the registry's ``command(name, help, handler)`` factory."""
    from fpemu.harness.matrix import PACKAGES
    from fpemu.reports.upgrades import REPORT
    from fpemu.cli.harness import _timed
    matrix = command("matrix", _MATRIX_HELP, _timed(_cmd_matrix))
    matrix.add_argument("plan", nargs="?", type=pathlib.Path,
                        help="a TOML plan (name, specs, impl, with, [versions] axes and/or [[set]] tables; see "
                             "matrices/ in the checkout) instead of the options below")
    matrix.add_argument("--name", help="the matrix's name: its section of upgrades.md and its results file")
    matrix.add_argument("--specs", nargs="+", type=pathlib.Path, help=specs_help)
    for package in PACKAGES:
        matrix.add_argument(f"--{package}", dest=_dest(package), metavar="V1,V2",
                            help=f"{package} versions, one column each (several options: every combination)")
    _shared(matrix, impl_help, REPORT)
    matrix.add_argument("--shard", metavar="I/N", help="record shard I of N of the version sets (--shard 2/4; `slurm`: "
                        "the task of a SLURM job array; default $FPEMU_SHARD): only its sets, written as partial results "
                        "into TRACES/shards/I-of-N/ (TRACES: --traces, or the default); `--merge` then writes the report "
                        "one matrix writes, byte for byte")
    matrix.add_argument("--merge", action="store_true", help="record nothing: merge the partial results of every shard "
                        "(1..N, from TRACES/shards/) into upgrades.md and its results file; refuses (exit 2, naming the "
                        "file) shards that do not fit: one missing, of another N, plan or fpemu version")

    bisect = command("bisect", _BISECT_HELP, _timed(_cmd_bisect))
    bisect.add_argument("package", help="the package whose releases to search (jax, flax, keras, ...)")
    bisect.add_argument("--specs", nargs="+", type=pathlib.Path, required=True, help=specs_help)
    bisect.add_argument("--from", dest="low", metavar="VERSION", help="the oldest version to consider")
    bisect.add_argument("--to", dest="high", metavar="VERSION", help="the newest version to consider")
    bisect.add_argument("--stride", type=int, default=4,
                        help="test every N-th version first (default 4); 1 tests every version and assumes nothing "
                             "(cost: one environment per version)")
    bisect.add_argument("--versions", metavar="V1,V2,...", help="search these versions instead of those pip lists")
    bisect.add_argument("--pre", action="store_true", help="include pre-releases")
    bisect.add_argument("--name", help="its section of upgrades.md (default bisect_PACKAGE)")
    _shared(bisect, impl_help, REPORT)


def _shared(cmd, impl_help: str, report: str) -> None:
    from fpemu.cli.harness import TIMEOUT_HELP, jobs_option
    cmd.add_argument("--timeout", type=float, metavar="SECONDS",
                     help=TIMEOUT_HELP.replace("(spec x implementation)", "(spec x implementation, in each set; a "
                                               "plan's own loop: each set's run of it)")
                     + "; in the report, a timed-out job is its cell, `cannot run`")
    jobs_option(cmd, executor=False)  # a set's jobs run with the set's own packages, here
    cmd.add_argument("--with", dest="with_", nargs="+", metavar="REQ",
                     help="requirements added to every set (numpy==2.4.6, flax==0.10.0, ...)")
    cmd.add_argument("--impl", nargs="+", help=impl_help + " (default: each spec's own)")
    cmd.add_argument("--reports", type=pathlib.Path, default=pathlib.Path("reports"),
                     help=f"folder of {report} and its results files (default reports/)")
    cmd.add_argument("--traces", type=pathlib.Path,
                     help="folder for the recorded traces, one subfolder per set (default ~/.cache/fpemu/matrix/NAME)")


def add_commands(registry) -> None:
    """env, matrix and bisect."""
    _add_env_commands(registry.subparsers)
    _add_matrix_commands(registry.command, registry.specs_help, registry.impl_help)
