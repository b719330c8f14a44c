"""The harness's jobs: write golden traces, diff real implementations, audit an upgrade.

Data flows one way: spec -> scenario -> reference model or real adapter -> trace
-> comparison (-> report, in fpemu.reports).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Callable, Optional

from fpemu.compare import SKIPPED, Verdict, compare_traces
from fpemu.errors import FpemuInputError
from fpemu.harness.run import (REFERENCE, implementation_key, record_trace, reference_trace, skip_reason)
from fpemu.specs import ScalerScenario, StepScenario, load_specs, parse_spec
from fpemu.traces import read_trace, trace_filename, write_trace

Progress = Callable[[int, int, str], None]


def stderr_progress(done: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr, redrawn in place; silent when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return
    width = 24
    filled = width * done // max(total, 1)
    line = f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {label}"
    end = "\r" if done < total else "\n"
    print(line[:120].ljust(120), end=end, file=sys.stderr, flush=True)


def _quiet(done: int, total: int, label: str) -> None:
    pass


def parse_implementation(name: str) -> tuple:
    """``torch@cuda`` -> ("torch", "cuda"); the device defaults to cpu."""
    from fpemu.adapters import ADAPTERS, DEVICES
    adapter, _, device = name.partition("@")
    device = device or "cpu"
    if adapter not in ADAPTERS:
        raise FpemuInputError(f"--impl {name}: unknown implementation; known: {', '.join(ADAPTERS)}")
    if device not in DEVICES:
        raise FpemuInputError(f"--impl {name}: unknown device {device!r}; devices: {', '.join(DEVICES)}")
    if device not in ADAPTERS[adapter].devices:
        raise FpemuInputError(f"--impl {name}: {adapter} runs on {', '.join(ADAPTERS[adapter].devices)} only")
    return adapter, device


def _scenario_kind(scenario) -> str:
    return "step" if isinstance(scenario, StepScenario) else "scaler"


def _drives(scenario, adapter) -> bool:
    """Whether the scenario runs an undeclared ``adapter`` when asked by name: a scaler scenario its
    profile's own adapter; a step scenario any step adapter, unless it declares which it runs (a
    torch-only step spec was fitted to torch, and running JAX on it would report a false divergence)."""
    if adapter.kind != _scenario_kind(scenario):
        return False
    if adapter.kind == "step":
        return not scenario.implementations
    return adapter.profile == scenario.profile


def implementations_for(scenario: ScalerScenario | StepScenario, requested: Optional[list]) -> list:
    """The implementations to drive: those named (``torch``, ``torch@cuda``) that the scenario can
    run, else the spec's own, else the real implementation of the scenario's profile when fpemu
    has an adapter for it."""
    from fpemu.adapters import adapters_of_kind, get_adapter
    if requested:
        chosen = []
        for name in requested:
            adapter, device = parse_implementation(name)
            declared = scenario.declared(adapter)
            if declared is not None:
                chosen.append(dataclasses.replace(declared, device=device))
            elif _drives(scenario, get_adapter(adapter)):
                chosen.append(dataclasses.replace(scenario.implementation(adapter), device=device))
        return chosen
    if scenario.implementations:
        return list(scenario.implementations)
    if isinstance(scenario, ScalerScenario):
        own = [name for name, adapter in adapters_of_kind("scaler").items() if adapter.profile == scenario.profile]
        return [scenario.implementation(name) for name in own]
    return []


def write_golden(spec_paths, out_dir, progress: Progress = _quiet) -> list:
    """Write the reference trace of every spec into ``out_dir``; returns the paths written."""
    scenarios = load_specs(spec_paths)
    written = []
    for index, scenario in enumerate(scenarios, 1):
        written.append(write_trace(reference_trace(scenario), pathlib.Path(out_dir) / trace_filename(scenario.name, REFERENCE)))
        progress(index, len(scenarios), scenario.name)
    return written


def _golden_for(scenario: ScalerScenario | StepScenario, golden_dir) -> "Trace":
    path = pathlib.Path(golden_dir) / trace_filename(scenario.name, REFERENCE)
    if not path.exists():
        raise FpemuInputError(f"{path}: no golden trace for spec {scenario.name!r}; run `fpemu golden` first")
    golden = read_trace(path)
    if golden.metadata["spec"]["sha256"] != scenario.sha256:
        raise FpemuInputError(f"{path}: golden trace was made from another version of {scenario.path} "
                              "(spec sha256 differs); regenerate it with `fpemu golden`")
    return golden


def diff(spec_paths, golden_dir, requested=None, save_dir=None, progress: Progress = _quiet,
         allow_none: bool = False) -> list:
    """Drive the implementations through every spec and compare with the golden traces.

    Every golden trace is read (and checked) before anything runs; no implementation to
    run is an error unless ``allow_none`` (``fpemu run`` over specs of source-derived profiles).
    """
    scenarios = load_specs(spec_paths)
    jobs = _jobs(scenarios, requested, allow_none)
    goldens = {scenario.name: _golden_for(scenario, golden_dir) for scenario, _ in jobs}  # all, before any run
    verdicts = []
    for index, (scenario, impl) in enumerate(jobs, 1):
        key = implementation_key(impl)
        golden = goldens[scenario.name]
        reason = skip_reason(impl)
        if reason:
            verdicts.append(Verdict(scenario.name, key, SKIPPED, note=reason))
        else:
            observed = record_trace(scenario, impl)
            if save_dir is not None:
                write_trace(observed, pathlib.Path(save_dir) / trace_filename(scenario.name, key))
            verdicts.append(compare_traces(golden, observed, impl.expect_divergence))
        progress(index, len(jobs), f"{scenario.name} / {key}")
    return verdicts


def _jobs(scenarios, requested, allow_none: bool = False) -> list:
    """(scenario, implementation) pairs; finding none is an error unless ``allow_none``."""
    jobs = [(scenario, impl) for scenario in scenarios for impl in implementations_for(scenario, requested)]
    if not jobs and not allow_none:
        named = f"--impl {' '.join(requested)}" if requested else "any implementation"
        raise FpemuInputError(f"nothing to run: no spec declares or matches {named} "
                              "(a spec runs its profile's own adapter and those under [implementations])")
    return jobs


def record(spec_paths, out_dir, requested=None, progress: Progress = _quiet) -> tuple:
    """Record the real implementations' traces (an audit baseline) into ``out_dir``.

    Returns (paths written, [(spec, implementation, why skipped)]).
    """
    jobs = _jobs(load_specs(spec_paths), requested)
    written, skipped = [], []
    for index, (scenario, impl) in enumerate(jobs, 1):
        key = implementation_key(impl)
        reason = skip_reason(impl)
        if reason:
            skipped.append((scenario.name, key, reason))
        else:
            path = pathlib.Path(out_dir) / trace_filename(scenario.name, key)
            written.append(write_trace(record_trace(scenario, impl), path))
        progress(index, len(jobs), f"{scenario.name} / {key}")
    return written, skipped


@dataclasses.dataclass(frozen=True)
class AuditChange:
    """One recorded behaviour that changed between the baseline and this environment."""
    spec: str
    implementation: str
    verdict: Verdict
    packages_before: dict
    packages_now: dict
    baseline_path: str


def audit(baseline_dir, progress: Progress = _quiet) -> tuple:
    """Re-record every real-implementation trace in ``baseline_dir`` here and list what changed.

    Each baseline trace carries its spec's full text, so the scenario is rebuilt
    from the trace itself.  Returns (changes, unchanged count, skipped list).
    """
    paths = sorted(p for p in pathlib.Path(baseline_dir).glob("*.json"))
    baselines = [(p, read_trace(p)) for p in paths]
    baselines = [(p, t) for p, t in baselines if t.implementation != REFERENCE]
    if not baselines:
        raise FpemuInputError(f"{baseline_dir}: no recorded implementation traces (run `fpemu record` to make a baseline)")
    changes, unchanged, skipped = [], 0, []
    for index, (path, before) in enumerate(baselines, 1):
        spec = before.metadata["spec"]
        scenario = parse_spec(spec["text"], spec["path"])
        adapter, device = parse_implementation(before.implementation)
        impl = dataclasses.replace(scenario.implementation(adapter), device=device)
        reason = skip_reason(impl)
        if reason:
            skipped.append((str(path), reason))
        else:
            now = record_trace(scenario, impl)
            verdict = compare_traces(before, now)
            if verdict.divergence is None:
                unchanged += 1
            else:
                changes.append(AuditChange(scenario.name, before.implementation, verdict,
                                           before.metadata.get("packages", {}), now.metadata.get("packages", {}),
                                           str(path)))
        progress(index, len(baselines), f"{before.spec_name} / {before.implementation}")
    return changes, unchanged, skipped

