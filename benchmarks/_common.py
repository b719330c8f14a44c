"""Shared output of the benchmarks: a markdown table and the raw JSON in reports/."""

from __future__ import annotations

import json
import os
import pathlib
import tempfile

REPORTS = pathlib.Path(__file__).resolve().parent.parent / "reports"


def atomic_write(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.replace(tmp, path)


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


def write_report(stem: str, title: str, result: dict, rows, columns, notes) -> None:
    text = f"# {title}\n\n" + markdown_table(rows, columns) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    atomic_write(REPORTS / f"{stem}.md", text)
    atomic_write(REPORTS / f"{stem}.json", json.dumps(result, indent=2, sort_keys=True) + "\n")
