"""Writes the reports of ``fpemu run``."""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

from fpemu.formats import FORMATS, range_stats
from fpemu.scalers import PROFILES, simulate_scaler
from fpemu.scalers.profiles import REQUIRED


def atomic_write_text(path: pathlib.Path, text: str) -> pathlib.Path:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half-written."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


def markdown_table(header, rows) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def formats_report() -> str:
    rows = [(f.name, f"1-{f.exponent_bits}-{f.mantissa_bits}", f.bias, f.special,
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
            stat_rows.append((name, f"2^{int(np.log2(scale))}", f"{s.underflow_share:.2%}",
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


def _comparable_params(profile) -> dict:
    params = {}
    for name, default in profile.defaults.items():
        if name in _INTERVAL_NAMES:
            params[name] = 3
        elif name in _SCALE_NAMES:
            params[name] = 16.0
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


def profiles_report() -> str:
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
    sources = markdown_table(["profile", "source read", "notes"],
                             [(p.name, p.source, p.notes) for p in PROFILES.values()])
    return ("# Loss-scaler profiles\n\n"
            "Every profile side by side, with a growth interval of 3 and a start of 16 where the "
            "implementation has those parameters (other parameters: the implementation's defaults). "
            "`driven` profiles are checked bit for bit against the installed package by the test "
            "suite; `source-derived` ones are pinned by trajectories worked out from their source.\n\n"
            + semantics + "\n\n## The same overflow sequence through every profile\n\n"
            "Scale used at each step; `skip` marks a step whose optimizer update did not run; X marks "
            "an overflow.\n\n" + markdown_table(header, step_rows)
            + "\n\n## Where each profile first departs from torch.amp.GradScaler\n\n"
            + markdown_table(["profile", "first step that differs", "attempts", "completed updates",
                              "skipped updates", "final scale"], divergence)
            + "\n\n## Sources\n\n" + sources + "\n")


def write_all(folder) -> list:
    folder = pathlib.Path(folder)
    return [atomic_write_text(folder / "formats.md", formats_report()),
            atomic_write_text(folder / "profiles.md", profiles_report())]
