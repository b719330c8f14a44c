"""Writes the reports of ``fpemu run``."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from fpemu.compare.diff import JOB_FAILURES, SKIPPED, STATUSES
from fpemu.errors import FpemuInputError
from fpemu.fileio import atomic_write, read_bounded
from fpemu.formats import FORMATS, range_stats
from fpemu.kinds import kind_of_trace, read_trace_checked
from fpemu.scalers import PROFILES, simulate_scaler
from fpemu.scalers.profiles import REQUIRED
from fpemu.traces.schema import READ_LIMITS, bounded_json


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def formats_report() -> str:
    rows = [(f.name, f"{int(f.signed)}-{f.exponent_bits}-{f.mantissa_bits}", f.bias, f.special,
             f"{f.max_finite:.6g}", f"{f.min_normal:.6g}", f"{f.min_subnormal:.6g}", f"{f.epsilon:.3g}",
             f.dtype.name if f.dtype is not None else "-") for f in FORMATS.values()]
    table = markdown_table(["format", "layout", "bias", "specials", "max finite", "min normal",
                            "min subnormal", "epsilon", "native dtype"], rows)
    rng = np.random.default_rng(0)
    grads = (rng.standard_normal(1_000_000) * np.exp2(rng.uniform(-40, 0, 1_000_000))).astype(np.float32)
    stat_rows = []
    for name in ("fp16", "bf16", "fp8_e5m2", "fp8_e4m3fn"):
        for scale in (1.0, 2.0**8, 2.0**16, 2.0**24):
            s = range_stats(grads, name, scale)
            stat_rows.append((name, f"2^{math.frexp(scale)[1] - 1}", f"{s.underflow_share:.2%}",
                              f"{s.subnormal_share:.2%}", f"{s.overflow_share:.2%}"))
    stats = markdown_table(["format", "loss scale", "underflow to 0", "subnormal", "overflow"], stat_rows)
    return ("# Number formats\n\n" + table + "\n\n## What a gradient tensor loses\n\n"
            "One million float32 values, normal(0, 1) * 2^U(-40, 0) (gradient-like magnitudes), "
            "multiplied by the loss scale in float32 and rounded to nearest even.\n\n" + stats + "\n")


# One overflow sequence every profile runs, with a growth interval of 3 and a start of 2^4 where
# the profile has those parameters: growth timing, backoff, hysteresis and tolerance all show.
DIVERGENCE_SEQUENCE = [False, False, False, True, False, False, False, False, True, True, False,
                       False, False, False]
_INTERVAL_NAMES = ("growth_interval", "period", "dynamic_growth_steps", "scale_window", "incr_every_n_steps")
_SCALE_NAMES = ("init_scale", "loss_scale", "scale", "initial_scale", "init_loss_scaling")


def _comparable_params(profile, start: float = 16.0, interval: int = 3) -> dict:
    params = {}
    for name, default in profile.defaults.items():
        if name in _INTERVAL_NAMES:
            params[name] = interval
        elif name in _SCALE_NAMES:
            params[name] = start
        elif default is REQUIRED:
            params[name] = 1
    return params


def _describe(rules) -> tuple:
    floor = "none" if rules.floor is None else f"{rules.floor:g} ({rules.floor_action})"
    if rules.stop_at is not None:
        floor += f"; stops at {rules.stop_at:g}"
    cap = {"keep": "keeps old scale", "clamp": "clamps to f32 max", "inf": "becomes inf"}[rules.on_growth_overflow]
    if rules.max_scale is not None:
        cap = f"hard max {rules.max_scale:g}"
    extras = []
    if rules.hysteresis is not None:
        extras.append(f"hysteresis {rules.hysteresis} ({rules.hysteresis_style})")
    if rules.tolerance is not None:
        extras.append(f"tolerance {rules.tolerance:g}")
    if rules.backoff_every > 1:
        extras.append(f"backoff after {rules.backoff_every} bad")
    if rules.flush_subnormals:
        extras.append("FTZ")
    return floor, cap, ", ".join(extras) or "-"


def _driven_against(profile: str) -> str:
    """The package versions the adapters of ``profile`` were checked on (from the adapter table)."""
    from fpemu.adapters import adapters_of_kind
    versions = [", ".join(a.verified) + (f" (environment {a.environment})" if a.environment else "")
                for a in adapters_of_kind("scaler").values() if a.profile == profile]
    return "; ".join(dict.fromkeys(versions)) or "-"  # several adapters of one profile share their versions


def _floor_cell(name: str, params: dict) -> str:
    """Where 12 overflows from 2^-120 leave the scale, or why the implementation refuses that start
    (megatron asserts its default min_scale 1.0 is at most the initial scale)."""
    try:
        floor = simulate_scaler([True] * 12, name, **params)
    except ValueError as refused:
        return f"refused: {str(refused).split(': ', 1)[-1]}"
    stopped = f" (raised at step {floor.stopped_at})" if floor.stopped_at is not None else ""
    return f"{floor.final_scale:.6g}{stopped}"


def profiles_report(plot: bool = True) -> str:
    """profiles.md; ``plot``: whether plots/profiles.png is written beside it (matplotlib installed)."""
    rows = []
    for profile in PROFILES.values():
        rules = profile.rules(**_comparable_params(profile))
        floor, cap, extras = _describe(rules)
        timing = rules.growth_timing if rules.dynamic else "no growth"
        rows.append((profile.name, profile.implementation, profile.verified, timing, rules.arithmetic,
                     rules.backoff, floor, cap, profile.unscale, profile.check_on, extras))
    semantics = markdown_table(["profile", "implementation", "verified", "grows on", "arithmetic",
                                "backoff", "floor", "when growth overflows", "unscale", "inf check on",
                                "also"], rows)
    traces = {name: simulate_scaler(DIVERGENCE_SEQUENCE, name, **_comparable_params(profile))
              for name, profile in PROFILES.items()}
    reference = traces["torch"]
    header = ["step", "overflow"] + list(traces)
    step_rows = []
    for step, overflow in enumerate(DIVERGENCE_SEQUENCE):
        cells = []
        for trace in traces.values():
            if step >= trace.attempts:
                cells.append("(stopped)")
                continue
            mark = "" if trace.applied[step] else " skip"
            cells.append(f"{trace.scales[step]:g}{mark}")
        step_rows.append([step, "X" if overflow else ""] + cells)
    divergence = []
    for name, trace in traces.items():
        first = next((i for i in range(min(trace.attempts, reference.attempts))
                      if trace.scales[i] != reference.scales[i] or trace.applied[i] != reference.applied[i]),
                     None)
        divergence.append((name, "-" if first is None else first, trace.attempts, trace.completed_updates,
                           trace.skipped_updates, f"{trace.final_scale:g}"))
    extremes = []
    for name, profile in PROFILES.items():
        if not profile.rules(**_comparable_params(profile)).dynamic:
            continue
        ceiling = simulate_scaler([False] * 6, name, **_comparable_params(profile, 1e38, 1))
        extremes.append((name, f"{ceiling.final_scale:.9g} ({float(ceiling.final_scale).hex()})",
                         _floor_cell(name, _comparable_params(profile, 2.0**-120, 1))))
    sources = markdown_table(["profile", "verified", "driven against", "source read", "notes"],
                             [(p.name, p.verified, _driven_against(p.name), p.source, p.notes)
                              for p in PROFILES.values()])
    return ("# Loss-scaler profiles\n\n"
            "Every profile side by side, with a growth interval of 3 and a start of 16 where the "
            "implementation has those parameters (other parameters: the implementation's defaults). "
            "`driven` profiles are checked bit for bit against the installed package by the test "
            "suite; `source-derived` ones are pinned by trajectories worked out from their source.\n\n"
            + semantics + "\n\n"
            "Terms. grows on: `N` the N-th consecutive good step, `N+1` the step after, `window` whenever the "
            "steps since the last overflow are a multiple of N, `window+1` DeepSpeed FP16_Optimizer's "
            "stable_interval rule. arithmetic: `fp32` float32 multiply, `fp64_to_fp32` float64 product rounded "
            "once to float32, `python` Python floats. backoff: `multiply` by backoff_factor, `divide` by the "
            "growth factor, `reciprocal` multiply by float32(1/factor). unscale: `mul_recip_fp64` "
            "g * float32(1/float64(s)), `mul_recip_fp32` g * (float32(1)/s), `divide` g / s. FTZ: subnormal "
            "results flush to zero (XLA on the CPU).\n\n## The same overflow sequence through every profile\n\n"
            "Scale used at each step; `skip` marks a step whose optimizer update did not run; X marks "
            "an overflow.\n\n" + markdown_table(header, step_rows)
            + "\n\n## Where each profile first departs from torch.amp.GradScaler\n\n"
            + markdown_table(["profile", "first step that differs", "attempts", "completed updates",
                              "skipped updates", "final scale"], divergence)
            + ("\n\n![profiles](plots/profiles.png)" if plot
               else "\n\n_matplotlib is not installed: the plot of these trajectories is skipped._")
            + "\n\n## At the edges of float32\n\n"
            "Six good steps from a scale of 1e38 with growth every step (where growth overflows: keep, "
            "clamp, inf, or a Python float that grows past float32), and twelve overflows from 2^-120 "
            "(floors, flush to zero, a raise).\n\n"
            + markdown_table(["profile", "scale after 6 growths from 1e38", "scale after 12 overflows from 2^-120"],
                             extremes)
            + "\n\n## Sources\n\n" + sources + "\n")


def _matplotlib_missing() -> bool:
    import importlib.util
    return importlib.util.find_spec("matplotlib") is None


def profiles_plot(folder: pathlib.Path) -> pathlib.Path:
    from fpemu.reports.plots import scale_trajectories
    traces = {name: simulate_scaler(DIVERGENCE_SEQUENCE, name, **_comparable_params(profile))
              for name, profile in PROFILES.items() if profile.rules(**_comparable_params(profile)).dynamic}
    return scale_trajectories(folder / "plots" / "profiles.png",
                              "Every dynamic profile on one overflow sequence (interval 3, start 16)",
                              {name: t.scales for name, t in traces.items()}, DIVERGENCE_SEQUENCE)


def _load_traces(folder) -> list:
    """The traces in ``folder``, each refused (TraceError naming the file) where its steps are not of its
    spec's kind: the report draws a trace by its spec's kind."""
    if folder is None or not pathlib.Path(folder).is_dir():
        return []
    return [read_trace_checked(path) for path in sorted(pathlib.Path(folder).glob("*.json"))]


_STATUS_ORDER = tuple(STATUSES)  # failures first, then known divergences, skips and matches
_STATUS_NOUNS = {"known divergence": ("known divergence", "known divergences"), "match": ("match", "matches")}


NO_COMPARISONS = ("no comparisons: pass `--diff` with the results of `fpemu diff ... --json > diff.json` (or "
                  "reports/diff.json of `fpemu run`) and `--observed` with the folder of `fpemu diff --save`")
_NOTED = (SKIPPED,) + JOB_FAILURES  # statuses whose note says why there is no trace


def _headline(verdicts) -> str:
    parts = []
    for status in _STATUS_ORDER:
        count = sum(v["status"] == status for v in verdicts)
        if count:
            parts.append(f"{count} {_STATUS_NOUNS.get(status, (status, status))[count != 1]}")
    return ", ".join(parts) or NO_COMPARISONS


def _linked(text: str) -> str:
    return text.replace("docs/steps.md", "[docs/steps.md](../docs/steps.md)")


def _verdict_rows(verdicts) -> list:
    rows = []
    for v in sorted(verdicts, key=lambda v: (_STATUS_ORDER.index(v["status"]), v["spec"])):
        div = v.get("divergence")
        field = f"{div['field']} of {div['element']}" if div and div.get("element") else div and div["field"]
        where = "-" if not div else f"step {div['step']}, {field}: expected {div['expected']}, got {div['got']}"
        status = f"**{v['status']}**" if STATUSES[v["status"]][1] else v["status"]
        rows.append((f"[{v['spec']}](#{v['spec']})", v["implementation"], status, where,
                     _linked(div["cause"]) if div else "-", _linked(v.get("note") or "-")))
    return rows


def _scenario_section(folder, name, trace, observed, verdicts, plots_ok) -> tuple:
    """The markdown of one scenario and the plots it wrote."""
    from fpemu.traces import decode_value
    spec = trace.metadata["spec"]
    final = decode_value(trace.summary, "final_scale")
    lines = [f"### {name}", "", spec["text"].split("\n")[0].removeprefix("description = ").strip('"'), "",
             f"profile `{trace.metadata['profile']}` ({trace.metadata.get('verified', '')}); "
             f"{trace.summary['attempts']} attempts, {trace.summary['completed_updates']} completed updates, "
             f"{trace.summary['skipped_updates']} skipped"
             # fp8 training traces have no loss scale, so no final scale
             + ("" if final is None else f"; final scale {final:.9g} (`{final.hex()}`)"), ""]
    diverges_at = {}
    for v in verdicts:
        step = v["divergence"]["step"] if v.get("divergence") else None
        if step is not None:
            diverges_at[v["implementation"]] = (step, v["divergence"]["field"])
        lines.append(f"- {v['implementation']}: **{v['status']}**"
                     + (f" from step {step} ({v['divergence']['field']})" if step is not None else "")
                     + (f"; {v['note']}" if v.get("note") and v["status"] in _NOTED else ""))
    written = []
    kind = kind_of_trace(trace)  # None: a run made from no spec (recorded, emulated), whose scale is a loss scale
    scale_label = kind.scale_label if kind is not None else "loss scale" if "scale" in trace.steps[0] else None
    if not plots_ok or scale_label is None:
        return "\n".join(lines), written
    from fpemu.reports.plots import scale_trajectories, shares_per_step, ulp_histogram
    series = {"reference": trace.column("scale")}
    series.update({other.implementation: other.column("scale") for other in observed if "scale" in other.steps[0]})
    status = ", ".join(f"{v['implementation']} {v['status']}" for v in verdicts) or "reference only"
    plot = scale_trajectories(folder / "plots" / f"{name}.png", f"{name}: {status}", series,
                              trace.column("overflow"), diverges_at,
                              scale_label,
                              diverged_fields(trace, observed, verdicts), departures(verdicts))
    written.append(plot)
    lines += ["", f"![{name}](plots/{plot.name})"]
    if "underflow_share" in trace.steps[0]:
        shares = {label: trace.column(f"{label}_share") for label in ("underflow", "subnormal", "overflow")}
        plot = shares_per_step(folder / "plots" / f"{name}.shares.png",
                               f"{name}: what the scaled gradients lose in the compute format", shares)
        written.append(plot)
        lines += ["", f"![{name} shares](plots/{plot.name})"]
    distances = _ulp_distances(trace, observed) if "loss" in trace.steps[0] else {}
    if distances:
        plot = ulp_histogram(folder / "plots" / f"{name}.ulp.png",
                             f"{name}: float32 ulp distance to the emulation, per step", distances)
        written.append(plot)
        lines += ["", _ulp_table(trace, observed, distances), "", f"![{name} ulp](plots/{plot.name})"]
    return "\n".join(lines), written


def diverged_fields(trace, observed, verdicts) -> dict:
    """field -> {label: value per step} for each field other than the scale where a verdict's first
    divergence is and that every step records as one number (the plot's extra panels)."""
    out = {}
    for field in dict.fromkeys(v["divergence"]["field"] for v in verdicts if v.get("divergence")):
        if field == "scale" or not all(_one_number(record.get(field)) for record in trace.steps):
            continue
        out[field] = {"reference": trace.column(field)}
        out[field].update({other.implementation: other.column(field) for other in observed
                           if other.steps and all(_one_number(record.get(field)) for record in other.steps)})
    return out


def departures(verdicts) -> dict:
    """field -> [(implementation, step, its value)] of each first divergence whose value is one number."""
    out = {}
    for v in verdicts:
        div = v.get("divergence")
        if not div or div.get("element"):
            continue
        try:
            value = float(str(div["got"]).split(" ")[0].strip("'"))  # "0.5 (0x1.0p-1)": the value, then its hex
        except ValueError:
            continue
        out.setdefault(div["field"], []).append((v["implementation"], int(div["step"]), value))
    return out


def _one_number(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) or value in ("nan", "inf", "-inf")


# What the report reads of each verdict of a diff result: key -> (a check, what it expects).
_VERDICT_KEYS = {
    "spec": (lambda v: isinstance(v, str), "a string"),
    "implementation": (lambda v: isinstance(v, str), "a string"),
    "status": (lambda v: v in STATUSES, f"one of {', '.join(STATUSES)}"),
    "note": (lambda v: v is None or isinstance(v, str), "null or a string"),
    "divergence": (lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("field"), str)
                                           and isinstance(v.get("step"), int) and isinstance(v.get("cause"), str)
                                           and isinstance(v.get("element", ""), (str, type(None)))),
                   "null or an object with step, field and cause"),
}


