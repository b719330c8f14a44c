"""A version matrix: the same specs recorded in one isolated environment per set of package versions.

``fpemu matrix`` answers "which release changed this behaviour?" by recording the specs in
one environment per version set (``jax 0.4.31``, ``jax 0.4.33``, ...) and tabulating the
behaviour of every spec and implementation per version (:mod:`fpemu.reports.upgrades`).

Each version set becomes an environment of :mod:`fpemu.environments` (built once,
cached, fpemu's core dependencies added); the specs are recorded inside it by the ordinary
record path (``python -m fpemu record``, run by that environment's Python with this fpemu on its
path: the checkout, or the installed files of a non-editable install), and a plan's own loop
(``run``) is run by that Python too, so every job keeps its isolation: a framework that does not import, an
argument that was removed, a dtype an old release lacks is one cell saying so.  A set that
pip cannot install is a column of ``cannot install`` cells, never an abort.

Two traces have the same *behaviour* when their step records and summaries agree bit for bit
(:func:`behaviour_digest`); metadata (versions, host) is context.  In a row, behaviours are
lettered A, B, C... in the order they first appear, so a change that flips back shows as
``A B A``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import re
import subprocess
import tempfile
from typing import Optional

from fpemu.compare.diff import CANNOT_RUN, INTERNAL_ERROR, SKIPPED
from fpemu.errors import FpemuInputError
from fpemu.harness.limits import JOB_TIMEOUT
from fpemu.harness.pool import JOB_WORKERS
from fpemu.traces import Trace, read_trace

# Packages ``fpemu matrix`` takes as options (``--jax 0.4.31,0.10.2``), with the companions each
# version pulls in: a jax release runs with the newest jaxlib not newer than itself (old jax
# releases do not depend on jaxlib at all).
PACKAGES = {
    "jax": ("jaxlib<={version}",),
    "flax": (),
    "optax": (),
    "jmp": (),
    "keras": (),
    "torch": (),
    "paddlepaddle": (),
    "megatron-core": (),
    "tf-keras": ("tensorflow=={version}",),
}

RECORDED = "recorded"
CANNOT_INSTALL = "cannot install"
NOT_RUN = "not run"  # a set that ran no job for this row (another spec list, an adapter it lacks)
RECORD_TIMEOUT = 1800.0  # seconds one environment's recording may take
_DEFAULT_ROOT = pathlib.Path.home() / ".cache" / "fpemu" / "matrix"


@dataclasses.dataclass(frozen=True)
class VersionSet:
    """One column of a matrix: the packages to install, with a label for the table.

    Attributes:
      label: the column's name (``jax 0.4.31``).
      requirements: pip requirements (``jax==0.4.31``, ``jaxlib<=0.4.31``); fpemu's core
        dependencies are added when the environment is built.
      environment: instead of requirements, a named environment of
        :data:`fpemu.environments.ENVIRONMENTS` (``paddle``).
    """

    label: str
    requirements: tuple = ()
    environment: Optional[str] = None

    @property
    def slug(self) -> str:
        """A folder name for the set: its label, filesystem-safe, plus a short hash of what it installs."""
        text = re.sub(r"[^A-Za-z0-9_.-]+", "-", self.label).strip("-") or "set"
        digest = hashlib.sha256("\n".join((self.environment or "", *self.requirements)).encode()).hexdigest()
        return f"{text}-{digest[:8]}"


def package_set(package: str, version: str, fixed=()) -> VersionSet:
    """The version set of ``package==version`` with its companions (:data:`PACKAGES`) and ``fixed``.

    Example:
      >>> package_set("jax", "0.4.31").requirements
      ('jax==0.4.31', 'jaxlib<=0.4.31')
    """
    companions = tuple(c.format(version=version) for c in PACKAGES.get(package, ()))
    return VersionSet(f"{package} {version}", (f"{package}=={version}",) + companions + tuple(fixed))


def _split_versions(text: str, where: str) -> list:
    versions = [v.strip() for v in text.split(",") if v.strip()]
    if not versions:
        raise FpemuInputError(f"{where}: expected versions separated by commas (0.4.31,0.10.2), got {text!r}")
    return versions


def product_sets(axes: dict, fixed=()) -> list:
    """One VersionSet per combination of the axes' versions (package -> versions), in order.

    Example:
      >>> [s.label for s in product_sets({"jax": ["0.4.31", "0.10.2"]})]
      ['jax 0.4.31', 'jax 0.10.2']
    """
    sets = []
    for combination in itertools.product(*([(p, v) for v in versions] for p, versions in axes.items())):
        parts = [package_set(p, v) for p, v in combination]
        requirements = tuple(r for part in parts for r in part.requirements) + tuple(fixed)
        sets.append(VersionSet(", ".join(part.label for part in parts), requirements))
    return sets


@dataclasses.dataclass(frozen=True)
class MatrixPlan:
    """What one matrix records: its name (the report section and results file), the specs, the
    implementations (None: each spec's own), the version sets, in column order, and the user's own
    loop to run in each set (``run``)."""

    name: str
    specs: tuple
    sets: tuple
    implementations: Optional[tuple] = None
    description: str = ""
    run: tuple = ()  # a script of the user's own loop and its arguments (absolute script path): see load_plan


def _toml(path: pathlib.Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    from fpemu.fileio import read_text
    try:
        return tomllib.loads(read_text(path, FpemuInputError))
    except tomllib.TOMLDecodeError as error:
        raise FpemuInputError(f"{path}: not valid TOML: {error}") from None


def _strings(value, where: str) -> tuple:
    if not (isinstance(value, list) and all(isinstance(v, str) and v for v in value)):
        raise FpemuInputError(f"{where}: expected a list of strings, got {value!r}")
    return tuple(value)


_PLAN_KEYS = {"name", "description", "specs", "impl", "with", "versions", "set", "run"}
LOOP_TRACES = "FPEMU_TRACE_DIR"  # where a plan's own loop writes its recorded traces (one folder per set)
LOOP_FOLDER = "loop"  # that folder, inside the set's traces folder


def _explicit_set(entry, where: str) -> VersionSet:
    if not isinstance(entry, dict) or not isinstance(entry.get("label"), str):
        raise FpemuInputError(f"{where}: expected a table with label and requirements (or environment)")
    unknown = set(entry) - {"label", "requirements", "environment"}
    if unknown:
        raise FpemuInputError(f"{where}: unknown keys {sorted(unknown)}; expected label, requirements, environment")
    environment = entry.get("environment")
    requirements = _strings(entry.get("requirements", []), f"{where}.requirements")
    if (environment is None) == (not requirements):
        raise FpemuInputError(f"{where}: give either requirements or environment")
    if environment is not None:
        from fpemu.environments import requirements_of
        requirements_of(environment)  # an unknown name is an input error listing the known ones
    return VersionSet(entry["label"], requirements, environment)


def load_plan(path) -> MatrixPlan:
    """A matrix described in TOML (paths in it are relative to the file).

    The file has ``name``, ``specs`` (files or folders), optionally ``description``, ``impl``
    (implementation names) and ``with`` (requirements added to every set), and its columns as
    ``[versions]`` axes (``jax = ["0.4.31", "0.10.2"]``: one set per combination) and/or
    ``[[set]]`` tables (``label`` and ``requirements``, or ``environment``), axes first.

    ``run = ["train.py", "--steps", "8"]`` runs the user's own loop in every set too: the script (relative
    to the plan) is run by the set's Python from the script's folder, with ``$FPEMU_TRACE_DIR`` naming a
    fresh folder where it writes its recorded traces (``write_trace(recorder.trace(), ...)``); each trace
    is a row (its name and implementation).  With ``run``, ``specs`` may be left out.
    """
    path = pathlib.Path(path)
    body = _toml(path)
    unknown = set(body) - _PLAN_KEYS
    if unknown:
        raise FpemuInputError(f"{path}: unknown keys {sorted(unknown)}; expected {sorted(_PLAN_KEYS)}")
    if not isinstance(body.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]+", body["name"]):
        raise FpemuInputError(f"{path}: name: expected a word of letters, digits, _ or - (the report section)")
    run = _strings(body["run"], f"{path}: run") if "run" in body else ()
    if run:
        script = (path.parent / run[0]).resolve()
        if not script.is_file():
            raise FpemuInputError(f"{path}: run: the script {run[0]!r} is not a file (relative to the plan's folder)")
        run = (str(script),) + run[1:]
    specs = tuple(str((path.parent / s).resolve())
                  for s in _strings(body.get("specs", [] if run else None), f"{path}: specs"))
    fixed = _strings(body.get("with", []), f"{path}: with")
    axes = body.get("versions", {})
    if not isinstance(axes, dict):
        raise FpemuInputError(f"{path}: versions: expected a table of package = [versions]")
    sets = product_sets({p: list(_strings(v, f"{path}: versions.{p}")) for p, v in axes.items()}, fixed) if axes else []
    for index, entry in enumerate(body.get("set", [])):
        explicit = _explicit_set(entry, f"{path}: set[{index}]")
        sets.append(dataclasses.replace(explicit, requirements=explicit.requirements + fixed)
                    if explicit.environment is None else explicit)
    impl = body.get("impl")
    return _checked(MatrixPlan(body["name"], specs, tuple(sets),
                               _strings(impl, f"{path}: impl") if impl is not None else None,
                               str(body.get("description", "")), run), str(path))


def _checked(plan: MatrixPlan, where: str) -> MatrixPlan:
    if not plan.sets:
        raise FpemuInputError(f"{where}: no version sets (give [versions] axes or [[set]] tables, or --jax ...)")
    labels = [s.label for s in plan.sets]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise FpemuInputError(f"{where}: the column labels repeat: {', '.join(repeated)}")
    if not plan.specs and not plan.run:
        raise FpemuInputError(f"{where}: nothing to record: give specs, or a run command of your own loop")
    from fpemu.specs import load_specs
    if plan.specs:
        load_specs(plan.specs)  # a broken spec is bad input before anything is installed
    _refuse_idle_sets(plan, where)
    return plan


# Distributions that install others (their pip requirements): a job's package is in a set when the set
# names it or a package here that pulls it in.
PULLS_IN = {"jax": ("jaxlib",), "flax": ("jax", "jaxlib", "optax"), "optax": ("jax", "jaxlib"),
            "deepspeed": ("torch",), "torchao": (), "megatron-core": ("torch",), "tf-keras": ("tensorflow",),
            "transformers": ()}
_ALWAYS = ("numpy", "ml-dtypes")  # fpemu's core dependencies: in every set


def _set_packages(version_set: VersionSet) -> set:
    named = set(_named_packages(version_set)) | set(_ALWAYS)
    return named | {pulled for name in named for pulled in PULLS_IN.get(name, ())}


def _refuse_idle_sets(plan: MatrixPlan, where: str) -> None:
    """A set in which no planned job can run (the packages its adapters drive are not in it: ``--impl jmp``
    with no jmp in the set) is bad input, refused before anything is installed: it would cost a pip
    install and record only skips.  A plan with its own loop (``run``) runs in every set."""
    if plan.run or not plan.specs:
        return
    from fpemu.adapters import ADAPTERS
    jobs = planned_keys(plan)
    if not jobs:
        raise FpemuInputError(f"{where}: the specs and --impl choose no job to run (no implementation drives them)")
    needs = {impl: {_normalise(p) for p in ADAPTERS[impl.split("@")[0]].packages} for _, impl in jobs}
    for version_set in plan.sets:
        present = _set_packages(version_set)
        if any(wanted <= present for wanted in needs.values()):
            continue
        missing = sorted({p for wanted in needs.values() for p in wanted - present})
        raise FpemuInputError(
            f"{where}: set {version_set.label!r} can run none of the jobs ({', '.join(sorted(needs))}): it does not "
            f"install {', '.join(missing)}; add them to every set (--with {' '.join(f'{p}==VERSION' for p in missing)}, "
            "or a plan's with = [...]) or choose other implementations (--impl)")


def plan_from_options(name: str, specs, axes: dict, fixed=(), implementations=None) -> MatrixPlan:
    """The plan of ``fpemu matrix --jax 0.4.31,0.10.2 ...``: axes are package -> "v1,v2" text."""
    parsed = {package: _split_versions(text, f"--{package}") for package, text in axes.items() if text}
    return _checked(MatrixPlan(name, tuple(str(pathlib.Path(s).resolve()) for s in specs),
                               tuple(product_sets(parsed, fixed)), tuple(implementations) if implementations else None),
                    "fpemu matrix")


# --- recording one column ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Cell:
    """One spec and implementation in one version set: a recorded trace, or why there is none.

    Attributes:
      status: ``recorded``, ``cannot install`` (the set did not install), or a job status of
        :data:`fpemu.compare.diff.STATUSES` (``api changed``, ``cannot run``, ``skipped``, ...).
      trace: the recorded trace (``recorded`` only).
      note: what happened, for a cell without a trace.
    """

    status: str
    trace: Optional[Trace] = None
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Column:
    """One version set's results: the versions installed (of the packages the set names and those
    the recorded traces list) and a Cell per (spec, implementation) key; ``problem`` says why a
    whole column has no traces (the set did not install, recording crashed)."""

    version_set: VersionSet
    packages: dict
    cells: dict
    problem: str = ""
    problem_status: str = ""


_HOME = str(pathlib.Path.home())


def host_free(text: str) -> str:
    """``text`` without the paths of this machine: a file under site-packages keeps its package
    path, any other absolute path its last part (messages go into committed reports)."""
    def shorten(match):
        path = match.group(0)
        for marker in ("site-packages/", "dist-packages/"):
            if marker in path:
                return path.rsplit(marker, 1)[1]
        return "…/" + path.rstrip("/").rsplit("/", 1)[-1]
    return re.sub(r"(?<![\w.])/(?:[\w.+@-]+/)+[\w.+@-]*", shorten, text).replace(_HOME, "~")


def _named_packages(version_set: VersionSet) -> list:
    """The distributions a set's requirements name (``jaxlib<=0.4.31`` -> jaxlib), normalised."""
    requirements = version_set.requirements
    if version_set.environment is not None:
        from fpemu.environments import requirements_of
        requirements = requirements_of(version_set.environment)
    names = [re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0] for r in requirements]
    return [_normalise(n) for n in names if n]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed(manifest: dict, wanted) -> dict:
    by_name = {_normalise(k): (k, v) for k, v in (manifest or {}).get("packages", {}).items()}
    return dict(by_name[n] for n in wanted if n in by_name)


