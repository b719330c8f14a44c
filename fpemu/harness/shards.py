"""Shards: one ``fpemu run`` split into N runs (``--shard I/N``) whose partial results merge into the reports
one run writes, byte for byte (``fpemu merge``).

The unit of a shard is a spec: its golden trace, its jobs (spec x implementation) and, for a [ranks] spec,
its cases all run in the shard that takes the spec, so a shard never needs another shard's golden.  Which
shard takes a spec (:func:`assign`) depends on the spec names and N only: the names are ordered by a hash
of each (so a family of similar specs, say every JAX one, is spread over the shards instead of landing in
one) and cut into N contiguous runs of equal length (the shards' spec counts differ by one at most).
Adding or removing a spec moves at most one other spec across each of the N - 1 cuts; every other spec
stays in its shard.

A shard writes what belongs to its own jobs under ``REPORTS/shards/I-of-N/``: the golden and observed
traces (the per-job files, as the run writes them) and ``shard.json`` (its verdicts, in run order, and
what it was run on: the spec set, the options, fpemu's version).  Whatever belongs to the whole run
(``diff.json``, the reports, the plots, the removal of stale traces) is written once, by the merge.  A
merge of shards that do not fit together (one missing, two of different N, another spec set, options or
fpemu version) is refused, naming the file.

Where the shard index comes from (:func:`requested_shard`): ``--shard I/N``; else ``$FPEMU_SHARD``
(``I/N``); ``slurm`` (either place) reads a SLURM job array's ``SLURM_ARRAY_TASK_ID`` and
``SLURM_ARRAY_TASK_COUNT`` (with ``SLURM_ARRAY_TASK_MIN`` and ``_STEP``: ``--array=0-3`` and
``--array=1-4`` are both shards 1/4 to 4/4).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import re
from typing import Optional

from fpemu.errors import FpemuInputError
from fpemu.fileio import atomic_write
from fpemu.version import __version__

SHARD_ENV = "FPEMU_SHARD"
SLURM = "slurm"
FOLDER = "shards"  # REPORTS/shards/I-of-N/: one shard's partial results
MANIFEST = "shard.json"
FORMAT = "fpemu-shard"
SLURM_VARIABLES = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT")


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (1-based: 1/2 and 2/2)."""

    index: int
    count: int

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def folder(self) -> str:
        """Its folder under REPORTS/shards/ (``1-of-2``)."""
        return f"{self.index}-of-{self.count}"


def parse_shard(text: str, option: str = "--shard") -> Shard:
    """``"2/4"`` -> Shard(2, 4); anything else is an FpemuInputError naming ``option``.

    Example:
      >>> parse_shard("2/4")
      Shard(index=2, count=4)
    """
    found = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not found or not 1 <= int(found[1]) <= int(found[2]):
        raise FpemuInputError(f"{option} {text}: expected I/N with 1 <= I <= N (shard I of N, e.g. --shard 1/4)")
    return Shard(int(found[1]), int(found[2]))


def slurm_shard(environ=None) -> Shard:
    """The shard of this task of a SLURM job array (``sbatch --array=0-3`` or ``1-4``: shards 1/4 to 4/4)."""
    env = os.environ if environ is None else environ
    missing = [name for name in SLURM_VARIABLES if not env.get(name)]
    if missing:
        raise FpemuInputError(f"--shard {SLURM}: ${' and $'.join(missing)} not set (run it as a task of "
                              "`sbatch --array=...`, or give --shard I/N)")
    try:
        task, count = int(env["SLURM_ARRAY_TASK_ID"]), int(env["SLURM_ARRAY_TASK_COUNT"])
        low, step = int(env.get("SLURM_ARRAY_TASK_MIN", "0")), int(env.get("SLURM_ARRAY_TASK_STEP", "1"))
    except ValueError:
        raise FpemuInputError(f"--shard {SLURM}: the SLURM_ARRAY_TASK_* variables are not integers: "
                              + ", ".join(f"{k}={env.get(k)!r}" for k in sorted(env) if k.startswith("SLURM_ARRAY_TASK"))
                              ) from None
    index = (task - low) // max(step, 1) + 1
    return parse_shard(f"{index}/{count}", f"--shard {SLURM} (SLURM_ARRAY_TASK_ID {task} of an array of {count} "
                                           f"from {low} by {step}):")


