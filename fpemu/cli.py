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
import math
import os
import pathlib
import sys
import traceback
import typing

from fpemu.errors import FpemuInputError

DEFAULT_SPECS = pathlib.Path("specs")
DEFAULT_REPORTS = pathlib.Path("reports")
# The main job writes beside the committed reports, not over them: on a machine without every framework its
# skipped rows would replace what a full run measured.  `--reports reports` refreshes the committed ones.
RUN_REPORTS = DEFAULT_REPORTS / "local"


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


def _ranks_left_out(args) -> None:
    from fpemu.harness.ranks import ranks_left_out
    left_out = ranks_left_out(args.specs, args.command)  # raises (exit 2) when only [ranks] specs were given
    if left_out:
        _note(args, f"note: {left_out}")


def _cmd_golden(args) -> int:
    from fpemu.harness import write_golden
    _ranks_left_out(args)
    unmade = []
    written = write_golden(args.specs, args.out, _progress(args), unmade)
    made = [path for path in written if path not in {kept for _, _, kept in unmade}]
    lines = _written_lines(made, "golden traces") + [
        f"{'kept ' + str(kept) if kept else 'no golden'} for {name}: its golden needs a real run, which cannot "
        f"run here ({why})"
        for name, why, kept in unmade]
    _emit(args, {"written": [str(p) for p in made], "unmade": [[name, why, kept and str(kept)]
                                                                for name, why, kept in unmade]}, lines)
    return 0


def _cmd_record(args) -> int:
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import record
    _ranks_left_out(args)
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
    _ranks_left_out(args)
    verdicts = diff(args.specs, args.golden, args.impl, args.save, _progress(args), excluded=args.exclude)
    code = _failure_code(verdicts) or _nothing_compared(args, verdicts)
    _emit(args, {"verdicts": [v.as_dict() for v in verdicts], "exit_code": code}, _verdict_lines(verdicts))
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
    changes, unchanged, problems = audit(args.baseline, _progress(args), args.impl, args.exclude)
    skipped = [v for v in problems if v.status == SKIPPED]
    failed = [v for v in problems if v.status != SKIPPED]
    lines = [f"{unchanged} recorded behaviours unchanged, {len(changes)} changed, {len(skipped)} skipped"
             + (f", {len(failed)} failed ({_status_counts(failed)})" if failed else "")]
    lines += _audit_change_lines(changes)
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
                            "divergence": c.impact.divergence.as_dict("baseline", "now"),
                            "impact": c.impact.as_dict("baseline", "now")} for c in changes]}
    _emit(args, payload, lines)
    return code


def _cmd_compare(args) -> int:
    from fpemu.compare import trace_changes
    from fpemu.traces import read_trace
    before, after = read_trace(args.before), read_trace(args.after)
    try:
        changes = trace_changes(before, after)
    except FpemuInputError as error:
        raise FpemuInputError(f"{args.before} vs {args.after}: {error}") from None
    code = 0 if changes.identical else 1
    lines = changes.lines() + ["", f"before: {args.before} ({changes.before})",
                               f"after: {args.after} ({changes.after})"]
    _emit(args, {**changes.as_dict(), "files": [str(args.before), str(args.after)], "exit_code": code}, lines)
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


def _rank_timeout(seconds):
    if seconds is not None and not 0 < seconds < math.inf:
        raise FpemuInputError(f"--rank-timeout {seconds:g}: expected seconds > 0 (a finite number)")
    return seconds