def build_column_environment(version_set: VersionSet):
    """Build (or find) the set's environment: (its Python, its manifest)."""
    from fpemu import environments
    if version_set.environment is not None:
        environments.build_environment(version_set.environment)
        return environments.environment_python(version_set.environment), \
            environments.environment_manifest(version_set.environment)
    name = f"matrix-{version_set.slug}"
    environments.build_environment(name, requirements=version_set.requirements)
    return (environments.environment_python(name, version_set.requirements),
            environments.environment_manifest(name, version_set.requirements))


def _record_command(python, plan: MatrixPlan, out: pathlib.Path) -> list:
    """``fpemu record`` of the plan's specs, each job under the command's --timeout (fpemu.harness.limits):
    a job past it is its cell, ``cannot run: timed out after N s (--timeout)``; on the command's --jobs
    worker processes (fpemu.harness.pool)."""
    command = [str(python), "-m", "fpemu", "record", *plan.specs, "--out", str(out), "--allow-skips", "--json",
               "--quiet"]
    timeout = JOB_TIMEOUT.get()
    return (command + (["--impl", *plan.implementations] if plan.implementations else [])
            + (["--timeout", repr(float(timeout))] if timeout is not None else [])
            + ["--jobs", str(JOB_WORKERS.get())])


def _set_env() -> dict:
    """The environment of a process run by a set's Python: isolated, this fpemu first on its path, and
    marked as a version set's (adapters that use an isolated environment elsewhere, paddle and tf_keras,
    run in this one: the set's own packages are the ones to drive)."""
    from fpemu.environments import isolated_env, fpemu_source
    from fpemu.adapters import IN_VERSION_SET
    return {**isolated_env(), "PYTHONPATH": str(fpemu_source()), IN_VERSION_SET: "1"}


