"""What every command shares: the default folders, the help formatter, progress, the result lines and
the JSON payload, the exit code the jobs ask for."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import sys


DEFAULT_SPECS = pathlib.Path("specs")
DEFAULT_REPORTS = pathlib.Path("reports")
# The main job writes beside the committed reports, not over them: on a machine without every framework its
# skipped rows would replace what a full run measured.  `--reports reports` refreshes the committed ones.
RUN_REPORTS = DEFAULT_REPORTS / "local"


def epilog() -> str:
    from fpemu.compare.diff import STATUSES
    return ("exit codes:\n"
            "  0  success: every job compared matched (or met its declared divergence); audit: nothing changed\n"
            "  1  a divergence, a changed behaviour (audit), a failed job (api changed, cannot run), or\n"
            "     nothing compared: every job skipped, or (audit) a baseline implementation skipped here;\n"
            "     --allow-skips accepts skips\n"
            "  2  bad usage or input: the message names the file, key or argument\n"
            "  3  an internal error (a bug in fpemu; the traceback is printed); the other jobs still ran\n\n"
            "job statuses: " + ", ".join(STATUSES) + "\n\n"
            "spec format: one TOML scenario per file, described in docs/harness.md and, per kind, in\n"
            "`python -m pydoc fpemu.kinds.<kind>.spec` (scaler, step, recipe, fp8_training, blocks, ranks);\n"
            "the checkout's specs/ holds examples of every kind.")


class Formatter(argparse.HelpFormatter):
    """Wraps descriptions; keeps the epilog's lines (the exit-code table) as written."""

    def _fill_text(self, text, width, indent):
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def _silent(done: int, total: int, label: str) -> None:
    pass


class ProgressBar:
    """The harness's progress callback ``(done, total, label)`` drawn by tqdm: one bar per phase (a new
    total, or a count that starts again, begins a new bar), the job's name beside it."""

    def __init__(self, tqdm, stream):
        self._tqdm, self._stream, self._bar = tqdm, stream, None

    def __call__(self, done: int, total: int, label: str) -> None:
        if self._bar is None or self._bar.total != total or done < self._bar.n:
            self.close()
            self._bar = self._tqdm(total=total, file=self._stream, unit="job", dynamic_ncols=True)
        self._bar.set_postfix_str(label[:80], refresh=False)
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def progress(args):
    """The progress display of a command: a tqdm bar on stderr where stderr is a terminal and tqdm is
    installed (the ``progress`` extra), else none (--quiet, CI logs, pipes)."""
    if args.quiet or not sys.stderr.isatty():
        return _silent
    try:
        from tqdm import tqdm
    except ImportError:
        return _silent
    return ProgressBar(tqdm, sys.stderr)


_RESULTS = []  # the stream fpemu's own result goes to while stdout_for_results holds stdout


def _results():
    return _RESULTS[-1] if _RESULTS else sys.stdout


def _descriptor(stream):
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # pytest's capsys, a StringIO
        return None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@contextlib.contextmanager
def stdout_for_results():
    """While a command runs, its stdout carries fpemu's result alone (``emit``, ``fail``): whatever else
    writes to it goes to stderr, so ``fpemu ... --json | jq`` reads one JSON document.  That is Python
    code printing, a framework's logger bound to stdout at import (DeepSpeed's 'Setting accelerator to
    CPU'), C code, and the processes fpemu starts or forks (ranks, workers), which inherit descriptor 1."""
    original = sys.stdout
    original.flush()
    sys.stderr.flush()
    saved = os.dup(1) if _is_open(1) and _is_open(2) else None
    results = original
    if saved is not None:
        if _descriptor(original) == 1:  # the result goes where descriptor 1 went before it moved
            results = io.TextIOWrapper(io.FileIO(saved, "w", closefd=False), encoding=original.encoding,
                                       errors=getattr(original, "errors", None), line_buffering=True)
        os.dup2(2, 1)
    _RESULTS.append(results)
    sys.stdout = sys.stderr
    try:
        yield
    finally:
        sys.stdout = original
        _RESULTS.pop()
        results.flush()
        if saved is not None:
            sys.stderr.flush()
            os.dup2(saved, 1)
            os.close(saved)


def emit(args, payload: dict, lines) -> None:
    if args.json:
        print(json.dumps(payload, indent=1, sort_keys=True), file=_results())
    else:
        for line in lines:
            print(line, file=_results())


def written_lines(paths, what: str = "files") -> list:
    """One line per file for a few, else one line per run: 'wrote N files under DIR'."""
    paths = [pathlib.Path(p) for p in paths]
    if len(paths) <= 3:
        return [f"wrote {p}" for p in paths]
    root = pathlib.Path(os.path.commonpath([str(p.parent) for p in paths]))
    return [f"wrote {len(paths)} {what} under {root}"]


def status_counts(verdicts) -> str:
    from fpemu.compare.diff import STATUSES
    counts = [(status, sum(v.status == status for v in verdicts)) for status in STATUSES]
    return ", ".join(f"{count} {status}" for status, count in counts if count) or "none"


def job_line(v) -> str:
    """One result line: status, spec / implementation, and what happened."""
    from fpemu.compare.diff import JOB_FAILURES, SKIPPED
    line = f"{v.status:>16}  {v.spec} / {v.implementation}"
    if v.status in JOB_FAILURES or v.status == SKIPPED:
        if v.packages and v.status != SKIPPED:
            line += " (" + ", ".join(f"{k} {ver}" for k, ver in sorted(v.packages.items())) + ")"
        return line + (f": {v.note}" if v.note else "")
    if v.divergence is not None:
        line += f": first divergence at {v.divergence.describe()}"
    if v.note:
        line += f" [{v.note}]"
    return line


def verdict_lines(verdicts) -> list:
    jobs = len(verdicts)
    return [job_line(v) for v in verdicts] + [f"{jobs} job{'s' * (jobs != 1)}: {status_counts(verdicts)}"]


def failure_code(verdicts) -> int:
    """The exit code the jobs' statuses ask for: 3 for an internal error, 1 for any other failure."""
    from fpemu.compare.diff import STATUSES
    return max((STATUSES[v.status][2] for v in verdicts), default=0)


def note(args, message: str) -> None:
    print(f"fpemu {args.command}: {message}", file=sys.stderr)


def nothing_compared(args, verdicts, noun: str = "compared") -> int:
    """1 (with a message naming each skipped implementation and why) when every job was skipped,
    unless --allow-skips; else 0."""
    from fpemu.compare.diff import SKIPPED
    from fpemu.harness.jobs import skipped_summary
    if not verdicts or any(v.status != SKIPPED for v in verdicts):
        return 0
    message = f"nothing {noun}: every job was skipped: {skipped_summary(verdicts)}"
    if args.allow_skips:
        note(args, f"note: {message} (accepted: --allow-skips)")
        return 0
    note(args, f"error: {message}; pass --allow-skips to accept a run that compares nothing")
    return 1


def fail(args, message: str, code: int = 2) -> int:
    print(f"fpemu {args.command}: error: {message}", file=sys.stderr)
    if args.json:
        print(json.dumps({"error": message, "exit_code": code}), file=_results())
    return code
