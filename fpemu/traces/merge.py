"""A git merge driver for trace files: two branches that each regenerated a golden merge like any text.

Every trace carries one checksum line over all of its content, so two branches that changed different
parts of one golden (a spec's steps on one, its packages on the other) always conflicted on that line.
:func:`merge_traces` merges the three versions without it (``git merge-file``, line by line, as git
would), then seals the result with a fresh checksum once it reads back as a valid trace.  Where the
branches changed the same lines, the file is left with git's conflict markers and no checksum: resolve
it, or regenerate it (``fpemu golden``), as any conflict.

Set up once per clone (docs/golden.md)::

    git config merge.fpemu-trace.driver "fpemu merge-traces %O %A %B"
    echo "tests/golden/*.json merge=fpemu-trace" >> .gitattributes
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import tempfile

from fpemu.fileio import atomic_write, read_bounded
from fpemu.traces.format import TraceError, checksum, loads
from fpemu.traces.schema import READ_LIMITS, bounded_json

# The line dumps() writes first (the keys are sorted, "checksum" leads).
_CHECKSUM_LINE = re.compile(r'^ "checksum": "sha256:[0-9a-f]{64}",\n', re.M)


@dataclasses.dataclass(frozen=True)
class TraceMerge:
    """What :func:`merge_traces` did.

    Attributes:
      conflicts: the places where both sides changed the same lines (0: merged and sealed).
      problem: why a merge without conflicts is still not a trace (then it is left unsealed), or None.
    """

    conflicts: int
    problem: str | None = None

    @property
    def clean(self) -> bool:
        return self.conflicts == 0 and self.problem is None


def _unsealed(path: pathlib.Path) -> str:
    try:
        return _CHECKSUM_LINE.sub("", read_bounded(path, TraceError, READ_LIMITS["bytes"]).decode("utf-8"), count=1)
    except UnicodeDecodeError as error:
        raise TraceError(f"{path}: not a trace file: not UTF-8 text ({error.reason})") from None


def _sealed(text: str, path: pathlib.Path) -> str:
    """``text`` (a trace without its checksum) with a fresh one; TraceError where it is no valid trace (read
    within the reader's bounds: nesting, number lengths, size)."""
    body = bounded_json(text.encode("utf-8"), f"{path} (merged)", TraceError, "a trace: the merged text")
    if not isinstance(body, dict):
        raise TraceError(f"{path}: the merged text is not a trace (a JSON object)")
    body.pop("checksum", None)
    body["checksum"] = checksum(body)
    sealed = json.dumps(body, sort_keys=True, indent=1, allow_nan=False) + "\n"
    loads(sealed, str(path))  # every field checked, as any reader will
    return sealed


def merge_traces(base, ours, theirs) -> TraceMerge:
    """Merge ``theirs`` into ``ours`` against their common ``base``, as git's merge driver ``%O %A %B``.

    The result is written to ``ours`` (whole or not at all): sealed where the merge is clean and the
    result a valid trace, else with conflict markers (or as merged) and no checksum.

    Args:
      base, ours, theirs: paths of the three versions of one trace file.

    Returns:
      A :class:`TraceMerge`: ``clean`` when ``ours`` now holds the merged, sealed trace.

    Example:
      >>> merge = merge_traces("base.json", "ours.json", "theirs.json")  # doctest: +SKIP
      >>> merge.clean
      True
    """
    paths = [pathlib.Path(p) for p in (base, ours, theirs)]
    texts = [_unsealed(p) for p in paths]
    with tempfile.TemporaryDirectory(prefix="fpemu-merge-") as folder:
        files = [pathlib.Path(folder) / name for name in ("base", "ours", "theirs")]
        for file, text in zip(files, texts):
            file.write_text(text, encoding="utf-8")
        done = subprocess.run(["git", "merge-file", "-p", "-L", "ours", "-L", "base", "-L", "theirs",
                               str(files[1]), str(files[0]), str(files[2])], capture_output=True, text=True)
    if done.returncode < 0 or done.returncode > 127:  # git merge-file: the count of conflicts, or an error
        raise OSError(f"git merge-file failed on {paths[1]}: {done.stderr.strip()}")
    if done.returncode:
        atomic_write(paths[1], done.stdout)
        return TraceMerge(done.returncode)
    try:
        atomic_write(paths[1], _sealed(done.stdout, paths[1]))
    except TraceError as error:
        atomic_write(paths[1], done.stdout)
        return TraceMerge(0, str(error))
    return TraceMerge(0)
