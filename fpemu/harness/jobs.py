"""The harness's jobs: write golden traces, diff real implementations, audit an upgrade.

Data flows one way: spec -> scenario -> reference model or real adapter -> trace
-> comparison (-> report, in fpemu.reports).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
import traceback
from typing import Callable, Iterator, Optional

from fpemu.compare.changes import TraceChanges, trace_changes
from fpemu.compare import compare_traces
from fpemu.compare.diff import API_CHANGED, CANNOT_RUN, INTERNAL_ERROR, SKIPPED, Verdict
from fpemu.errors import FpemuInputError, RefusedCall
from fpemu.harness.limits import JOB_TIMEOUT, JobTimedOut, time_limit
from fpemu.harness.pool import in_order
from fpemu.adapters import adapter_versions, package_versions, unavailable_reason
from fpemu.kinds import explain, kind_of, read_trace_checked, record_trace, reference_trace
from fpemu.kinds.scenario import Implementation, ScenarioBase
from fpemu.specs import load_specs, parse_spec
from fpemu.traces import Trace, read_trace, trace_filename, write_golden_trace, write_trace
from fpemu.traces.layout import REFERENCE, portable_spec_path

Progress = Callable[[int, int, str], None]


def _quiet(done: int, total: int, label: str) -> None:
    pass


ADD = "+"  # --impl +NAME: run NAME on every spec it can run, listed there or not (see implementations_for)


def parse_implementation(name: str) -> tuple:
    """``torch@cuda`` (or ``+torch@cuda``, see :func:`implementations_for`) -> ("torch", "cuda"); the device
    defaults to cpu."""
    from fpemu.adapters import resolve
    try:
        return resolve(name.removeprefix(ADD))
    except ValueError as wrong:
        raise FpemuInputError(f"--impl {name}: {wrong}") from None


def matches(key: str, names) -> bool:
    """Whether the implementation ``key`` (``adapter@device``) is one of ``names``: an adapter name
    matches it on every device, ``adapter@device`` on that device only."""
    adapter, _, device = key.partition("@")
    for name in names or ():
        wanted, _, wanted_device = name.partition("@")
        if wanted == adapter and wanted_device in ("", device):
            return True
    return False


def _check_names(names, option: str) -> None:
    for name in names or ():
        try:
            parse_implementation(name)
        except FpemuInputError as error:
            raise FpemuInputError(str(error).replace("--impl", option, 1)) from None


def runs_here(scenario: ScenarioBase) -> bool:
    """Whether these jobs run ``scenario``: a kind without a reference model of its own runs its cases on
    several processes (fpemu.harness.ranks runs those)."""
    return kind_of(scenario).reference is not None


def skip_reason(impl: Implementation):
    """None if ``impl`` can run here, else why not."""
    return unavailable_reason(impl.name, impl.device)


def _drives(scenario: ScenarioBase, adapter) -> bool:
    """Whether the scenario runs an undeclared ``adapter`` of its kind when asked by name: one of its
    profile's adapters; for a kind that runs only what a spec declares (step specs), any adapter of the
    kind where the spec declares none (a torch-only step spec was fitted to torch, and running JAX on it
    would report a false divergence)."""
    kind = kind_of(scenario)
    if adapter.kind != kind.name:
        return False
    if kind.runs_by_default == "declared":
        return not scenario.implementations
    return adapter.profile == scenario.profile


def _added(scenario, adapter) -> Optional[Implementation]:
    """``adapter`` as ``--impl +NAME`` adds it to ``scenario``: a scaler spec whose every parameter the
    adapter's profile takes by name (it runs with the spec's parameters, compared with the spec's golden:
    torch_sharded on a torch spec), a step spec whatever it lists; None for any other spec."""
    kind = kind_of(scenario).name
    if adapter.kind != kind or kind not in ("scaler", "step"):
        return None
    if kind == "step":
        return Implementation(adapter.name, {})
    from fpemu.scalers.profiles import PROFILES
    takes = PROFILES[adapter.profile].defaults if adapter.profile in PROFILES else {}
    return Implementation(adapter.name, dict(scenario.params)) if set(scenario.params) <= set(takes) else None


def implementations_for(scenario: ScenarioBase, requested: Optional[list]) -> list:
    """The implementations to drive: those named (``torch``, ``torch@cuda``) that the scenario can
    run, else the spec's own, else the real implementation of the scenario's profile when fpemu
    has an adapter for it.

    A name runs where the spec lists it, or where it drives the scenario unlisted (a scaler or recipe
    spec: its profile's adapters; a step spec that lists none: any step adapter).  ``+NAME`` runs it on
    more specs besides: every spec :func:`_added` fits (a scaler spec whose parameters its profile takes,
    any step spec), a comparison the spec does not declare."""
    from fpemu.adapters import adapters_of_kind, get_adapter
    if requested:
        chosen = []
        for name in requested:
            adding = name.startswith(ADD)
            adapter, device = parse_implementation(name)
            declared = scenario.declared(adapter)
            if declared is not None:
                chosen.append(dataclasses.replace(declared, device=device))
            elif _drives(scenario, get_adapter(adapter)):
                chosen.append(dataclasses.replace(scenario.implementation(adapter), device=device))
            elif adding and _added(scenario, get_adapter(adapter)) is not None:
                chosen.append(dataclasses.replace(_added(scenario, get_adapter(adapter)), device=device))
        return chosen
    if scenario.implementations:
        return list(scenario.implementations)
    kind = kind_of(scenario)
    if kind.runs_by_default == "profile":  # scaler and recipe scenarios: their profile's (recipe's) adapters
        own = [name for name, adapter in adapters_of_kind(kind.name).items()
               if adapter.profile == scenario.profile and adapter.by_default]
        return [scenario.implementation(name) for name in own]
    return []


def _check_added(scenarios, requested) -> None:
    """Each ``+NAME`` of --impl fits at least one of the specs: else an error naming it and why."""
    for name in requested or ():
        if name.startswith(ADD) and not any(implementations_for(s, [name]) for s in scenarios):
            from fpemu.adapters import get_adapter
            adapter = get_adapter(parse_implementation(name)[0])
            raise FpemuInputError(
                f"--impl {name}: fits none of the specs given ({adapter.name} is a {adapter.kind} adapter; +NAME adds "
                "a scaler adapter to scaler specs whose every parameter its profile takes, a step adapter to step "
                "specs)")


def write_golden(spec_paths, out_dir, progress: Progress = _quiet, unmade: Optional[list] = None,
                 only=None) -> list:
    """Write the reference trace of every spec into ``out_dir``; returns the paths of its current goldens.

    A spec whose golden needs a real run that cannot run here (``golden_needs``: an fp8 training spec
    without torchao), or whose reference model ran past the command's ``--timeout``, keeps its golden where
    one is current (same spec sha256; its path is returned) and gets none otherwise; each such spec is
    appended to ``unmade`` (when given) as ``(name, reason, kept path or None)``.  ``only``: the names of
    the specs to write (a shard's, fpemu.harness.shards); None: all.
    """
    scenarios = [s for s in load_specs(spec_paths) if runs_here(s) and (only is None or s.name in only)]
    written = []
    references = in_order(_reference_job, [(s,) for s in scenarios], died=_reference_died)
    for index, (scenario, (trace, missing)) in enumerate(zip(scenarios, references), 1):
        path = pathlib.Path(out_dir) / trace_filename(scenario.name, REFERENCE)
        if trace is not None:
            written.append(write_golden_trace(portable_spec_path(trace, pathlib.Path.cwd()), path))
        else:
            kept = path if _is_current_golden(path, scenario) else None  # made where its framework ran
            written += [kept] if kept else []
            if unmade is not None:
                unmade.append((scenario.name, missing, kept))
        progress(index, len(scenarios), scenario.name + (f" (golden not made here: {missing})" if missing else ""))
    return written


def _reference_job(scenario):
    """(the reference trace of ``scenario``, None), or (None, why none is made: a real run it needs cannot
    run here, or its reference model ran past --timeout)."""
    missing = _golden_unmade(scenario)
    if missing:
        return None, missing
    try:
        with time_limit(JOB_TIMEOUT.get()):
            return reference_trace(scenario), None
    except JobTimedOut as late:
        return None, f"its reference model {late}"


def _reference_died(scenario, why: str):
    return None, f"its reference model did not finish: {why}"


def _golden_unmade(scenario):
    """Why the golden of ``scenario`` cannot be made here (its reference needs a real run whose framework
    is absent), or None."""
    reason = skip_reason(Implementation(scenario.golden_needs, {})) if scenario.golden_needs else None
    return reason and f"its golden needs a real run, which cannot run here ({reason})"


def _is_current_golden(path: pathlib.Path, scenario) -> bool:
    try:
        return path.exists() and read_trace(path).metadata["spec"]["sha256"] == scenario.sha256
    except FpemuInputError:
        return False


def _golden_for(scenario: ScenarioBase, golden_dir) -> Trace:
    path = pathlib.Path(golden_dir) / trace_filename(scenario.name, REFERENCE)
    if not path.exists():
        raise FpemuInputError(f"{path}: no golden trace for spec {scenario.name!r}; run `fpemu golden` first")
    golden = read_trace_checked(path)
    if golden.metadata["spec"]["sha256"] != scenario.sha256:
        raise FpemuInputError(f"{path}: golden trace was made from another version of {scenario.path} "
                              "(spec sha256 differs); regenerate it with `fpemu golden`")
    from fpemu.traces.replay import replayed_file_changed, replayed_metadata
    problem = replayed_file_changed(golden.metadata, replayed_metadata(scenario), path)
    if problem:
        raise FpemuInputError(f"{problem}; regenerate it with `fpemu golden` to accept the file as it is now")
    return golden


# --- one job, isolated ----------------------------------------------------------

_FPEMU_ROOT = pathlib.Path(__file__).resolve().parent.parent
_ADAPTERS_ROOT = _FPEMU_ROOT / "adapters"


def _within(filename: str, folder: pathlib.Path) -> bool:
    try:
        pathlib.Path(filename).resolve().relative_to(folder)
        return True
    except (ValueError, OSError):
        return False


def _short_path(filename: str) -> str:
    """A frame's file as a reader finds it: fpemu/..., or the package's own path under site-packages."""
    if _within(filename, _FPEMU_ROOT):
        return str(pathlib.Path(filename).resolve().relative_to(_FPEMU_ROOT.parent))
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.rsplit(marker, 1)[1]
    return pathlib.Path(filename).name


API_CHANGES = ("TypeError", "AttributeError", RefusedCall.__name__)  # a remote exception's type names (api changed)


def classify_failure(error: BaseException) -> str:
    """The status of a job whose run raised ``error`` (see fpemu.compare.diff.STATUSES).

    An import error anywhere is ``cannot run``; an error from an isolated environment takes the
    remote exception's type; otherwise the innermost frame of fpemu decides: in an adapter (or
    below it, in the framework) a TypeError, AttributeError or :class:`fpemu.errors.RefusedCall` (a
    refusal the adapter recognized) is ``api changed`` and anything else ``cannot run``; in fpemu's own
    core it is an ``internal error``.
    """
    from fpemu import environments
    if isinstance(error, ImportError):
        return CANNOT_RUN
    if isinstance(error, environments.EnvironmentCallError):
        remote = getattr(error, "remote_traceback", "") or ""
        last = remote.strip().splitlines()[-1] if remote.strip() else ""
        kind = last.partition(":")[0].strip().rpartition(".")[2]
        return API_CHANGED if kind in API_CHANGES else CANNOT_RUN
    if isinstance(error, (environments.EnvironmentBuildError, environments.EnvironmentNotBuilt, SystemExit)):
        return CANNOT_RUN
    own = [frame.filename for frame in traceback.extract_tb(error.__traceback__)
           if _within(frame.filename, _FPEMU_ROOT)]
    if own and not _within(own[-1], _ADAPTERS_ROOT):
        return INTERNAL_ERROR
    return API_CHANGED if isinstance(error, (TypeError, AttributeError, RefusedCall)) else CANNOT_RUN


def _blamed_package(error: BaseException, modules) -> Optional[str]:
    """The distribution of the innermost frame that belongs to one of the adapter's framework
    ``modules`` (the package that raised), if any."""
    import importlib.metadata
    blamed = None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        top = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        if top in modules:
            blamed = top
    if blamed is None:
        return None
    try:
        return importlib.metadata.packages_distributions().get(blamed, [blamed])[0]
    except Exception:  # noqa: BLE001 -- naming the package is a courtesy
        return blamed


def job_failure(scenario, impl, error: BaseException) -> Verdict:
    """The one result line of a job whose run raised ``error``: its status, the exception, the
    package that raised it (with its version) and where, and every package version the adapter uses."""
    from fpemu.adapters import ADAPTERS
    adapter = ADAPTERS.get(impl.name)
    packages = adapter_versions(adapter) if adapter is not None else {}
    status = classify_failure(error)
    if isinstance(error, RefusedCall) and error.__cause__ is not None:  # the line names what the framework raised
        error = error.__cause__
    message = (str(error).strip().splitlines() or [""])[0]
    if len(message) > 300:
        message = message[:297] + "..."
    blamed = _blamed_package(error, adapter.modules) if adapter is not None else None
    where = ""
    if blamed is not None:
        where = f" in {blamed} {packages.get(blamed) or package_versions([blamed])[blamed]}"
    frames = traceback.extract_tb(error.__traceback__)
    at = f" (raised at {_short_path(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    note = f"{type(error).__name__}{where}: {message}{at}"
    if status == INTERNAL_ERROR:
        note += "; this is a bug in fpemu, please report it with the traceback above"
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    return Verdict(scenario.name, impl.key, status, note=note, packages=packages)


def _skipped(scenario, impl, reason: str, status: str = SKIPPED) -> Verdict:
    """The result line of a job that made no trace: skipped (``reason``), or another ``status``."""
    from fpemu.adapters import ADAPTERS
    adapter = ADAPTERS.get(impl.name)
    packages = adapter_versions(adapter) if adapter is not None else {}
    return Verdict(scenario.name, impl.key, status, note=reason, packages=packages)


def run_job(scenario, impl):
    """Run one job: (its trace, None) or (None, the Verdict saying why there is none).

    Whatever the adapter or its framework raises is one result (see :func:`job_failure`); only bad
    input (FpemuInputError, exit 2) and interrupts go through.
    """
    reason = skip_reason(impl)
    if reason:
        return None, _skipped(scenario, impl, reason)
    try:
        with time_limit(JOB_TIMEOUT.get()):  # --timeout (fpemu.harness.limits)
            return record_trace(scenario, impl), None
    except FpemuInputError:
        raise
    except JobTimedOut as timed_out:
        return None, _skipped(scenario, impl, str(timed_out), CANNOT_RUN)  # one result line, the others still run
    except (Exception, SystemExit) as error:  # noqa: BLE001 -- one job's failure is one result line
        return None, job_failure(scenario, impl, error)


def _job_died(scenario, impl, why: str):
    """run_job's result for a job whose worker process died or was killed (fpemu.harness.pool)."""
    return None, _skipped(scenario, impl, why, CANNOT_RUN)


def _job_imports(scenario, impl) -> frozenset:
    from fpemu.adapters import ADAPTERS
    adapter = ADAPTERS.get(impl.name)
    return frozenset(adapter.modules if adapter is not None else ())


def run_jobs(jobs) -> Iterator:
    """:func:`run_job` of each (scenario, implementation) pair, in order, on the command's ``--jobs``
    worker processes (fpemu.harness.pool), a framework's jobs kept to the workers that imported it."""
    return in_order(run_job, jobs, died=_job_died, imports=_job_imports)


def skipped_summary(verdicts) -> str:
    """Which implementations were skipped and why, one clause per implementation and reason."""
    groups = {}
    for v in verdicts:
        if v.status == SKIPPED:
            groups.setdefault((v.implementation, v.note), []).append(v.spec)
    return "; ".join(f"{impl} ({len(specs)} spec{'s' * (len(specs) != 1)}): {why}"
                     for (impl, why), specs in groups.items())


# --- the jobs -------------------------------------------------------------------

def diff(spec_paths, golden_dir, requested=None, save_dir=None, progress: Progress = _quiet,
         allow_none: bool = False, excluded=None, only=None) -> list:
    """Drive the implementations through every spec and compare with the golden traces.

    Every golden trace is read (and checked) before anything runs; no implementation to
    run is an error unless ``allow_none`` (``fpemu run`` over specs of source-derived profiles).
    Each job is isolated: one that cannot run is one Verdict (see :func:`run_job`).  ``only``: the names
    of the specs whose jobs to run (a shard's, fpemu.harness.shards; the checks see every spec); None: all.
    """
    scenarios = load_specs(spec_paths)
    jobs = _jobs(scenarios, requested, allow_none, excluded, only)
    goldens = {scenario.name: _golden_for(scenario, golden_dir) for scenario, _ in jobs  # all, before any run
               if not _golden_unmade(scenario)}  # (one that cannot be made here: its job is skipped too)
    verdicts = []
    for index, ((scenario, impl), (observed, failure)) in enumerate(zip(jobs, run_jobs(jobs)), 1):
        key = impl.key
        if failure is not None:
            verdicts.append(failure)
        else:
            if save_dir is not None:
                write_trace(observed, pathlib.Path(save_dir) / trace_filename(scenario.name, key))
            verdict = compare_traces(goldens[scenario.name], observed, impl.expect_divergence, explain)
            verdicts.append(_with_unverified_versions(verdict, impl, observed))
        progress(index, len(jobs), f"{scenario.name} / {key}")
    return verdicts


def unverified_versions(impl, observed) -> list:
    """``package verified -> here`` for each package the adapter's comparison with fpemu's model
    was made on at another version than the observed trace's."""
    from fpemu.adapters import get_adapter
    here = observed.metadata.get("packages", {})
    changed = []
    for entry in get_adapter(impl.name).verified:
        package, _, version = entry.rpartition(" ")
        if package in here and here[package] != version:
            changed.append(f"{package} {version} -> {here[package]}")
    return changed


def _with_unverified_versions(verdict, impl, observed):
    """A divergence on other versions than fpemu's model was verified on says so."""
    changed = unverified_versions(impl, observed)
    if not verdict.failed or not changed:
        return verdict
    note = f"fpemu's model was verified on other versions: {', '.join(changed)}"
    return dataclasses.replace(verdict, note="; ".join(filter(None, [verdict.note, note])))


def _jobs(scenarios, requested, allow_none: bool = False, excluded=None, only=None) -> list:
    """(scenario, implementation) pairs, less those ``excluded``; finding none is an error unless
    ``allow_none``.  ``only``: then the jobs of those spec names alone (a shard's: the checks see every spec,
    so a shard refuses what the whole run refuses)."""
    _check_names(excluded, "--exclude")
    _check_added(scenarios, requested)
    jobs = [(scenario, impl) for scenario in scenarios if runs_here(scenario)
            for impl in implementations_for(scenario, requested) if not matches(impl.key, excluded)]
    if not jobs and not allow_none:
        named = f"--impl {' '.join(requested)}" if requested else "any implementation"
        if excluded:
            named += f" outside --exclude {' '.join(excluded)}"
        raise FpemuInputError(f"nothing to run: no spec declares or matches {named} "
                              "(a spec runs its profile's own adapter and those under [implementations])")
    return jobs if only is None else [(scenario, impl) for scenario, impl in jobs if scenario.name in only]


@dataclasses.dataclass(frozen=True)
class Recorded:
    """What ``record`` did: the traces written, the stale traces it removed from the folder, and a
    Verdict for every job that wrote none (skipped, or failed: api changed, cannot run, ...)."""
    written: list
    removed: list
    unrecorded: list


def _trace_files(folder: pathlib.Path) -> dict:
    """path -> implementation of every fpemu trace in ``folder`` (other JSON files are not ours)."""
    found = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            body = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # not ours, whatever it is
            continue
        if isinstance(body, dict) and body.get("format") == "fpemu-trace":
            found[path] = (body.get("metadata") or {}).get("implementation")
    return found


def record(spec_paths, out_dir, requested=None, progress: Progress = _quiet, excluded=None) -> Recorded:
    """Record the real implementations' traces (an audit baseline) into ``out_dir``.

    Each trace is written atomically as its job ends; a job that cannot run writes nothing and is
    reported.  The folder then holds exactly this run's traces: traces in it that this run did not
    write (of removed specs, of implementations not run now, of jobs that failed) are removed and
    listed, so an audit never mixes two recordings.  A folder of golden (reference) traces is refused.
    """
    out_dir = pathlib.Path(out_dir)
    jobs = _jobs(load_specs(spec_paths), requested, excluded=excluded)
    golden = [path.name for path, impl in _trace_files(out_dir).items() if impl == REFERENCE]
    if golden:
        raise FpemuInputError(f"{out_dir}: holds golden (reference) traces ({', '.join(golden[:3])}"
                              f"{', ...' if len(golden) > 3 else ''}); record a baseline into a folder of its own")
    written, unrecorded = [], []
    for index, ((scenario, impl), (trace, failure)) in enumerate(zip(jobs, run_jobs(jobs)), 1):
        key = impl.key
        if failure is not None:
            unrecorded.append(failure)
        else:
            written.append(write_trace(trace, out_dir / trace_filename(scenario.name, key)))
        progress(index, len(jobs), f"{scenario.name} / {key}")
    removed = []
    for path in set(_trace_files(out_dir)) - set(written):
        path.unlink()
        removed.append(path)
    return Recorded(written, sorted(removed), unrecorded)


@dataclasses.dataclass(frozen=True)
class AuditChange:
    """One recorded behaviour that changed between the baseline and this environment; ``impact``
    says what differs and whether it matters (fpemu.compare.trace_changes)."""
    spec: str
    implementation: str
    impact: TraceChanges
    packages_before: dict
    packages_now: dict
    baseline_path: str


def audit(baseline_dir, progress: Progress = _quiet, requested=None, excluded=None) -> tuple:
    """Re-record every real-implementation trace in ``baseline_dir`` here and list what changed.

    Each baseline trace carries its spec's full text, so the scenario is rebuilt from the trace
    itself.  ``requested`` / ``excluded``: implementation names (``flax``, ``torch@cuda``) to audit
    only / to leave out.  Returns (changes, unchanged count, [Verdict of each baseline trace that
    was not re-recorded: skipped here, or a failed job]).
    """
    _check_names(requested, "--impl")
    _check_names(excluded, "--exclude")
    paths = sorted(p for p in pathlib.Path(baseline_dir).glob("*.json"))
    baselines = [(p, read_trace(p)) for p in paths]
    baselines = [(p, t) for p, t in baselines if t.implementation != REFERENCE]
    if not baselines:
        raise FpemuInputError(f"{baseline_dir}: no recorded implementation traces (run `fpemu record` to make a baseline)")
    chosen = [(p, t) for p, t in baselines if (not requested or matches(t.implementation, requested))
              and not matches(t.implementation, excluded)]
    if not chosen:
        held = sorted({t.implementation for _, t in baselines})
        raise FpemuInputError(f"nothing to audit: {baseline_dir} holds {', '.join(held)}; none is selected by "
                              + " ".join(f"{option} {' '.join(names)}" for option, names
                                         in (("--impl", requested), ("--exclude", excluded)) if names))
    rebuilt = [_rebuilt_job(path, before) for path, before in chosen]
    runs = run_jobs([job for job in rebuilt if isinstance(job, tuple)])
    changes, unchanged, problems = [], 0, []
    for index, ((path, before), job) in enumerate(zip(chosen, rebuilt), 1):
        if isinstance(job, Verdict):  # this fpemu cannot rebuild it
            problems.append(job)
            progress(index, len(chosen), f"{before.spec_name} / {before.implementation}")
            continue
        scenario, _ = job
        now, failure = next(runs)
        if failure is not None:
            recorded = ", ".join(f"{k} {v}" for k, v in sorted(before.metadata.get("packages", {}).items()))
            problems.append(dataclasses.replace(failure, note=f"{failure.note} (the baseline {path.name} "
                                                              f"was recorded with {recorded or 'no packages'})"))
        else:
            impact = trace_changes(before, now, explain)
            if impact.identical:
                unchanged += 1
            else:
                changes.append(AuditChange(scenario.name, before.implementation, impact,
                                           before.metadata.get("packages", {}), now.metadata.get("packages", {}),
                                           str(path)))
        progress(index, len(chosen), f"{before.spec_name} / {before.implementation}")
    return changes, unchanged, problems


def _rebuilt_job(path, before: Trace):
    """The (scenario, implementation) job that re-records the baseline trace ``before`` (read from ``path``),
    or the Verdict of a baseline this fpemu cannot rebuild (it refuses its spec or has no such adapter now)."""
    spec = before.metadata["spec"]
    try:
        scenario = parse_spec(spec["text"], spec["path"])
        adapter, device = parse_implementation(before.implementation)
    except FpemuInputError as refused:
        return Verdict(before.spec_name, before.implementation, CANNOT_RUN,
                       note=f"this fpemu cannot rebuild the baseline {path.name}: {refused}")
    return scenario, dataclasses.replace(scenario.implementation(adapter), device=device)