def _read_verdicts(path) -> list:
    """The verdicts of a diff result, bounded before parsing (fpemu.traces.schema) and checked before use."""
    body = bounded_json(read_bounded(path, FpemuInputError, READ_LIMITS["bytes"]), str(path), FpemuInputError,
                        "a diff result")
    verdicts = body.get("verdicts") if isinstance(body, dict) else None
    if not isinstance(verdicts, list):
        raise FpemuInputError(f"{path}: not a diff result (expected the JSON that `fpemu run` writes, "
                              "with a 'verdicts' list)")
    for index, verdict in enumerate(verdicts):
        if not isinstance(verdict, dict):
            raise FpemuInputError(f"{path}: verdicts[{index}]: expected an object")
        for key, (fits, expected) in _VERDICT_KEYS.items():
            if not fits(verdict.get(key)):
                raise FpemuInputError(f"{path}: verdicts[{index}].{key}: expected {expected}, got "
                                      f"{json.dumps(verdict.get(key))[:60]}")
    return verdicts


def harness_report(folder: pathlib.Path, golden_dir, observed_dir, diff_file) -> list:
    """harness.md: every spec against every implementation, first divergences, and plots."""
    golden = {t.spec_name: t for t in _load_traces(golden_dir)}
    observed = {}
    for trace in _load_traces(observed_dir):
        observed.setdefault(trace.spec_name, []).append(trace)
    verdicts = _read_verdicts(diff_file) if diff_file else []
    plots_ok = not _matplotlib_missing()
    written, sections = [], []
    for name, trace in golden.items():
        section, plots = _scenario_section(folder, name, trace, observed.get(name, []),
                                           [v for v in verdicts if v["spec"] == name], plots_ok)
        sections.append(section)
        written += plots
    text = ("# Differential harness\n\n"
            f"**{_headline(verdicts)}.** Each real implementation was driven through each spec's overflow sequence "
            "(or, for step specs, its data) and compared with fpemu's golden trace, step by step: scales bit for "
            "bit (float hex), flags and counters exactly, losses and weights by float32 ulp distance. A `known "
            "divergence` is declared in the spec (with its reason) and is not a failure. Divergences come first.\n\n"
            + markdown_table(["spec", "implementation", "status", "first divergence", "likely cause", "note"],
                             _verdict_rows(verdicts))
            + ("\n\n_matplotlib is not installed: plots skipped._" if not plots_ok else "")
            + "\n\n## Scenarios\n\n" + "\n\n".join(sections) + "\n")
    written.insert(0, atomic_write(folder / "harness.md", text))
    return written