def _run_record(python, plan: MatrixPlan, out: pathlib.Path) -> dict:
    """``fpemu record`` in the environment of ``python``, this fpemu first on its path; its JSON result, or
    {"crash": why} when it gave none."""
    with tempfile.TemporaryDirectory(prefix="fpemu-matrix-") as cwd:  # the checkout must not shadow anything
        try:
            done = subprocess.run(_record_command(python, plan, out), capture_output=True, text=True,
                                  env=_set_env(), cwd=cwd, timeout=RECORD_TIMEOUT)
        except subprocess.TimeoutExpired:
            return {"crash": f"recording ran past {RECORD_TIMEOUT:.0f} s"}
    result = _last_json(done.stdout)
    if not isinstance(result, dict) or "written" not in result:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        return {"crash": f"fpemu record exited {done.returncode}: {tail}"}
    return result


def _run_loop(python, plan: MatrixPlan, out: pathlib.Path) -> str:
    """Run the plan's own loop with the set's Python (from the script's folder), its traces going to a fresh
    ``out``; '' when it exited 0, else why it failed (its last stderr line)."""
    import shutil
    shutil.rmtree(out, ignore_errors=True)  # a trace left by an earlier run must not pass for this one's
    out.mkdir(parents=True)
    script = pathlib.Path(plan.run[0])
    limit = JOB_TIMEOUT.get()  # the loop is the set's one job of its own: --timeout bounds it too
    try:
        done = subprocess.run([str(python), *plan.run], capture_output=True, text=True, cwd=script.parent,
                              env={**_set_env(), LOOP_TRACES: str(out)}, timeout=limit or RECORD_TIMEOUT)
    except subprocess.TimeoutExpired:
        return (f"{script.name} timed out after {limit:g} s (--timeout)" if limit
                else f"{script.name} ran past {RECORD_TIMEOUT:.0f} s")
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [""])[-1]
        return f"{script.name} exited {done.returncode}: {tail}"
    return "" if any(out.glob("*.json")) else f"{script.name} wrote no trace into ${LOOP_TRACES}"