def requested_shard(option: Optional[str], environ=None) -> Optional[Shard]:
    """The shard a command runs: ``option`` (``--shard``), else ``$FPEMU_SHARD``; None: the whole run."""
    env = os.environ if environ is None else environ
    text, where = (option, "--shard") if option is not None else (env.get(SHARD_ENV), f"${SHARD_ENV}=")
    if not text:
        return None
    if text.strip().lower() == SLURM:
        return slurm_shard(env)
    return parse_shard(text, where)


def _order_key(name: str) -> tuple:
    return hashlib.sha256(name.encode("utf-8")).hexdigest(), name


def assign(names, count: int) -> dict:
    """name -> the shard (1..count) that takes it: the names in hash order, cut into ``count`` equal runs.

    Example:
      >>> shards = assign([f"spec{i}" for i in range(10)], 3)
      >>> sorted(list(shards.values()).count(i) for i in (1, 2, 3))
      [3, 3, 4]
    """
    order = sorted(dict.fromkeys(names), key=_order_key)
    return {name: position * count // len(order) + 1 for position, name in enumerate(order)}


def shard_names(names, shard: Shard) -> frozenset:
    """The names ``shard`` takes."""
    return frozenset(name for name, index in assign(names, shard.count).items() if index == shard.index)


def select(items, shard: Optional[Shard], name=lambda item: item):
    """The items (in order) that ``shard`` takes, by their names (None: all)."""
    items = list(items)
    if shard is None:
        return items
    taken = shard_names([name(item) for item in items], shard)
    return [item for item in items if name(item) in taken]


# --- a shard's partial results --------------------------------------------------------

def spec_set(scenarios) -> list:
    """[name, sha256] of every spec, in run order: what a shard was run on."""
    return [[scenario.name, scenario.sha256] for scenario in scenarios]


def write_partial(folder, shard: Shard, scenarios, options: dict, files, verdicts) -> pathlib.Path:
    """Write ``folder/shard.json``: the shard's verdicts and what it ran on.

    Args:
      files: the paths the shard wrote under ``folder`` (its traces; those not there are left out).
      verdicts: (owner spec name, part, Verdict) in run order; part is ``diff`` or ``ranks``.
    """
    folder = pathlib.Path(folder)
    body = {"format": FORMAT, "fpemu": __version__, "shard": str(shard), "specs": spec_set(scenarios),
            "names": sorted(shard_names([s.name for s in scenarios], shard)), "options": options,
            "files": sorted(pathlib.Path(p).relative_to(folder).as_posix() for p in files if pathlib.Path(p).is_file()),
            "verdicts": [{"owner": owner, "part": part, "verdict": verdict.as_dict()}
                         for owner, part, verdict in verdicts]}
    return atomic_write(folder / MANIFEST, json.dumps(body, indent=1, sort_keys=True) + "\n")


@dataclasses.dataclass(frozen=True)
class Partial:
    """One shard's partial results, as read back: its manifest's path and body."""

    path: pathlib.Path
    shard: Shard
    body: dict

    @property
    def folder(self) -> pathlib.Path:
        return self.path.parent


def find_partials(paths, reports) -> list:
    """The shard.json files to merge: those of ``paths`` (a shard's folder or file, or a folder of shard
    folders), else every ``REPORTS/shards/*/shard.json``."""
    found = []
    for path in [pathlib.Path(p) for p in paths] or [pathlib.Path(reports) / FOLDER]:
        if path.is_file():
            found.append(path)
        elif (path / MANIFEST).is_file():
            found.append(path / MANIFEST)
        elif path.is_dir() and sorted(path.glob(f"*/{MANIFEST}")):
            found += sorted(path.glob(f"*/{MANIFEST}"))
        else:
            raise FpemuInputError(f"{path}: no shard's partial results ({MANIFEST}) there; `fpemu run --shard I/N "
                                  f"--reports R` writes them into R/{FOLDER}/I-of-N/")
    return list(dict.fromkeys(found))


def _read_partial(path: pathlib.Path) -> Partial:
    from fpemu.fileio import read_text
    try:
        body = json.loads(read_text(path, FpemuInputError))
    except ValueError:
        body = None
    keys = {"format", "fpemu", "shard", "specs", "names", "options", "files", "verdicts"}
    if not isinstance(body, dict) or body.get("format") != FORMAT or not keys <= set(body):
        raise FpemuInputError(f"{path}: not a shard's partial results (expected the {MANIFEST} that "
                              "`fpemu run --shard I/N` writes)")
    if body["fpemu"] != __version__:
        raise FpemuInputError(f"{path}: written by fpemu {body['fpemu']}, this is fpemu {__version__}; run every "
                              "shard and the merge with one fpemu")
    return Partial(path, parse_shard(str(body["shard"]), f"{path}: shard"), body)


def _spec_difference(these: list, those: list) -> str:
    mine, theirs = dict(map(tuple, these)), dict(map(tuple, those))
    parts = [f"{label} {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}" for label, names in (
        ("only here:", sorted(set(mine) - set(theirs))), ("only there:", sorted(set(theirs) - set(mine))),
        ("changed:", sorted(n for n in set(mine) & set(theirs) if mine[n] != theirs[n]))) if names]
    return "; ".join(parts) or "the same specs in another order"


def read_partials(paths, scenarios) -> list:
    """The shards' partial results, one per shard 1..N in order, checked to fit together (one split, the
    same options) and to have been run on ``scenarios`` (the specs now); anything else is an FpemuInputError
    naming the file."""
    partials = [_read_partial(path) for path in paths]
    first = partials[0]
    options = first.body["options"]
    now = spec_set(scenarios)
    by_index = {}
    for partial in partials:
        if partial.shard.count != first.shard.count:
            raise FpemuInputError(f"{partial.path}: shard {partial.shard} is of another split than {first.path} "
                                  f"(shard {first.shard}): merge the N shards of one split")
        if partial.shard.index in by_index:
            raise FpemuInputError(f"{partial.path}: shard {partial.shard} is given twice (also "
                                  f"{by_index[partial.shard.index].path})")
        by_index[partial.shard.index] = partial
        if partial.body["specs"] != now:
            raise FpemuInputError(f"{partial.path}: shard {partial.shard} ran another spec set than the specs now "
                                  f"({_spec_difference(now, partial.body['specs'])}); rerun it")
        if partial.body["options"] != options:
            differ = sorted(k for k in set(options) | set(partial.body["options"])
                            if options.get(k) != partial.body["options"].get(k))
            shown = ", ".join(f"{k} {partial.body['options'].get(k)} vs {options.get(k)}" for k in differ)
            raise FpemuInputError(f"{partial.path}: shard {partial.shard} ran with other options than {first.path} "
                                  f"({shown}): run every shard with the same --impl, --exclude and --rank-timeout")
        expected = sorted(shard_names([s.name for s in scenarios], partial.shard))
        if partial.body["names"] != expected:
            raise FpemuInputError(f"{partial.path}: holds other specs than shard {partial.shard} takes")
        for relative in partial.body["files"]:
            if not (partial.folder / relative).is_file():
                raise FpemuInputError(f"{partial.path}: lists {relative}, which is not in {partial.folder}")
    missing = [f"{index}/{first.shard.count}" for index in range(1, first.shard.count + 1) if index not in by_index]
    if missing:
        found = ", ".join(f"{p.shard} ({p.path})" for p in sorted(partials, key=lambda p: p.shard.index))
        raise FpemuInputError(f"shard {', '.join(missing)} missing: the merge was given {found}; run "
                              + " and ".join(f"`fpemu run --shard {m}`" for m in missing) + " first")
    return [by_index[index] for index in sorted(by_index)]


@dataclasses.dataclass(frozen=True)
class StoredDivergence:
    """A first divergence as a shard's verdict holds it (its message)."""

    body: dict

    def describe(self, expected: str = "expected", got: str = "got") -> str:
        return self.body.get("message", "")


@dataclasses.dataclass(frozen=True)
class StoredVerdict:
    """A Verdict read back from a shard (what the reports and the result lines use of it)."""

    body: dict

    def __getattr__(self, name):
        if name in ("spec", "implementation", "status", "note", "steps_compared", "max_ulp", "packages"):
            return self.body.get(name)
        raise AttributeError(name)

    @property
    def divergence(self):
        return StoredDivergence(self.body["divergence"]) if self.body.get("divergence") else None

    @property
    def failed(self) -> bool:
        from fpemu.compare.diff import STATUSES
        return STATUSES[self.status][1]

    def as_dict(self) -> dict:
        return json.loads(json.dumps(self.body))


def merged_verdicts(partials, scenarios) -> tuple:
    """(the diff jobs' verdicts, the [ranks] cases' verdicts), each in the order one run gives them."""
    position = {scenario.name: index for index, scenario in enumerate(scenarios)}
    entries = [entry for partial in partials for entry in partial.body["verdicts"]]
    ordered = sorted(entries, key=lambda entry: position[entry["owner"]])  # stable: a spec's jobs keep their order
    return ([StoredVerdict(e["verdict"]) for e in ordered if e["part"] == "diff"],
            [(e["owner"], StoredVerdict(e["verdict"])) for e in ordered if e["part"] == "ranks"])


def merge_files(partials, reports) -> set:
    """Copy every shard's traces into ``reports`` (the same relative paths); returns the paths written."""
    written = {}
    for partial in partials:
        for relative in partial.body["files"]:
            target = pathlib.Path(reports) / relative
            if target in written:
                raise FpemuInputError(f"{partial.path}: {relative} is also written by {written[target]}")
            atomic_write(target, (partial.folder / relative).read_bytes(), "wb")
            written[target] = partial.path
    return set(written)


def ranks_outcomes(scenarios, ranks_verdicts, golden_dir, observed_dir) -> list:
    """The [ranks] cases' outcomes (fpemu.harness.ranks.CaseOutcome) rebuilt from the merged traces and
    verdicts, for the ranks report: the spec's case, the model's prediction, each rank's traces."""
    from fpemu.harness.ranks import CaseOutcome
    from fpemu.ranks import predict
    from fpemu.traces import read_trace, trace_filename
    from fpemu.traces.layout import REFERENCE
    by_name = {scenario.name: scenario for scenario in scenarios}
    outcomes = []
    for owner, verdict in ranks_verdicts:
        scenario = by_name[owner]
        name, case, declared = next(entry for entry in scenario.cases() if entry[0] == verdict.spec)

        def traces(folder, implementation):
            paths = [pathlib.Path(folder) / trace_filename(f"{name}.rank{rank}", implementation)
                     for rank in range(case.world_size)]
            return tuple(read_trace(p) for p in itertools.takewhile(pathlib.Path.is_file, paths))
        outcomes.append(CaseOutcome(name, scenario, case, declared, verdict.implementation, predict(case),
                                    traces(golden_dir, REFERENCE), traces(observed_dir, verdict.implementation),
                                    verdict, None, 0.0))
    return outcomes


def remove_stale(folders, fresh) -> list:
    """Remove the traces (``*.json``) in ``folders`` that are not ``fresh``; returns those removed."""
    removed = []
    for folder in map(pathlib.Path, folders):
        for stale in sorted(set(folder.glob("*.json")) - set(fresh)) if folder.is_dir() else ():
            stale.unlink()
            removed.append(stale)
    return removed


# --- a version matrix in shards: each shard records some of the plan's sets -----------------

MATRIX_FORMAT = "fpemu-matrix-shard"


def matrix_partials_root(traces_root) -> pathlib.Path:
    """Where the shards of a matrix keep their partial results: beside its traces (they hold the host, so
    they stay out of reports/): ``TRACES/shards/I-of-N/``."""
    return pathlib.Path(traces_root) / FOLDER


def _plan_identity(plan) -> dict:
    """What a matrix shard was run on: the plan's name, sets and implementations, its specs (names and
    sha256: their paths may differ between machines) and its own loop's script (name and sha256)."""
    from fpemu.specs import load_specs
    script = pathlib.Path(plan.run[0]) if plan.run else None
    return {"name": plan.name, "description": plan.description,
            "sets": [[s.label, list(s.requirements), s.environment] for s in plan.sets],
            "implementations": list(plan.implementations) if plan.implementations is not None else None,
            "specs": spec_set(load_specs(plan.specs)) if plan.specs else [],
            "run": ([script.name, hashlib.sha256(script.read_bytes()).hexdigest(), *plan.run[1:]] if script else [])}


def matrix_shard_sets(plan, shard: Shard) -> list:
    """The version sets (in plan order) that ``shard`` records: by their labels, as :func:`assign` cuts."""
    return select(plan.sets, shard, lambda version_set: version_set.label)


def write_matrix_partial(traces_root, plan, shard: Shard, columns) -> pathlib.Path:
    """Write a matrix shard's partial results: each of its columns' traces (copied from the set's folder under
    ``traces_root``), and ``shard.json`` (the columns' versions, problems and cells without a trace)."""
    import shutil
    from fpemu.harness.matrix import LOOP_FOLDER
    folder = matrix_partials_root(traces_root) / shard.folder
    shutil.rmtree(folder, ignore_errors=True)  # what an earlier run of this shard left must not be merged
    entries = []
    for column in columns:
        slug = column.version_set.slug
        if not column.problem:
            source = pathlib.Path(traces_root) / slug
            for path in sorted(source.glob("*.json")) + sorted((source / LOOP_FOLDER).glob("*.json")):
                atomic_write(folder / slug / path.relative_to(source), path.read_bytes(), "wb")
        entries.append({"label": column.version_set.label, "slug": slug, "packages": list(column.packages.items()),
                        "problem": column.problem, "problem_status": column.problem_status,
                        "cells": [[spec, implementation, cell.status, cell.note]
                                  for (spec, implementation), cell in column.cells.items() if cell.trace is None]})
    body = {"format": MATRIX_FORMAT, "fpemu": __version__, "shard": str(shard), "plan": _plan_identity(plan),
            "columns": entries}
    return atomic_write(folder / MANIFEST, json.dumps(body, indent=1, sort_keys=True) + "\n")


def merge_matrix(traces_root, plan) -> list:
    """The plan's Columns, in plan order, from its shards' partial results under ``traces_root``; shards that do
    not fit (one missing, another N, plan or fpemu version) are an FpemuInputError naming the file."""
    from fpemu.harness.matrix import Cell, Column, read_column
    root = matrix_partials_root(traces_root)
    paths = sorted(root.glob(f"*/{MANIFEST}"))
    if not paths:
        raise FpemuInputError(f"{root}: no shard's partial results of matrix {plan.name!r}; run `fpemu matrix ... "
                              "--shard I/N` (with the same --traces) for every I first")
    identity, by_index, count = _plan_identity(plan), {}, None
    for path in paths:
        from fpemu.fileio import read_text
        try:
            body = json.loads(read_text(path, FpemuInputError))
        except ValueError:
            body = None
        if not isinstance(body, dict) or body.get("format") != MATRIX_FORMAT:
            raise FpemuInputError(f"{path}: not a matrix shard's partial results (expected the {MANIFEST} that "
                                  "`fpemu matrix --shard I/N` writes)")
        if body.get("fpemu") != __version__:
            raise FpemuInputError(f"{path}: written by fpemu {body.get('fpemu')}, this is fpemu {__version__}; run "
                                  "every shard and the merge with one fpemu")
        shard = parse_shard(str(body.get("shard")), f"{path}: shard")
        if count is not None and shard.count != count[0]:
            raise FpemuInputError(f"{path}: shard {shard} is of another split than {count[1]} (of {count[0]} "
                                  "shards): merge the N shards of one split")
        count = count or (shard.count, path)
        if body.get("plan") != identity:
            differ = sorted(k for k in identity if identity[k] != (body.get("plan") or {}).get(k))
            raise FpemuInputError(f"{path}: shard {shard} ran another plan than {plan.name!r} is now (its "
                                  f"{', '.join(differ)} differ); rerun it")
        if [c["label"] for c in body["columns"]] != [s.label for s in matrix_shard_sets(plan, shard)]:
            raise FpemuInputError(f"{path}: holds other sets than shard {shard} records")
        by_index[shard.index] = (path, body)
    missing = [f"{i}/{count[0]}" for i in range(1, count[0] + 1) if i not in by_index]
    if missing:
        raise FpemuInputError(f"shard {', '.join(missing)} of matrix {plan.name!r} missing from {root} (found "
                              + ", ".join(f"{i}/{count[0]}" for i in sorted(by_index)) + "); run `fpemu matrix ... "
                              + " and ".join(f"--shard {m}" for m in missing) + "` first")
    held = {}
    for path, body in by_index.values():
        for entry in body["columns"]:
            held[entry["label"]] = (path.parent, entry)
    columns = []
    for version_set in plan.sets:
        folder, entry = held[version_set.label]
        packages = dict(entry["packages"])  # pairs: in the column's order (the manifest sorts a dict's keys)
        if entry["problem"]:
            columns.append(Column(version_set, packages, {}, entry["problem"], entry["problem_status"]))
            continue
        column = read_column(version_set, folder / entry["slug"], (), packages)
        cells = {**column.cells, **{(spec, impl): Cell(status, None, note) for spec, impl, status, note in entry["cells"]}}
        columns.append(Column(version_set, column.packages, cells))
    return columns
