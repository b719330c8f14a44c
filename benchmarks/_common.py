"""Shared output of the benchmarks: a markdown table and the raw JSON in reports/."""

from __future__ import annotations

import json
import pathlib

from fpemu.fileio import atomic_write

REPORTS = pathlib.Path(__file__).resolve().parent.parent / "reports"


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