def _cmd_run(args) -> int:
    from fpemu.compare.diff import JOB_FAILURES, SKIPPED
    from fpemu.harness import diff, write_golden
    from fpemu.harness.ranks import run_ranks
    from fpemu.reports import write_all
    from fpemu.reports.ranks import ranks_report
    from fpemu.traces import trace_filename
    from fpemu.fileio import atomic_write
    rank_timeout = _rank_timeout(args.rank_timeout)
    if not args.specs.exists():
        where = "the current folder" if args.specs == DEFAULT_SPECS else str(args.specs.parent)
        raise FpemuInputError(f"{args.specs}: no such spec file or folder in {where}; `fpemu run` reads the "
                              "specs/ folder of an fpemu checkout: run it from the checkout's root, or pass "
                              "--specs FOLDER (and --reports FOLDER for the output)")
    reports = args.reports
    golden_dir, observed_dir = reports / "golden", reports / "observed"
    progress = _progress(args)
    fresh = set(write_golden([args.specs], golden_dir, progress))
    ranks, ranks_written = run_ranks([args.specs], golden_dir / "ranks", observed_dir / "ranks", args.impl,
                                     args.exclude, progress, rank_timeout)
    verdicts = diff([args.specs], golden_dir, args.impl, observed_dir, progress,
                    allow_none=not args.impl or bool(ranks), excluded=args.exclude)
    verdicts += [outcome.verdict for outcome in ranks]
    fresh |= {observed_dir / trace_filename(v.spec, v.implementation) for v in verdicts
              if v.status != SKIPPED and v.status not in JOB_FAILURES}
    for folder in (golden_dir, observed_dir):  # traces of specs that no longer exist would haunt the report
        for stale in set(folder.glob("*.json")) - fresh:
            stale.unlink()
    diff_file = atomic_write(reports / "diff.json",
                             json.dumps({"verdicts": [v.as_dict() for v in verdicts]}, indent=1, sort_keys=True) + "\n")
    written = ranks_report(reports, ranks) if ranks else []  # before write_all: its index lists ranks.md
    written += write_all(reports, golden_dir=golden_dir, observed_dir=observed_dir, diff_file=diff_file)
    fresh |= set(ranks_written)
    code = _failure_code(verdicts) or _nothing_compared(args, verdicts)
    _emit(args, {"verdicts": [v.as_dict() for v in verdicts], "written": sorted(map(str, fresh | set(written))),
                 "exit_code": code},
          _verdict_lines(verdicts) + _written_lines(sorted(fresh | {diff_file} | set(written))))
    return code


# --- simulate and underflow: the two everyday questions ------------------------

def _number(text: str, where: str) -> float:
    """A number as a user types it: 1024, 1e-4, 2**16, 2^-24, inf."""
    cleaned = text.strip().replace("^", "**")
    base, sep, exponent = cleaned.partition("**")
    try:
        if sep:
            return float(base) ** int(exponent)
        return float(cleaned)
    except (ValueError, OverflowError):
        raise FpemuInputError(f"{where}: expected a number (1024, 1e-4, 2**16), got {text!r}") from None


