"""Shared parts of the benchmarks: timing, and the markdown table and raw JSON in reports/."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

from fpemu.fileio import atomic_write

ROOT = pathlib.Path(__file__).resolve().parent.parent
REPORTS = ROOT / "reports"
# What a reader of any timing here must know (the timings take turns, so one run's ratios compare).
TIMING_NOTE = ("Timed on a 2-vCPU virtual machine where the same code runs up to 30-60% slower at some hours "
               "than at others; what is compared takes turns in one run, so the ratios of one run compare, "
               "the absolute times of two runs do not.")


def best_time(fn, repeats: int) -> tuple:
    """Best-of-repeats wall time of fn() and its last result."""
    out, best = None, float("inf")
    for _ in range(repeats):
        out = None  # free the last result first, so each call allocates into the same state
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def best_times_interleaved(fns, repeats: int) -> list:
    """Best-of-repeats time and last result of each fn, timed in alternating order.

    Each fn runs once untimed first, and the fns take turns (the order flips every
    round): a fn timed alone right after another's large allocations would pay for
    fresh pages (first-touch page faults) that the other does not, and a burst of
    load from another process hits them all alike.
    """
    outs = [fn() for fn in fns]  # warm-up: allocator and page state, caches, lazy imports
    best = [float("inf")] * len(fns)
    for round_ in range(repeats):
        order = range(len(fns)) if round_ % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            outs[i] = None
            start = time.perf_counter()
            outs[i] = fns[i]()
            best[i] = min(best[i], time.perf_counter() - start)
    return list(zip(best, outs))


def minor_page_faults(fn, repeats: int) -> float:
    """Minor page faults per call of fn, the mean over repeats calls after a warm-up call.

    A call whose peak memory exceeds what the allocator keeps between calls (glibc trims
    the heap top beyond its trim threshold) faults its pages in again every time.
    """
    fn()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(repeats):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / repeats


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return str(value)


def markdown_table(rows, columns) -> str:
    header = "| " + " | ".join(title for _, title in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(_cell(row.get(key)) for key, _ in columns) + " |" for row in rows]
    return "\n".join([header, rule, *body])


def write_report(stem: str, title: str, result: dict, rows, columns, notes, sections=()) -> None:
    """reports/<stem>.md (a table and its notes, then each of ``sections``: (heading, rows, columns,
    notes)) and reports/<stem>.json (``result``)."""
    text = f"# {title}\n\n" + markdown_table(rows, columns) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    for heading, section_rows, section_columns, section_notes in sections:
        text += (f"\n## {heading}\n\n" + markdown_table(section_rows, section_columns) + "\n\n"
                 + "\n".join(f"- {n}" for n in section_notes) + "\n")
    atomic_write(REPORTS / f"{stem}.md", text)
    atomic_write(REPORTS / f"{stem}.json", json.dumps(result, indent=2, sort_keys=True) + "\n")


def tree_digests(folder: pathlib.Path, skip=()) -> dict:
    """relative path -> sha256 of every file under ``folder``, less those under a folder named in ``skip``."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not set(skip) & set(p.relative_to(folder).parts)}


def run_fpemu(*args, cwd=ROOT, env=None) -> tuple:
    """(wall seconds, exit code) of ``python -m fpemu ARGS`` as a process of its own, this checkout first on
    its path; an exit code other than 0 or 1 (bad input, an internal error) ends the benchmark."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "fpemu", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"fpemu {' '.join(map(str, args))} exited {done.returncode}: {done.stderr[-2000:]}")
    return wall, done.returncode