def _ulp_distances(golden, traces) -> dict:
    """'implementation: field' -> per-step float32 ulp distances (elementwise max for tensors)."""
    from fpemu.compare import ulp_distance
    return {f"{trace.implementation}: {field}": [ulp_distance(expected, got) for expected, got
                                                 in zip(golden.column(field), trace.column(field))]
            for trace in traces for field in ("loss", "params") if field in trace.steps[0]}


def _ulp_table(golden, traces, distances: dict) -> str:
    """Per implementation and output: bit-exact steps, max ulp, and the max relative error."""
    rows = []
    for trace in traces:
        for field in ("loss", "params"):
            label = f"{trace.implementation}: {field}"
            if label not in distances:
                continue
            relative = 0.0
            for expected, got in zip(golden.column(field), trace.column(field)):
                pairs = zip(expected, got) if isinstance(expected, list) else [(expected, got)]
                for a, b in pairs:
                    if math.isfinite(a) and math.isfinite(b) and a != b:
                        relative = max(relative, abs(a - b) / max(abs(a), abs(b)))
            values = distances[label]
            rows.append((label, len(values), sum(v == 0 for v in values), max(values), f"{relative:.3g}"))
    return markdown_table(["implementation: output", "steps", "bit-exact steps", "max ulp",
                           "max relative error (finite values)"], rows)