def _last_json(text: str):
    """The JSON object ``fpemu record --json`` printed last: a framework may print to stdout too (Paddle
    does), so the object is read from its first line, ``{``, on; None without one."""
    lines = text.splitlines()
    for start in reversed([i for i, line in enumerate(lines) if line == "{"]):
        try:
            return json.loads("\n".join(lines[start:]))
        except ValueError:
            continue
    return None


def record_column(plan: MatrixPlan, version_set: VersionSet, traces_root: pathlib.Path) -> Column:
    """Build the set's environment and record the plan's specs in it (traces under ``traces_root``).

    Never raises for what happens inside the set: an install that fails is a column of
    ``cannot install`` cells, a recording that crashes a column of ``internal error`` cells.
    """
    from fpemu.environments import EnvironmentBuildError
    try:
        python, manifest = build_column_environment(version_set)
    except EnvironmentBuildError as error:
        return Column(version_set, {}, {}, host_free(_last_lines(str(error))), CANNOT_INSTALL)
    out = traces_root / version_set.slug
    result = _run_record(python, plan, out) if plan.specs else {"unrecorded": []}
    packages = _installed(manifest, _named_packages(version_set))
    if "crash" in result:
        return Column(version_set, packages, {}, host_free(result["crash"]), INTERNAL_ERROR)
    loop_failed = _run_loop(python, plan, out / LOOP_FOLDER) if plan.run else ""
    column = read_column(version_set, out, result.get("unrecorded", []), packages)
    if loop_failed and not column.cells:
        return Column(version_set, packages, {}, host_free(loop_failed), CANNOT_RUN)
    return column


