"""reports/upgrades.md: behaviour per released version, from the results of ``fpemu matrix`` and ``fpemu bisect``.

Each matrix or bisection writes its results file ``reports/upgrades/<name>.json`` (host-free:
labels, versions, behaviour letters, change lines); the markdown is regenerated from every
results file in that folder, so matrices recorded at different times share one report and a
rerun of one replaces only its own section.
"""

from __future__ import annotations

import json
import pathlib

from fpemu.errors import FpemuInputError
from fpemu.fileio import atomic_write, read_bounded, read_text
from fpemu.harness.matrix import RESULTS_FORMAT, UNKNOWN
from fpemu.traces.schema import READ_LIMITS, bounded_json

RESULTS_FOLDER = "upgrades"
REPORT = "upgrades.md"
MODEL_MARK = "✓"  # bit-identical to fpemu's reference model of the spec
CHANGE_MARK = "◆"  # differs from the previous column that ran

_HEAD = f"""# Behaviour per released version

Written by `fpemu matrix` and `fpemu bisect` from their results files in `{RESULTS_FOLDER}/`:
each column is one isolated environment (the packages named, fpemu's core dependencies, the
Python shown), in which the specs were recorded by `fpemu record`.  A letter is one behaviour:
two cells of a row share a letter exactly when their step records and summaries agree bit for
bit (A is the first behaviour in the row).  {MODEL_MARK} marks a trace bit-identical to fpemu's
reference model of the spec; **{CHANGE_MARK}** marks a cell whose behaviour differs from the
previous column that ran (its change is listed under the table), and "= X" a change back to the
behaviour first seen in column X.  A cell without a trace names its status: `api changed`,
`cannot run` (the job raised), `cannot install` (pip could not install the set), `skipped`.
XLA and torch compile for the CPU they run on, so step numerics are those of one x86-64 CPU.
"""


def read_results(path) -> dict:
    """A results file; anything else is an input error naming it."""
    body = bounded_json(read_bounded(path, FpemuInputError, READ_LIMITS["bytes"]), str(path), FpemuInputError,
                        "a matrix results file")
    if not isinstance(body, dict) or body.get("format") != RESULTS_FORMAT:
        raise FpemuInputError(f"{path}: not an fpemu matrix results file (format {RESULTS_FORMAT!r})")
    return body


def _cell_text(cell: dict) -> str:
    text = f"`{cell['status']}`" if cell["digest"] is None else \
        cell["behaviour"] + (f" {MODEL_MARK}" if cell["model"] == "match" else "")
    if cell["change"] is not None:
        text = f"**{text} {CHANGE_MARK}**" + (f" = {cell['returns_to']}" if cell["returns_to"] else "")
    return text


