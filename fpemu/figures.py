"""Off-screen matplotlib figures saved as reproducible PNGs: the one drawing surface of every report.

matplotlib is imported on first use (the ``report`` extra); nothing of fpemu above the file helpers.
"""

from __future__ import annotations

import io
import math
import pathlib

from fpemu.fileio import atomic_write


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, path) -> pathlib.Path:
    """Write ``fig`` to ``path`` atomically and close it; no software tag, so the bytes repeat run to run."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight", metadata={"Software": None})
    pyplot().close(fig)
    return atomic_write(path, buffer.getvalue(), "wb")


def log_scale(values):
    """Values for a log axis: non-positive and non-finite ones become gaps (NaN)."""
    return [v if v > 0 and math.isfinite(v) else float("nan") for v in values]


def whole_steps(ax) -> None:
    """Step ticks at whole steps only (matplotlib puts them at 0.5 on a run of a few steps)."""
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
