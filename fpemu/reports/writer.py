"""Writes the reports of ``fpemu run``."""

from __future__ import annotations

import os
import pathlib
import tempfile

import numpy as np

from fpemu.formats import FORMATS, range_stats


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


def write_all(folder) -> list:
    folder = pathlib.Path(folder)
    return [atomic_write_text(folder / "formats.md", formats_report())]