def _table(results: dict) -> list:
    columns = results["columns"]
    lines = ["| spec / implementation | " + " | ".join(c["label"] for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for row in results["rows"]:
        cells = [_cell_text(cell) for cell in row["cells"]]
        lines.append(f"| {row['spec']} / {row['implementation']} | " + " | ".join(cells) + " |")
    return lines


def change_lines(results: dict) -> list:
    labels = [c["label"] for c in results["columns"]]
    lines = []
    for row in results["rows"]:
        previous = None
        for label, cell in zip(labels, row["cells"]):
            if cell["change"] is not None:
                back = f" (back to the behaviour of {cell['returns_to']})" if cell["returns_to"] else ""
                lines.append(f"- {row['spec']} / {row['implementation']}, {previous} -> {label}{back}: "
                             f"{cell['change']}")
            if cell["status"] not in UNKNOWN:
                previous = label
    return lines or ["- none: every row behaves the same in every column that ran"]


def _without_trace(results: dict) -> list:
    """One line per failure (status and note, versions aside), naming the rows and columns that share it."""
    from fpemu.harness.matrix import Cell, cell_key
    labels = [c["label"] for c in results["columns"]]
    groups = {}
    for row in results["rows"]:
        for label, cell in zip(labels, row["cells"]):
            if cell["digest"] is None:
                key = cell_key(Cell(cell["status"], None, cell["note"]))
                groups.setdefault(key, (cell["status"], cell["note"], []))[2].append((row, label))
    lines = []
    for status, note, where in groups.values():
        rows = sorted({f"{r['spec']} / {r['implementation']}" for r, _ in where})
        columns = [label for label in labels if any(label == at for _, at in where)]
        lines.append(f"- `{status}` in {', '.join(columns)} ({len(rows)} row{'s' * (len(rows) != 1)}: "
                     f"{', '.join(rows)}): {note or 'no message'}")
    return lines


def _bisect_lines(bisect: dict) -> list:
    lines = [f"Bisection of {bisect['package']} over {len(bisect['versions'])} released versions "
             f"({bisect['versions'][0]} to {bisect['versions'][-1]}, those pip lists for Python "
             f"{bisect['python']}): {len(bisect['tested'])} environments ({', '.join(bisect['tested'])}).",
             "", f"Assumption: {bisect['assumption']}"]
    if bisect["cannot_install"]:
        lines += ["", f"Versions pip could not install (left out; a change is then placed between the nearest "
                      f"versions that installed): {', '.join(bisect['cannot_install'])}."]
    lines += ["", "Change points found:"]
    lines += [f"- {c['spec']} / {c['implementation']}: {c['before']} -> {c['after']}"
              + ("" if c["adjacent"] else f" (versions between them not tested: {', '.join(c['untested'])})")
              for c in bisect["changes"]] or ["- none"]
    return lines


def section(results: dict, plot: str = None) -> list:
    """The markdown of one matrix (``plot``: the grid image, relative to reports/, when drawn)."""
    columns = results["columns"]
    lines = [f"## {results['name']}", ""]
    if results.get("description"):
        lines += [results["description"], ""]
    lines += [f"Python {results['python']}. Columns:", ""]
    lines += [f"- {c['label']}: " + (f"environment `{c['environment']}`" if c["environment"]
                                      else "`" + " ".join(c["requirements"]) + "`")
              + (f"; installed {', '.join(f'{k} {v}' for k, v in c['packages'].items())}" if c["packages"] else "")
              for c in columns]
    lines += [""] + _table(results) + [""]
    if plot:
        lines += [f"![behaviour per version: {results['name']}]({plot})", ""]
    lines += ["What changed:", ""] + change_lines(results) + [""]
    without = _without_trace(results)
    if without:
        lines += ["Cells without a trace:", ""] + without + [""]
    if results.get("bisect"):
        lines += _bisect_lines(results["bisect"]) + [""]
    return lines


def _grid(results: dict, reports: pathlib.Path):
    """The behaviour grid of one matrix as a PNG under reports/plots/, or None without matplotlib or rows, or
    where a file there is no PNG (not one fpemu drew: it is left alone)."""
    path = reports / "plots" / f"upgrades_{results['name']}.png"
    if not results["rows"] or (path.exists() and not _is_png(path)):
        return None
    try:
        from fpemu.reports.plots import behaviour_grid
        behaviour_grid(path, f"{results['name']}: behaviour per version",
                       [f"{r['spec']} / {r['implementation']}" for r in results["rows"]],
                       [c["label"] for c in results["columns"]],
                       [[cell["behaviour"] for cell in r["cells"]] for r in results["rows"]],
                       [[cell["change"] is not None for cell in r["cells"]] for r in results["rows"]])
    except ImportError:  # matplotlib is optional: the report links no image it did not write
        return None
    return path.relative_to(reports).as_posix()


def _is_png(path: pathlib.Path) -> bool:
    with open(path, "rb") as handle:
        return handle.read(8) == b"\x89PNG\r\n\x1a\n"


def _results_or_none(path: pathlib.Path) -> dict | None:
    """The results file at ``path``, read once; None where the JSON file there is not one."""
    try:
        return read_results(path)
    except FpemuInputError:
        return None


def _owned_write(path: pathlib.Path, text: str) -> pathlib.Path | None:
    """Write ``text`` to ``path`` unless a file there is not one fpemu wrote (its first line is not the one
    fpemu writes): a matrix run in a user's own repository never overwrites their README.  None: left alone."""
    if path.exists() and read_text(path, FpemuInputError).split("\n", 1)[0] != text.split("\n", 1)[0]:
        return None
    return atomic_write(path, text)


def write_report(reports) -> pathlib.Path | None:
    """Regenerate reports/upgrades.md (and its plots) from every results file in reports/upgrades/ (a JSON
    file there that is none is not read); None where an upgrades.md fpemu did not write is there (it is
    left alone)."""
    reports = pathlib.Path(reports)
    lines = _HEAD.splitlines() + [""]
    for path in sorted((reports / RESULTS_FOLDER).glob("*.json")):
        results = _results_or_none(path)
        if results is not None:
            lines += section(results, _grid(results, reports))
    return _owned_write(reports / REPORT, "\n".join(lines).rstrip() + "\n")


def write_results(reports, results: dict) -> tuple:
    """Write one matrix's results file and regenerate the report and the reports' index (README.md), each
    only where the file there is fpemu's own (:func:`_owned_write`; a results file or a plot of the same name
    that fpemu did not write is left alone too); returns (the paths written, the paths left alone)."""
    from fpemu.reports.writer import index_report
    reports = pathlib.Path(reports)
    target = reports / RESULTS_FOLDER / f"{results['name']}.json"
    plot = reports / "plots" / f"upgrades_{results['name']}.png"
    path = None
    if not target.exists() or _results_or_none(target) is not None:
        path = atomic_write(target, json.dumps(results, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    plot_ours = not plot.exists() or _is_png(plot)
    report = write_report(reports)
    index = _owned_write(reports / "README.md", index_report(reports))
    written = [p for p in (path, report, index) if p is not None]
    left = [target] if path is None else []
    left += [] if plot_ours else [plot]
    left += [reports / name for name, done in ((REPORT, report), ("README.md", index)) if done is None]
    return written, left