def _last_lines(text: str, count: int = 2) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return " / ".join(lines[:1] + lines[-count:]) if len(lines) > count + 1 else " / ".join(lines)


def read_column(version_set: VersionSet, folder, unrecorded=(), packages=None) -> Column:
    """A Column from a folder of recorded traces and the verdicts of the jobs that recorded none
    (``fpemu record --json``'s ``unrecorded``).  The traces' own package versions (those the set
    names, when ``packages`` is None) label the column."""
    cells = {}
    folder = pathlib.Path(folder)
    for path in sorted(folder.glob("*.json")) + sorted((folder / LOOP_FOLDER).glob("*.json")):
        trace = read_trace(path)
        cells[(trace.spec_name, trace.implementation)] = Cell(RECORDED, trace)
    for verdict in unrecorded:
        note = verdict.get("note", "")
        cells[(verdict["spec"], verdict["implementation"])] = Cell(verdict["status"], None, host_free(note))
    if packages is None:
        wanted = set(_named_packages(version_set))
        packages = {}
        for cell in cells.values():
            if cell.trace is not None:
                packages.update({k: v for k, v in cell.trace.metadata.get("packages", {}).items()
                                 if _normalise(k) in wanted})
    return Column(version_set, dict(sorted(packages.items())), cells)


# --- behaviour, row by row ----------------------------------------------------------