def index_report(folder: pathlib.Path) -> str:
    """reports/README.md: what each report holds, benchmark results included."""
    entries = [("formats.md", "number formats and what gradient tensors lose in each"),
               ("profiles.md", "every loss-scaler profile side by side"),
               ("harness.md", "real implementations vs golden traces (`fpemu run`)")]
    for path in sorted(folder.glob("bench_*.md")) + sorted(folder.glob("exhaustive_*.md")):
        title = path.read_text().splitlines()[0].lstrip("# ")
        entries.append((path.name, f"benchmark: {title}"))
    for path in sorted(folder.glob("*.md")):
        if path.name not in {e[0] for e in entries} | {"README.md"}:
            entries.append((path.name, path.read_text().splitlines()[0].lstrip("# ")))
    for path in sorted(folder.glob("*/README.md")):  # a folder of pages (reports/recipes/) is one row: its index
        entries.append((f"{path.parent.name}/README.md", path.read_text().splitlines()[0].lstrip("# ")))
    rows = [(f"[{name}]({name})", what) for name, what in entries if (folder / name).exists()]
    return "# fpemu reports\n\nWritten by `fpemu run` / `fpemu report`; benchmarks by `benchmarks/*.py`.\n\n" + \
        markdown_table(["report", "what it shows"], rows) + "\n"


def write_all(folder, golden_dir=None, observed_dir=None, diff_file=None) -> list:
    """Write every report that the given inputs allow into ``folder``."""
    folder = pathlib.Path(folder)
    plots_ok = not _matplotlib_missing()
    written = [atomic_write(folder / "formats.md", formats_report()),
               atomic_write(folder / "profiles.md", profiles_report(plot=plots_ok))]
    if plots_ok:
        written.append(profiles_plot(folder))
    if golden_dir is not None or diff_file is not None:
        written += harness_report(folder, golden_dir, observed_dir, diff_file)
    written.append(atomic_write(folder / "README.md", index_report(folder)))
    return written