def _param_value(text: str, where: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    try:
        return int(low)
    except ValueError:
        return _number(text, where)


def _parse_params(items, words=()) -> dict:
    """NAME=VALUE items; ``words``: the names whose value is taken as a string (a format's name)."""
    params = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FpemuInputError(f"--param {item}: expected NAME=VALUE (e.g. --param init_scale=1024)")
        key = key.strip()
        params[key] = value.strip() if key in words else _param_value(value, f"--param {item}")
    return params


def _parse_steps(text: str) -> list:
    """'3,7,8' or '10-12,20' -> sorted step indices."""
    steps = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        try:
            lo, hi = int(first), int(last) if sep else int(first)
        except ValueError:
            raise FpemuInputError(f"--overflow-steps {text}: expected step numbers like 3,7,8 or 10-12, "
                                  f"got {part!r}") from None
        if lo < 0 or hi < lo:
            raise FpemuInputError(f"--overflow-steps {text}: {part!r} is not a step or an increasing range >= 0")
        steps.update(range(lo, hi + 1))
    return sorted(steps)


def _json_float(value):
    from fpemu.traces.format import encode_float
    return encode_float(value) if isinstance(value, float) else value


def _cmd_simulate(args) -> int:
    import numpy as np
    from fpemu.scalers import simulate_scaler
    from fpemu.scalers.profiles import PROFILES
    if args.profile not in PROFILES:
        raise FpemuInputError(f"--profile {args.profile}: unknown profile; profiles: {', '.join(PROFILES)}")
    overflow_steps = _parse_steps(args.overflow_steps or "")
    steps = args.steps if args.steps is not None else (overflow_steps[-1] + 1 if overflow_steps else 1)
    if steps < 1:
        raise FpemuInputError(f"--steps {steps}: expected at least 1")
    late = [s for s in overflow_steps if s >= steps]
    if late:
        raise FpemuInputError(f"--overflow-steps: step {late[0]} is past the last step ({steps - 1}; --steps {steps})")
    params = _parse_params(args.param)
    flags = np.zeros(steps, dtype=bool)
    flags[overflow_steps] = True
    try:
        trace = simulate_scaler(flags, args.profile, **params)
    except (TypeError, ValueError) as error:
        raise FpemuInputError(f"--param: {error}") from None
    profile = PROFILES[args.profile]
    hysteresis = trace.hysteresis is not None
    events = {}
    for step, text in trace.events:
        events.setdefault(step, []).append(text)
    rows = []
    for step in range(trace.attempts):
        row = {"step": step, "overflow": bool(trace.overflow[step]), "scale": _json_float(float(trace.scales[step])),
               "scale_hex": float(trace.scales[step]).hex(), "applied": bool(trace.applied[step]),
               "growth_counter": int(trace.growth_counter[step])}
        if hysteresis:
            row["hysteresis"] = trace.hysteresis[step]
        if step in events:
            row["events"] = events[step]
        rows.append(row)
    shown = {k: v for k, v in trace.params.items()}
    header = f"{'step':>5}  {'overflow':<8}  {'scale':>15}  {'update':<8}  {'counter':>7}"
    header += f"  {'hysteresis':>10}" if hysteresis else ""
    lines = [f"profile {profile.name}: {profile.implementation} ({profile.verified})",
             "params: " + ", ".join(f"{k}={v!r}" for k, v in shown.items()),
             "scale: the scale each step used; counter: the growth counter after the step", "", header]
    for row in rows:
        line = (f"{row['step']:>5}  {'X' if row['overflow'] else '':<8}  {trace.scales[row['step']]:>15.9g}  "
                f"{'applied' if row['applied'] else 'skipped':<8}  {row['growth_counter']:>7}")
        if hysteresis:
            line += f"  {row['hysteresis']!s:>10}"
        if row.get("events"):
            line += "  " + "; ".join(row["events"])
        lines.append(line)
    final = float(trace.final_scale)
    summary = (f"{trace.attempts} steps: {trace.completed_updates} updates applied, {trace.skipped_updates} skipped; "
               f"final scale {final:.9g} ({final.hex()})")
    if trace.stopped_at is not None:
        summary += f"; the implementation raised at step {trace.stopped_at} and training stopped"
    lines += ["", summary]
    payload = {"profile": profile.name, "implementation": profile.implementation,
               "params": {k: _json_float(v) for k, v in shown.items()}, "steps": rows,
               "summary": {"attempts": trace.attempts, "completed_updates": trace.completed_updates,
                           "skipped_updates": trace.skipped_updates, "final_scale": _json_float(final),
                           "final_scale_hex": final.hex(), "stopped_at": trace.stopped_at}}
    _emit(args, payload, lines)
    return 0


def _cmd_recipe(args) -> int:
    from fpemu.scalers.fp8_recipes import RECIPES, simulate_recipe
    names = [args.recipe] + ([args.vs] if args.vs else [])
    for name, option in zip(names, ("recipe", "--vs")):
        if name not in RECIPES:
            raise FpemuInputError(f"{option} {name}: unknown recipe; recipes: {', '.join(RECIPES)}")
    amaxes = [_number(text, "--amax") for text in args.amax]
    if any(a < 0 for a in amaxes):
        raise FpemuInputError("--amax: an amax is |x| at its largest: expected numbers >= 0, inf or nan")
    params = _parse_params(args.param, words=("fp8_format", "amax_compute_algo", "granularity"))
    try:
        runs = [simulate_recipe(amaxes, name, **params) for name in names]
    except ValueError as error:
        raise FpemuInputError(f"--param: {error}") from None
    rows = [{"step": step, "amax": _json_float(amax),
             **{f"{name}_{field}": _json_float(getattr(run, field)[step]) for name, run in zip(names, runs)
                for field in ("amax_used", "scale")}} for step, amax in enumerate(amaxes)]
    header = f"{'step':>5}  {'amax':>13}" + "".join(f"  {name + ' amax_used':>24}  {name + ' scale':>20}"
                                                    for name in names)
    lines = [f"recipe {name}: {RECIPES[name].source.package} {RECIPES[name].source.version}, "
             f"{RECIPES[name].source.files} ({RECIPES[name].source.verified})" for name in names]
    lines += ["params: " + ", ".join(f"{k}={v!r}" for k, v in params.items()),
              "scale: the scale computed at the step (delayed scaling: the one the next step casts with)", "", header]
    for step, amax in enumerate(amaxes):
        line = f"{step:>5}  {amax:>13.6g}" + "".join(f"  {run.amax_used[step]:>24.9g}  {run.scale[step]:>20.9g}"
                                                    for run in runs)
        if len(runs) == 2 and float(runs[0].scale[step]).hex() != float(runs[1].scale[step]).hex():
            line += "  differ"
        lines.append(line)
    _emit(args, {"recipes": names, "params": {k: _json_float(v) for k, v in params.items()}, "steps": rows}, lines)
    return 0


def _flatten(value, name: str, out: list) -> None:
    """(name, array) for every tensor or array in a torch.load result (dicts and lists nested)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{name}.{key}" if name else str(key), out)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _flatten(item, f"{name}.{index}" if name else str(index), out)
    elif hasattr(value, "detach") and hasattr(value, "dtype"):
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and str(tensor.dtype) not in ("torch.float32", "torch.float64"):
            tensor = tensor.float()  # bf16, fp16 and fp8 widen exactly
        out.append((name or "tensor", tensor.numpy()))


def _load_tensors(path: pathlib.Path) -> list:
    """[(name, array)] of a .npy, .npz or .pt file; errors name the file."""
    import numpy as np
    if not path.is_file():
        raise FpemuInputError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            return [(path.name, np.load(path, allow_pickle=False))]
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return [(f"{path.name}:{key}", archive[key]) for key in archive.files]
    except (OSError, ValueError, EOFError) as error:
        raise FpemuInputError(f"{path}: cannot read as {suffix}: {error}") from None
    if suffix in (".pt", ".pth"):
        import importlib.util
        if importlib.util.find_spec("torch") is None:
            raise FpemuInputError(f"{path}: reading {suffix} files needs torch, which is not installed "
                                  "(pip install torch; or save the tensors with numpy.save / numpy.savez)")
        import torch
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # noqa: BLE001 -- whatever torch refuses, the file is the problem
            raise FpemuInputError(f"{path}: torch.load (weights_only) cannot read it: "
                                  f"{(str(error).strip().splitlines() or [''])[0]}") from None
        found = []
        _flatten(loaded, "", found)
        return [(f"{path.name}:{name}", array) for name, array in found]
    raise FpemuInputError(f"{path}: unknown tensor file type {suffix or '(none)'!r}; expected .npy, .npz or .pt")


def _cmd_underflow(args) -> int:
    from fpemu.formats import FORMATS
    from fpemu.formats.rounding import as_float_array
    if args.format not in FORMATS:
        raise FpemuInputError(f"--format {args.format}: unknown format; formats: {', '.join(FORMATS)}")
    scales = [_number(text, "--scale") for text in args.scale]
    for scale in scales:
        if not (math.isfinite(scale) and scale > 0):
            raise FpemuInputError(f"--scale {scale:g}: expected a positive finite number")
    measure = _block_measure(args) if args.block_rule is not None else _range_measure(args)
    rows, notes = [], []
    for path in args.files:
        for name, array in _load_tensors(path):
            try:
                values = as_float_array(array, name)
            except TypeError:
                notes.append(f"{name}: left out, dtype {array.dtype} is not floating point")
                continue
            try:
                measured = [measure.row(values, scale) for scale in scales]
            except FpemuInputError as error:  # (this array's shape does not fit the blocks)
                notes.append(f"{name}: left out, {error}")
                continue
            rows += [{"array": name, "shape": list(array.shape), "dtype": str(array.dtype), **row} for row in measured]
    if not rows:
        raise FpemuInputError(f"{', '.join(map(str, args.files))}: nothing to measure"
                              + (f" ({'; '.join(notes)})" if notes else ""))
    width = max(len(r["array"]) for r in rows)
    lines = [measure.title, "", f"{'array':<{width}}  {'shape':<12}  {'dtype':<9}  {'scale':>12}  " + measure.header]
    for r in rows:
        lines.append(f"{r['array']:<{width}}  {'x'.join(map(str, r['shape'])) or 'scalar':<12}  {r['dtype']:<9}  "
                     f"{r['scale']:>12.9g}  " + measure.cells(r))
    lines += notes
    _emit(args, {**measure.settings, "arrays": [{k: _json_float(v) for k, v in r.items()} for r in rows],
                 "notes": notes}, lines)
    return 0


class _Measure(typing.NamedTuple):
    """One kind of `fpemu underflow` row: what it measures (row), its settings, title and columns."""
    settings: dict
    title: str
    header: str
    row: typing.Callable     # (float array, scale) -> the row's measured fields
    cells: typing.Callable   # row -> the table cells after the scale


def _range_measure(args) -> _Measure:
    from fpemu.formats import range_stats

    def row(values, scale):
        stats = range_stats(values, args.format, scale, rounding=args.rounding, overflow=args.overflow,
                            subnormals=not args.flush_subnormals)
        return {**stats.as_dict(), "underflow_share": stats.underflow_share,
                "subnormal_share": stats.subnormal_share, "overflow_share": stats.overflow_share}

    return _Measure(
        {"format": args.format, "rounding": args.rounding, "overflow": args.overflow,
         "subnormals": not args.flush_subnormals},
        f"{args.format}, round {args.rounding}, overflow {args.overflow}"
        + (", subnormals flushed" if args.flush_subnormals else "")
        + ": the share of each array's elements that x * scale (float32) loses",
        f"{'elements':>10}  {'underflow':>9}  {'subnormal':>9}  {'overflow':>9}  {'nan':>5}  {'max |x*s|':>10}", row,
        lambda r: (f"{r['total']:>10}  {r['underflow_share']:>9.2%}  {r['subnormal_share']:>9.2%}  "
                   f"{r['overflow_share']:>9.2%}  {r['nan']:>5}  {r['max_abs']:>10.4g}"))


def _block_measure(args) -> _Measure:
    import numpy as np
    from fpemu.blocks import SCALE_RULES
    from fpemu.blocks.stats import block_stats
    if args.block_rule not in SCALE_RULES:
        raise FpemuInputError(f"--block-rule {args.block_rule}: unknown scale rule; rules: {', '.join(SCALE_RULES)}")
    fixed = [flag for flag, given in (("--rounding", args.rounding != "nearest_even"),
                                      ("--overflow", args.overflow != "inf"),
                                      ("--flush-subnormals", args.flush_subnormals)) if given]
    if fixed:
        raise FpemuInputError(f"{', '.join(fixed)}: a --block-rule fixes the elements' rounding, saturation and "
                              f"subnormals as the implementation computes them; drop {' and '.join(fixed)}")
    rule = SCALE_RULES[args.block_rule]
    if args.format not in rule.elements:
        raise FpemuInputError(f"--format {args.format}: scale rule {rule.name} takes the element formats "
                              f"{', '.join(rule.elements)}")
    if args.block_size is not None and args.block_size < 1:
        raise FpemuInputError(f"--block-size {args.block_size}: expected a positive number of values per scale")

    def row(values, scale):
        with np.errstate(over="ignore"):
            scaled = values.astype(np.float32) * np.float32(scale)
        stats = block_stats(scaled, args.format, args.block_size, scale_rule=rule.name, axis=args.axis)
        return {"scale": scale, **stats.as_dict(), **{f"{field}_share": stats.share(field) for field in
                                                       ("underflow", "subnormal", "saturated", "flushed_blocks")}}

    block_size = rule.block_size if args.block_size is None else args.block_size
    return _Measure(
        {"format": args.format, "block_rule": rule.name, "block_size": block_size, "axis": args.axis},
        f"{args.format} in blocks of {block_size} along axis {args.axis}, scale rule {rule.name} ({rule.source}): "
        "the share of each array's elements (and blocks) that block quantization of x * scale (float32) loses",
        f"{'elements':>10}  {'underflow':>9}  {'subnormal':>9}  {'saturated':>9}  {'flushed blocks':>14}  "
        f"{'nan scales':>10}  {'rel rms err':>11}", row,
        lambda r: (f"{r['total']:>10}  {r['underflow_share']:>9.2%}  {r['subnormal_share']:>9.2%}  "
                   f"{r['saturated_share']:>9.2%}  {r['flushed_blocks_share']:>14.2%}  {r['nan_scale_blocks']:>10}  "
                   f"{r['relative_rms_error']:>11.4g}"))


def _cmd_emulate(args) -> int:
    from fpemu.emulate.run import emulate_file, write_outputs
    overrides = {key: value for key, value in (("compute", args.format), ("rounding", args.rounding),
                                               ("accumulation", args.accumulation)) if value is not None}
    if args.flush_subnormals:
        overrides["subnormals"] = False
    if args.steps < 1:
        raise FpemuInputError(f"--steps {args.steps}: expected at least 1 step")
    if args.threads is not None:
        import torch
        if args.threads < 1:
            raise FpemuInputError(f"--threads {args.threads}: expected at least 1")
        torch.set_num_threads(args.threads)
    # the trace and page are named after what ran (pure_fp16-fp8_e4m3fn-up); the file's FRAMEWORK picks the emulator
    trace = emulate_file(args.model, policy=args.policy, overrides=overrides, steps=args.steps, profile=args.scaler,
                         params=_parse_params(args.param), seed=args.seed, semantics=args.semantics)
    written = write_outputs(trace, args.out, plot=not args.no_plot)
    summary = trace.summary
    first = trace.metadata["telemetry"]["first_nonfinite"]
    ran = f"{trace.metadata['policy']['name']} / {trace.metadata['profile']}"
    lines = [f"{trace.spec_name} under {ran}: {summary['attempts']} steps, "
             f"{summary['skipped_updates']} skipped, final scale {summary['final_scale']:g}"]
    lines += [f"first inf/NaN ({d}): {e['op']} in {e['module']} at step {e['step']}" for d, e in sorted(first.items())]
    _emit(args, {"summary": summary, "first_nonfinite": first, "written": [str(p) for p in written]},
          lines + _written_lines(written))
    return 0


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
    from fpemu.version import __version__
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
                 f"{', '.join(adapters_of_kind('step'))} for [step] specs, "
                 f"{', '.join(adapters_of_kind('recipe'))} for [recipe] specs, "
                 f"{', '.join(adapters_of_kind('fp8_training'))} for [fp8_training] specs, "
                 f"{', '.join(adapters_of_kind('ranks'))} for [ranks] specs (add @cuda for the GPU)")
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

    compare = command("compare", "compare any two trace files (a reference, a recording, a rerun, an upgrade, a "
                      "config change): the verdict, the first divergence, then what differs; exit 0 when identical, "
                      "1 when they differ", _cmd_compare)
    compare.add_argument("before", type=pathlib.Path, help="the first trace (e.g. the baseline)")
    compare.add_argument("after", type=pathlib.Path, help="the second trace")

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
    run.add_argument("--reports", type=pathlib.Path, default=RUN_REPORTS,
                     help="output folder (default: reports/local/, which git ignores; --reports reports rewrites the "
                          "committed reports, from a full install: rows that cannot run here would replace measured ones)")
    selection(run, impl_help + " (default: each spec's own)")
    run.add_argument("--rank-timeout", type=float, metavar="SECONDS",
                     help="seconds each [ranks] case may run before it counts as a hang (default: the spec's "
                          "ranks.timeout_s, else 60 + 0.05 x steps x ranks)")

    simulate = command("simulate", "simulate a loss-scaler profile over your overflow steps: a per-step table",
                       _cmd_simulate)
    simulate.add_argument("--profile", default="torch", help="the profile (default torch); `python -c \"import "
                          "fpemu; print(sorted(fpemu.PROFILES))\"` lists them, reports/profiles.md compares them")
    simulate.add_argument("--overflow-steps", default="", metavar="STEPS",
                          help="the steps whose gradients overflow: 3,7,8 or 10-12 (0-based)")
    simulate.add_argument("--steps", type=int, help="steps to run (default: one past the last overflow step)")
    simulate.add_argument("--param", action="append", metavar="NAME=VALUE",
                          help="a parameter of the profile, as the implementation names it (init_scale=1024, "
                               "growth_interval=4, 2**16 allowed); repeat for several")

    recipe = command("recipe", "run an fp8 scaling recipe (TE delayed or current scaling, torchao) over your "
                     "amaxes, alone or beside another: a per-step table", _cmd_recipe)
    recipe.add_argument("recipe", help="the recipe: te_delayed, te_delayed_unfused, te_current, "
                        "te_current_reference, torchao_tensorwise, torchao_rowwise (docs/fp8_recipes.md)")
    recipe.add_argument("--amax", nargs="+", required=True, help="each step's amax (0, inf and nan allowed)")
    recipe.add_argument("--vs", help="a second recipe run on the same amaxes with the same parameters")
    recipe.add_argument("--param", action="append", metavar="NAME=VALUE",
                        help="a parameter of the recipe (amax_history_len=16, margin=1, fp8_format=fp8_e5m2, "
                             "power_2_scales=true); repeat for several")

    underflow = command("underflow", "the underflow, subnormal and overflow share of each array of tensor files "
                        "(.npy, .npz, .pt with torch installed) in a format at a loss scale", _cmd_underflow)
    underflow.add_argument("files", nargs="+", type=pathlib.Path, help=".npy, .npz or .pt files")
    underflow.add_argument("--format", default="fp16", help="the format (default fp16; e.g. bf16, fp8_e4m3fn)")
    underflow.add_argument("--scale", nargs="+", default=["1"], help="loss scales to multiply by in float32 "
                           "(default 1; several give one row each; 2**16 allowed)")
    underflow.add_argument("--rounding", default="nearest_even",
                           choices=("nearest_even", "nearest_away", "toward_zero", "up", "down"))
    underflow.add_argument("--overflow", default="inf", choices=("inf", "saturate"),
                           help="past the largest finite value: inf (IEEE) or saturate")
    underflow.add_argument("--flush-subnormals", action="store_true", help="flush subnormal results to zero")
    underflow.add_argument("--block-rule", default=None, help="block-quantize instead (MX, NVFP4): a scale rule of "
                           "fpemu.SCALE_RULES (ocp, torchao_floor, te_mxfp8, torchao_nvfp4_2level, ...); --format "
                           "is then the element format")
    underflow.add_argument("--block-size", type=int, default=None, help="values per scale (default: the rule's)")
    underflow.add_argument("--axis", type=int, default=-1, help="the axis the blocks run along (default -1)")
    emulate = command("emulate", "run a model file's training steps with every op rounded per a precision policy "
                      "(torch: fpemu.emulate_torch; JAX: fpemu.emulate_jax) under a loss-scaler profile: writes the "
                      "trace and a report page (per-module underflow heat map, scale trajectory). A torch file defines "
                      "build(seed) -> (model, optimizer) and step(model, optimizer, scaler, index) -> loss, the step "
                      "using the torch.amp.GradScaler interface and no autocast of its own; a JAX file declares "
                      "FRAMEWORK = 'jax' and defines build(seed) -> state, grads(state, scale, index) -> (loss, "
                      "grads) and update(state, grads, index) -> state", _cmd_emulate)
    emulate.add_argument("model", type=pathlib.Path, help="the model file (.py)")
    emulate.add_argument("--policy", help="torch: cuda_autocast_fp16 (default), cuda_autocast_bf16, "
                         "cpu_autocast_fp16, cpu_autocast_bf16, pure_fp16, pure_bf16, fp8; JAX: program (default)")
    emulate.add_argument("--semantics", help="JAX: the interpreter's float32 arithmetic, a fpemu.steps.SEMANTICS "
                         "preset (default jax_cpu_strict: XLA:CPU's; jax_cpu: with XLA's default bf16 excess "
                         "precision; seed: IEEE, sequential sums)")
    emulate.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    emulate.add_argument("--scaler", help="the loss-scaler profile (default torch for torch files, flax for JAX "
                         "files; `fpemu simulate` takes the same names)")
    emulate.add_argument("--param", action="append", metavar="NAME=VALUE", help="a parameter of the scaler profile "
                         "(init_scale=2**16, growth_interval=100); repeat for several")
    emulate.add_argument("--format", help="the policy's compute format: a format name (fp8_e5m2, tf32, fp6_e3m2fn, "
                         "...; autocast policies take fp16 or bf16; custom formats: Policy(compute=make_format(...)))")
    emulate.add_argument("--rounding", help="rounding mode (nearest_even, toward_zero, stochastic, ...)")
    emulate.add_argument("--accumulation", choices=("fp32", "low"),
                         help="matmul, sum and conv accumulation (default fp32; low refuses other ops that may accumulate)")
    emulate.add_argument("--flush-subnormals", action="store_true", help="flush subnormal results to zero")
    emulate.add_argument("--seed", type=int, default=0, help="passed to the file's build(seed)")
    emulate.add_argument("--no-plot", action="store_true", help="write no PNG (the page still has the tables)")
    emulate.add_argument("--threads", type=int, help="torch intra-op threads (default torch's; 1 is often fastest "
                         "on a shared machine)")
    emulate.add_argument("--out", type=pathlib.Path, default=DEFAULT_REPORTS / "emulate",
                         help="output folder (default reports/emulate)")
    _add_env_commands(sub)
    from fpemu._matrix_cli import add_matrix_commands
    add_matrix_commands(command, specs_help, impl_help)
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