def behaviour_digest(trace: Trace) -> str:
    """A short hash of what a trace says happened (its steps and summary, not its metadata)."""
    body = json.dumps({"steps": trace.steps, "summary": trace.summary}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def cell_key(cell: Cell) -> str:
    """What decides whether two cells behave alike: the behaviour digest of a trace, else the status
    and note with version numbers and line numbers left out (the same refusal in two releases, which
    a failed job's note names with the release's version, is the same behaviour)."""
    if cell.trace is not None:
        return behaviour_digest(cell.trace)
    note = re.sub(r"(?<![\w.])\d+(?:\.\d+)+[\w.+-]*", "<version>", cell.note)
    return f"{cell.status}: {re.sub(r':[0-9]+[)]', ')', note)}"


def column_cell(column: Column, key) -> Cell:
    """The column's cell for (spec, implementation), or one saying why the column has none."""
    if key in column.cells:
        return column.cells[key]
    if column.problem:
        return Cell(column.problem_status, None, column.problem)
    return Cell(NOT_RUN, None, "this set did not run this job (the spec or implementation is not in it)")


def row_keys(columns, planned=()) -> list:
    """Every (spec, implementation) any column has or the plan runs (``planned``), sorted."""
    return sorted({key for column in columns for key in column.cells} | set(planned))


def planned_keys(plan: MatrixPlan) -> list:
    """The (spec, implementation) jobs the plan runs in every set, as ``fpemu record`` chooses them."""
    from fpemu.harness.jobs import implementations_for
    from fpemu.specs import load_specs
    if not plan.specs:
        return []
    return [(scenario.name, impl.key) for scenario in load_specs(plan.specs)
            for impl in implementations_for(scenario, list(plan.implementations or ()) or None)]


# Cells that say nothing about the release's behaviour: a change point is looked for across them.
UNKNOWN = (CANNOT_INSTALL, SKIPPED, NOT_RUN, INTERNAL_ERROR)
RESULTS_FORMAT = "fpemu-matrix"


def _model_verdict(reference: Optional[Trace], cell: Cell) -> Optional[str]:
    """``match`` or ``diverged`` of the cell's trace against fpemu's reference model, None without one."""
    from fpemu.compare import compare_traces
    from fpemu.kinds import explain
    if reference is None or cell.trace is None:
        return None
    try:
        return compare_traces(reference, cell.trace, explain=explain).status
    except FpemuInputError:  # the trace records no field the reference has
        return None


def change_between(before: Cell, after: Cell) -> str:
    """One line saying how ``after`` differs from ``before`` (two cells of one row that behave differently):
    the verdict of :func:`fpemu.compare.trace_changes` for two traces, else the two statuses."""
    from fpemu.compare import trace_changes
    from fpemu.kinds import explain
    if before.trace is not None and after.trace is not None:
        impact = trace_changes(before.trace, after.trace, explain)
        verdict, context = impact.verdict(), impact.context()
        return verdict[: -len(f" [{context}]")] if context else verdict  # the columns name the versions
    return f"{before.status} -> {after.status}" + (f": {after.note or before.note}" if after.note or before.note else "")


def row_results(cells: list, labels: list, reference: Optional[Trace]) -> list:
    """The cells of one row as the results file holds them: each cell's behaviour letter (A, B, ... in
    order of first appearance; a status for a cell without a trace), whether it matches fpemu's model,
    and, where the behaviour differs from the last column that has one, what changed and, when it
    returns to a behaviour seen before, the first column that had it."""
    letters, first_seen, out, last = {}, {}, [], None
    for label, cell in zip(labels, cells):
        key = cell_key(cell)
        if cell.trace is not None and key not in letters:
            letters[key] = chr(ord("A") + len(letters)) if len(letters) < 26 else f"#{len(letters) + 1}"
        behaviour = letters.get(key, cell.status)
        entry = {"behaviour": behaviour, "status": cell.status, "note": cell.note,
                 "digest": behaviour_digest(cell.trace) if cell.trace is not None else None,
                 "model": _model_verdict(reference, cell), "change": None, "returns_to": None}
        if cell.status not in UNKNOWN:
            if last is not None and cell_key(last[1]) != key:
                entry["change"] = change_between(last[1], cell)
                entry["returns_to"] = first_seen.get(key)
            first_seen.setdefault(key, label)
            last = (label, cell)
        out.append(entry)
    return out


def matrix_results(name: str, columns, references: dict, description: str = "", planned=(), **extra) -> dict:
    """The results file of a matrix (written by :func:`fpemu.reports.upgrades.write_results`): its
    columns (labels, requirements, the versions installed), and one row per (spec, implementation)
    with :func:`row_results`'s cells.  Nothing of the host: notes are :func:`host_free`.

    Args:
      references: spec name -> fpemu's reference trace of that spec (for the model column).
      planned: the jobs the plan runs (:func:`planned_keys`): a row each even where no set recorded it.
      extra: more top-level entries (``bisect``: what a bisection tested).
    """
    import sys
    labels = [column.version_set.label for column in columns]
    rows = []
    for spec, implementation in row_keys(columns, planned):
        cells = [column_cell(column, (spec, implementation)) for column in columns]
        rows.append({"spec": spec, "implementation": implementation,
                     "cells": row_results(cells, labels, references.get(spec))})
    return {"format": RESULTS_FORMAT, "name": name, "description": description,
            "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "columns": [{"label": column.version_set.label, "requirements": list(column.version_set.requirements),
                         "environment": column.version_set.environment, "packages": column.packages,
                         "problem": column.problem, "problem_status": column.problem_status}
                        for column in columns],
            "rows": rows, **extra}


