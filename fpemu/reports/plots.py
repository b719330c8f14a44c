"""PNG plots for the reports (matplotlib, imported on first use, drawn off-screen)."""

from __future__ import annotations

import io
import math
import pathlib

from fpemu.fileio import atomic_write


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path) -> pathlib.Path:
    buffer = io.BytesIO()
    # A fixed date keeps the PNG bytes the same from run to run.
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return atomic_write(path, buffer.getvalue(), "wb")


def _log_scale(values):
    return [v if v > 0 and math.isfinite(v) else float("nan") for v in values]


def scale_trajectories(path, title: str, series: dict, overflow, diverges_at: dict = None) -> pathlib.Path:
    """Scale per step, one line per implementation; red marks on overflow steps.

    Args:
      series: label -> list of scales (the first is drawn thickest: the reference).
      overflow: per-step overflow flags of the scenario.
      diverges_at: label -> first divergent step, for implementations that depart from the
        reference: they get a line of their own and a dashed marker at that step.  Other
        labels with identical trajectories share one line, labelled "a = b".
    """
    diverges_at = diverges_at or {}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.4))
    merged = {}
    for label, scales in series.items():
        key = (label,) if label in diverges_at else tuple(float(v).hex() for v in scales)
        merged.setdefault(key, (scales, []))[1].append(label)
    for rank, (scales, labels) in enumerate(merged.values()):
        label = " = ".join(labels)
        if labels[0] in diverges_at:
            label += f" (differs from step {diverges_at[labels[0]]})"
        line = ax.step(range(len(scales)), _log_scale(scales), where="post", label=label,
                       linewidth=3.0 if rank == 0 else 1.6, alpha=0.6 if rank == 0 else 0.95)[0]
        if labels[0] in diverges_at:
            ax.axvline(diverges_at[labels[0]], color=line.get_color(), linestyle="--", linewidth=1)
    first = next(iter(series.values()))
    marks = [i for i, flag in enumerate(overflow) if flag and i < len(first)]
    if marks:
        ax.scatter(marks, [_log_scale(first)[i] for i in marks], marker="x", color="red", zorder=5,
                   label="overflow")
    ax.set_yscale("log", base=2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def shares_per_step(path, title: str, shares: dict) -> pathlib.Path:
    """Underflow / subnormal / overflow shares of the scaled gradients per step."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.0))
    for label, values in shares.items():
        ax.plot(range(len(values)), [100 * v for v in values], label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("% of gradient elements")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def ulp_histogram(path, title: str, distances: dict) -> pathlib.Path:
    """Histogram of ulp distances per output field (0 = bit-exact)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.0))
    labels = list(distances)
    buckets = ["0", "1", "2-7", "8-255", ">=256"]
    edges = [(0, 0), (1, 1), (2, 7), (8, 255), (256, math.inf)]
    width = 0.8 / max(len(labels), 1)
    for index, label in enumerate(labels):
        counts = [sum(lo <= d <= hi for d in distances[label]) for lo, hi in edges]
        ax.bar([b + index * width for b in range(len(buckets))], counts, width=width, label=label)
    ax.set_xticks([b + 0.4 - width / 2 for b in range(len(buckets))], buckets)
    ax.set_xlabel("ulp distance (float32)")
    ax.set_ylabel("steps (log scale)")
    ax.set_yscale("symlog", linthresh=1)
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=7)
    return _save(fig, path)
