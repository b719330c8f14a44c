"""PNG plots for the reports (matplotlib, imported on first use, drawn off-screen)."""

from __future__ import annotations

import math
import pathlib

from fpemu.figures import log_scale, pyplot, save_png, whole_steps


def _divergence(value) -> tuple:
    """(step, field) of a first divergence given as (step, field) or as a bare step."""
    if isinstance(value, (tuple, list)):
        return int(value[0]), str(value[1])
    return int(value), ""


def _two_binades(ax, values) -> None:
    """A log2 axis that shows at least two powers of two, so at least two labelled ticks (scales between
    224 and 448 showed 2^8 alone)."""
    finite = [v for v in log_scale(values) if not math.isnan(v)]
    if not finite:
        return
    low, high = math.log2(min(finite)), math.log2(max(finite))
    if math.floor(high) - math.ceil(low) >= 1:  # two powers of two inside the data already
        return
    bottom, top = math.floor(low), math.ceil(high)
    if top - bottom < 2:  # one power of two on the edge, or a constant scale that is one
        bottom, top = (bottom - 1, top + 1) if bottom == top else (bottom, bottom + 2)
    ax.set_ylim(2.0 ** bottom * 0.9, 2.0 ** top / 0.9)


def _field_panel(ax, field: str, series: dict, departures=()) -> None:
    """One diverged field per step, a line per implementation (log2 axis where every value is > 0), and a
    point at each first divergence: (label, step, the implementation's value there)."""
    for label, step, value in departures:
        ax.scatter([step], [value], marker="D", s=28, zorder=6, label=f"{label}: {value:.6g} at step {step}")
    for rank, (label, values) in enumerate(series.items()):
        numbers = [float(v) if v is not None else math.nan for v in values]
        ax.step(range(len(numbers)), numbers, where="post", label=label,
                linewidth=3.0 if rank == 0 else 1.6, alpha=0.6 if rank == 0 else 0.95)
    every = [float(v) for values in series.values() for v in values if v is not None]
    finite = [v for v in every if math.isfinite(v)]
    if finite and min(finite) > 0 and max(finite) / min(finite) >= 4:
        ax.set_yscale("log", base=2)
    ax.set_ylabel(field, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def draw_scale_trajectories(title: str, series: dict, overflow, diverges_at: dict = None, ylabel: str = "loss scale",
                            fields: dict = None, departures: dict = None):
    """The figure of :func:`scale_trajectories` (not saved)."""
    diverges_at = {label: _divergence(at) for label, at in (diverges_at or {}).items()}
    fields = fields or {}
    plt = pyplot()
    fig, axes = plt.subplots(1 + len(fields), 1, figsize=(8, 3.4 + 2.2 * len(fields)), sharex=True, squeeze=False,
                             height_ratios=[3.4] + [2.2] * len(fields))
    ax = axes[0, 0]
    merged = {}
    for label, scales in series.items():
        key = (label,) if label in diverges_at else tuple(float(v).hex() for v in scales)
        merged.setdefault(key, (scales, []))[1].append(label)
    markers = []
    for rank, (scales, labels) in enumerate(merged.values()):
        label = " = ".join(labels)
        if labels[0] in diverges_at:
            step, field = diverges_at[labels[0]]
            label += f" (differs from step {step}" + (f", {field})" if field else ")")
        line = ax.step(range(len(scales)), log_scale(scales), where="post", label=label,
                       linewidth=3.0 if rank == 0 else 1.6, alpha=0.6 if rank == 0 else 0.95)[0]
        if labels[0] in diverges_at:
            markers.append((diverges_at[labels[0]], line.get_color()))
    for (step, field), color in markers:
        for panel in axes[:, 0]:
            panel.axvline(step, color=color, linestyle="--", linewidth=1)
        # The marker says which field departs first (a scale that agrees can hide a counter that does not).
        ax.annotate(f"step {step}: {field}" if field else f"step {step}", xy=(step, 1.0),
                    xycoords=("data", "axes fraction"), xytext=(3, -3), textcoords="offset points",
                    ha="left", va="top", fontsize=7, color=color, rotation=90)
    first = next(iter(series.values()))
    marks = [i for i, flag in enumerate(overflow) if flag and i < len(first)]
    if marks:
        ax.scatter(marks, [log_scale(first)[i] for i in marks], marker="x", color="red", zorder=5,
                   label="overflow")
    ax.set_yscale("log", base=2)
    _two_binades(ax, [v for scales in series.values() for v in scales])
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    for panel, (field, values) in zip(axes[1:, 0], fields.items()):  # the fields that diverged, beside the scale
        _field_panel(panel, field, values, (departures or {}).get(field, ()))
    axes[-1, 0].set_xlabel("step")
    whole_steps(axes[-1, 0])
    return fig


def scale_trajectories(path, title: str, series: dict, overflow, diverges_at: dict = None, ylabel: str = "loss scale",
                       fields: dict = None, departures: dict = None) -> pathlib.Path:
    """Scale per step, one line per implementation; red marks on overflow steps; below it, a panel per
    other field that diverged, so the plot shows what departed (an update ratio under an agreeing scale).

    Args:
      series: label -> list of scales (the first is drawn thickest: the reference).
      overflow: per-step overflow flags of the scenario.
      diverges_at: label -> (first divergent step, its field) (or a bare step), for implementations
        that depart from the reference: they get a line of their own and a dashed marker at that
        step naming the field.  Other labels with identical trajectories share one line, labelled
        "a = b".
      ylabel: what the scale is (``fp8 scale`` for an fp8 recipe's).
      fields: field -> {label: its value per step}, for the fields other than the scale that diverged.
      departures: field -> [(label, step, value)]: each first divergence in that field, marked with the
        implementation's value (drawn where the implementation's own trace is not at hand).
    """
    return save_png(draw_scale_trajectories(title, series, overflow, diverges_at, ylabel, fields, departures), path)


def draw_shares_per_step(title: str, shares: dict):
    """The figure of :func:`shares_per_step` (not saved)."""
    plt = pyplot()
    labels = list(shares)
    fig, axes = plt.subplots(len(labels), 1, figsize=(8, 1.3 + 1.05 * len(labels)), sharex=True, squeeze=False)
    colors = {"underflow": "tab:blue", "subnormal": "tab:orange", "overflow": "tab:red"}
    for ax, label in zip(axes[:, 0], labels):
        values = [100 * v for v in shares[label]]
        color = colors.get(label, None)
        ax.fill_between(range(len(values)), values, step="mid", alpha=0.25, color=color, linewidth=0)
        ax.step(range(len(values)), values, where="mid", color=color, linewidth=1.4)
        nonzero = [i for i, v in enumerate(values) if v > 0]
        if nonzero and len(nonzero) <= len(values) // 4:  # a few blips: mark each so none is missed
            ax.scatter(nonzero, [values[i] for i in nonzero], color=color, s=12, zorder=5)
        top = max(values, default=0.0)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
        ax.set_ylabel(f"{label}\n%", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if top == 0:
            ax.text(0.5, 0.5, f"{label}: 0 at every step", transform=ax.transAxes, ha="center", va="center",
                    fontsize=8, color="0.4")
        else:
            ax.text(0.995, 0.92, f"max {top:.3g}%", transform=ax.transAxes, ha="right", va="top", fontsize=7)
    axes[0, 0].set_title(title, fontsize=10)
    axes[-1, 0].set_xlabel("step")
    return fig


def shares_per_step(path, title: str, shares: dict) -> pathlib.Path:
    """Underflow / subnormal / overflow shares of the scaled gradients per step, one panel each with its
    own scale: no series is drawn over another, and a blip of 0.1% is as visible as a plateau of 60%."""
    return save_png(draw_shares_per_step(title, shares), path)


def draw_ulp_histogram(title: str, distances: dict):
    """The figure of :func:`ulp_histogram` (not saved)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.0))
    labels = list(distances)
    buckets = ["0", "1", "2-7", "8-255", ">=256"]
    edges = [(0, 0), (1, 1), (2, 7), (8, 255), (256, math.inf)]
    width = 0.8 / max(len(labels), 1)
    tallest = 1
    for index, label in enumerate(labels):
        counts = [sum(lo <= d <= hi for d in distances[label]) for lo, hi in edges]
        tallest = max(tallest, *counts)
        ax.bar([b + index * width for b in range(len(buckets))], counts, width=width, label=label)
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(buckets))], buckets)
    ax.set_xlabel("ulp distance (float32)")
    ax.set_ylabel("steps (log scale)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(0, tallest * 2)  # headroom: the tallest bar is not cut by the frame
    ax.set_title(title, fontsize=10)
    # Beside the axes, never over the bars.
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def ulp_histogram(path, title: str, distances: dict) -> pathlib.Path:
    """Histogram of ulp distances per output field (0 = bit-exact)."""
    return save_png(draw_ulp_histogram(title, distances), path)


def draw_behaviour_grid(title: str, rows: list, columns: list, letters: list, changed: list):
    """The figure of :func:`behaviour_grid` (not saved)."""
    plt = pyplot()
    palette = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(1.6 + 1.1 * len(columns), 0.9 + 0.42 * len(rows)))
    for r, row in enumerate(letters):
        for c, letter in enumerate(row):
            traced = len(letter) == 1 or letter.startswith("#")
            color = palette((ord(letter[0]) - ord("A")) % 10) if traced else (0.85, 0.85, 0.85)
            ax.add_patch(plt.Rectangle((c, r), 1, 1, facecolor=color, edgecolor="white", linewidth=1))
            ax.text(c + 0.5, r + 0.5, letter if traced else letter.replace(" ", "\n"), ha="center", va="center",
                    fontsize=9 if traced else 6)
    for r, row in enumerate(changed):  # outlines last: a neighbour's white edge must not cover them
        for c, marked in enumerate(row):
            if marked:
                ax.add_patch(plt.Rectangle((c + 0.04, r + 0.06), 0.92, 0.88, fill=False, edgecolor="black",
                                           linewidth=2.2))
    ax.set_xlim(0, len(columns))
    ax.set_ylim(len(rows), 0)
    ax.set_xticks([c + 0.5 for c in range(len(columns))], columns, rotation=30, ha="right", fontsize=8)
    ax.set_yticks([r + 0.5 for r in range(len(rows))], rows, fontsize=8)
    ax.tick_params(length=0)
    ax.set_title(title + " (a letter per behaviour; outlined: changed)", fontsize=10)
    return fig


def behaviour_grid(path, title: str, rows: list, columns: list, letters: list, changed: list) -> pathlib.Path:
    """A row per spec and implementation, a column per version set: each cell coloured by its
    behaviour letter (grey: no trace), outlined where the behaviour changed from the column before."""
    return save_png(draw_behaviour_grid(title, rows, columns, letters, changed), path)