def reference_traces(spec_paths) -> dict:
    """spec name -> fpemu's reference trace of it (computed here: the core alone, no framework)."""
    from fpemu.kinds import reference_trace
    from fpemu.specs import load_specs
    return {scenario.name: reference_trace(scenario) for scenario in load_specs(spec_paths)} if spec_paths else {}


def default_traces_root(name: str) -> pathlib.Path:
    """Where a matrix keeps its recorded traces (they hold the host, so they stay out of reports/)."""
    return pathlib.Path(os.environ.get("FPEMU_MATRIX_DIR") or _DEFAULT_ROOT) / name


def run_matrix(plan: MatrixPlan, traces_root=None, progress=lambda done, total, label: None) -> dict:
    """Record ``plan`` in one environment per version set and return its results (:func:`matrix_results`).

    Environments are built once and cached (``fpemu env``'s cache); each set's traces are written
    under ``traces_root`` (default :func:`default_traces_root`), one folder per set.
    """
    return plan_results(plan, record_columns(plan, plan.sets, traces_root, progress))


def record_columns(plan: MatrixPlan, sets, traces_root=None, progress=lambda done, total, label: None) -> list:
    """The Column of each of ``sets`` (a plan's, or a shard's of them: fpemu.harness.shards), in order."""
    root = pathlib.Path(traces_root) if traces_root is not None else default_traces_root(plan.name)
    columns = []
    for index, version_set in enumerate(sets, 1):
        progress(index - 1, len(sets), f"{version_set.label}: installing and recording")
        columns.append(record_column(plan, version_set, root))
        progress(index, len(sets), version_set.label)
    return columns


def plan_results(plan: MatrixPlan, columns) -> dict:
    """The results of ``plan`` from its columns (recorded here, or merged from shards)."""
    return matrix_results(plan.name, columns, reference_traces(plan.specs), plan.description, planned_keys(plan))
