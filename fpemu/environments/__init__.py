"""Isolated environments: packages whose dependencies conflict with the project's run in a venv of their own.

Paddle needs numpy < 2.4 and TensorFlow downgrades h5py, so instead of changing the
project's environment the harness builds one venv per named requirement set
(:data:`ENVIRONMENTS`) and calls functions inside it.  A build creates the venv in a
temporary folder next to its final place, installs the requirements together with
fpemu's core dependencies (``numpy``, ``ml_dtypes``: the pins in the requirements
win), installs this checkout of fpemu without dependencies (an installed, non-editable
fpemu is imported from its own installed files instead), checks that fpemu imports
there, and renames the folder into place: a killed build leaves nothing half-made
under the final name, and a built environment is found again at once.

Environments live in ``$FPEMU_ENV_DIR`` (default ``~/.cache/fpemu/envs``), one folder
``<name>-<hash>`` per requirement set and Python version.  Console scripts inside
them keep their temporary path in the shebang: run tools as ``<env>/bin/python -m ...``.

:func:`call_in_environment` runs ``"module:function"`` in a worker process of the
environment's Python, started once per environment and reused; arguments and results
cross as pickles.  The worker imports fpemu from the same checkout as the caller, or the
same installed files (:func:`fpemu_source`), so both sides agree on the classes that cross.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import importlib.metadata
import json
import os
import pathlib
import pickle
import re
import select
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Optional

from fpemu.errors import FpemuInputError
from fpemu.environments.worker import FRAME, split_entry

# name -> pip requirements.  Pin every package whose version decides a result.
ENVIRONMENTS = {
    "paddle": ("paddlepaddle==3.3.1", "numpy==2.3.5", "ml_dtypes==0.5.4"),
    "tf_keras": ("tf-keras==2.21.0", "tensorflow==2.21.0", "numpy==2.4.6", "ml_dtypes==0.6.0"),
}

MANIFEST = "fpemu-environment.json"


class EnvironmentBuildError(RuntimeError):
    """pip or the import check failed while building an environment."""


class EnvironmentNotBuilt(RuntimeError):
    """The environment asked for has not been built here."""


class EnvironmentCallError(RuntimeError):
    """A function called in an environment raised, or its worker died; ``remote_traceback`` has the details."""

    def __init__(self, message: str, remote_traceback: str = ""):
        super().__init__(message)
        self.remote_traceback = remote_traceback


class EnvironmentTimeout(EnvironmentCallError, TimeoutError):
    """A call in an environment ran past its timeout (its worker was killed)."""


# -- where environments live --------------------------------------------------

def requirements_of(name: str) -> tuple:
    """The requirements of environment ``name``; an unknown name is an input error listing the known ones."""
    if name not in ENVIRONMENTS:
        raise FpemuInputError(f"unknown environment {name!r}; known environments: "
                              f"{', '.join(ENVIRONMENTS)}")
    return ENVIRONMENTS[name]


def environments_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("FPEMU_ENV_DIR") or pathlib.Path.home() / ".cache" / "fpemu" / "envs")


def _checkout_root() -> pathlib.Path:
    """The source tree of the fpemu this process imported (the folder holding pyproject.toml)."""
    root = pathlib.Path(__file__).resolve().parents[2]  # fpemu/environments/__init__.py
    if not (root / "pyproject.toml").is_file():
        raise EnvironmentBuildError(f"fpemu at {root} is not a source checkout (no pyproject.toml): "
                                    "environments install and import fpemu from a checkout")
    return root


_LINKED_SOURCE = []  # the folder linking an installed fpemu, made once per process, removed at exit


def fpemu_source() -> pathlib.Path:
    """The folder to put first on an environment's ``PYTHONPATH`` so it imports this process's fpemu:
    the checkout's root, or, for an installed (non-editable) fpemu, a folder holding one link, ``fpemu``,
    to the installed package (the same files, compiled kernels included: the environment's Python is this
    Python's version, as :func:`environment_dir` keys it)."""
    try:
        return _checkout_root()
    except EnvironmentBuildError:
        pass
    if not _LINKED_SOURCE:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="fpemu-installed-"))
        (folder / "fpemu").symlink_to(pathlib.Path(__file__).resolve().parents[1], target_is_directory=True)
        atexit.register(shutil.rmtree, folder, True)
        _LINKED_SOURCE.append(folder)
    return _LINKED_SOURCE[0]


def core_requirements() -> tuple:
    """fpemu's own dependencies: from the checkout's pyproject.toml, or, for an installed fpemu, from
    its distribution's metadata (so looking an environment up never needs a checkout; building does)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib
    try:
        pyproject = _checkout_root() / "pyproject.toml"
    except EnvironmentBuildError:
        import importlib.metadata
        return tuple(r for r in importlib.metadata.requires("fpemu") or () if "extra ==" not in r)
    with open(pyproject, "rb") as handle:
        return tuple(tomllib.load(handle)["project"]["dependencies"])


def _install_list(name: str, requirements=None) -> tuple:
    """What environment ``name`` installs: its row of :data:`ENVIRONMENTS`, or ``requirements`` for an
    environment made on the fly (a version set of ``fpemu matrix``), then fpemu's core dependencies."""
    return (requirements_of(name) if requirements is None else tuple(requirements)) + core_requirements()


def environment_dir(name: str, requirements=None) -> pathlib.Path:
    """Where environment ``name`` is (or would be) built: a hash of what it installs and the Python."""
    key = "\n".join((f"python {sys.version_info[0]}.{sys.version_info[1]}", *_install_list(name, requirements)))
    return environments_root() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _python_in(folder: pathlib.Path) -> pathlib.Path:
    return folder / "bin" / "python"


def environment_python(name: str, requirements=None) -> Optional[pathlib.Path]:
    """The Python of environment ``name``, or None when it has not been built."""
    folder = environment_dir(name, requirements)
    return _python_in(folder) if (folder / MANIFEST).is_file() else None


def environment_manifest(name: str, requirements=None) -> Optional[dict]:
    """What the build of ``name`` recorded (packages installed, seconds, size), or None if not built."""
    path = environment_dir(name, requirements) / MANIFEST
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


# -- building -----------------------------------------------------------------

def _run_build_step(name: str, what: str, command: list, timeout: float, **kwargs) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    except subprocess.TimeoutExpired:
        raise EnvironmentBuildError(f"environment {name!r}: {what} ran past {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise EnvironmentBuildError(f"environment {name!r}: {what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def isolated_env() -> dict:
    """os.environ without anything that would let another environment's packages in."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _staged_source(root: pathlib.Path, into: pathlib.Path) -> pathlib.Path:
    """A copy of the files pip builds fpemu from, so the build writes nothing into the checkout."""
    source = into / "fpemu-source"
    shutil.copytree(root / "fpemu", source / "fpemu", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(root / name, source / name)
    return source


_CHECK = ("import json, importlib.metadata as m, fpemu, numpy, ml_dtypes; "
          "print(json.dumps({'fpemu_file': fpemu.__file__, "
          "'packages': {d.metadata['Name']: d.version for d in m.distributions()}}))")


def _folder_bytes(folder: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _installer(python: str) -> list:
    """The install command for the venv of ``python``: uv's when uv is on PATH (much faster), else this
    process's own pip run against it (``pip --python``), else the venv's pip; each reuses its download cache,
    so a wheel is fetched once for every environment."""
    uv = shutil.which("uv")
    if uv:
        return [uv, "pip", "install", "--python", python]
    if _outer_pip():
        return [sys.executable, "-m", "pip", "--python", python, "install", "--no-input", "--disable-pip-version-check"]
    return [python, "-m", "pip", "install", "--no-input", "--disable-pip-version-check"]


def _outer_pip() -> bool:
    """Whether this process's environment has a pip that installs into another Python (``--python``: pip 22.3
    and later); then a venv is made without a pip of its own (``ensurepip`` took 5 of a build's seconds)."""
    try:
        version = importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(part) for part in re.findall(r"\d+", version)[:2]) >= (22, 3)


def _install_fpemu(name: str, pip: list, timeout: float, env: dict, folder: pathlib.Path) -> pathlib.Path:
    """Put fpemu into the venv being built; returns the folder its import must resolve into.  From a
    checkout, a copy is pip-installed (no dependencies); an installed fpemu is not reinstalled (there is
    no source to build from): the check imports it through :func:`fpemu_source`'s link, as every worker
    and recording does (``env`` gets the PYTHONPATH)."""
    try:
        root = _checkout_root()
    except EnvironmentBuildError:
        env["PYTHONPATH"] = str(fpemu_source())
        return pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory(prefix="fpemu-stage-") as stage:
        source = _staged_source(root, pathlib.Path(stage))
        _run_build_step(name, "pip install --no-deps fpemu", pip + ["--no-deps", str(source)], timeout, env=env)
    return folder.resolve()


def _build_into(name: str, folder: pathlib.Path, timeout: float, requirements=None) -> dict:
    """Make the venv in ``folder`` and install everything; returns the manifest."""
    started = time.monotonic()
    env = isolated_env()
    python = str(_python_in(folder))
    pip = _installer(python)
    no_pip = ["--without-pip"] if pip[0] != python else []  # the installer runs from outside the venv
    _run_build_step(name, "python -m venv", [sys.executable, "-m", "venv", *no_pip, str(folder)], timeout, env=env)
    install = list(_install_list(name, requirements))
    _run_build_step(name, "pip install " + " ".join(install), pip + install, timeout, env=env)
    expected = _install_fpemu(name, pip, timeout, env, folder)
    # Run from the venv's folder: the checkout must not shadow the installed copy.
    check = json.loads(_run_build_step(name, "import fpemu", [python, "-c", _CHECK], timeout, env=env,
                                       cwd=folder))
    if not pathlib.Path(check["fpemu_file"]).resolve().is_relative_to(expected):
        raise EnvironmentBuildError(f"environment {name!r}: fpemu imported from {check['fpemu_file']}, "
                                    f"not from {expected}")
    return {"name": name, "requirements": install, "python": sys.version.split()[0],
            "packages": check["packages"], "build_seconds": round(time.monotonic() - started, 1),
            "size_bytes": _folder_bytes(folder)}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and someone else's
        pass
    return True


def _sweep_abandoned(final: pathlib.Path) -> None:
    """Remove temporary build folders of ``final`` whose builder was killed."""
    for stale in final.parent.glob(f".{final.name}.building-*"):
        pid = stale.name.rsplit("-", 2)[-2]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)


def build_environment(name: str, timeout: float = 1800.0, requirements=None) -> pathlib.Path:
    """Build environment ``name`` (see the module docstring) and return its folder; instant when built.

    Args:
      timeout: seconds each build step (venv, pip install, import check) may take.
      requirements: what to install instead of ``name``'s row of :data:`ENVIRONMENTS` (an environment
        made on the fly; ``name`` then only labels its folder and messages).
    """
    final = environment_dir(name, requirements)
    if environment_python(name, requirements) is not None:
        mark_used(final)
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _sweep_abandoned(final)
    building = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.building-{os.getpid()}-"))
    building.chmod(0o755)  # mkdtemp's 0700 would keep a shared cache private
    try:
        manifest = _build_into(name, building, timeout, requirements)
        (building / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        try:
            os.rename(building, final)
        except OSError:
            if environment_python(name, requirements) is None:  # not another build finishing first
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    mark_used(final)
    cap = size_cap()
    if cap is not None:
        prune_environments(max_bytes=cap, keep=(final,))
    return final


# -- the cache: what is built, when it was last used, pruning ------------------

LAST_USED = ".last-used"  # touched on every build, lookup by build_environment and call
RECENT_SECONDS = 600.0  # an environment used this recently is never pruned (a call or recording may be running)
SIZE_CAP_VARIABLE = "FPEMU_ENV_MAX_SIZE"


def mark_used(folder: pathlib.Path) -> None:
    """Record that the environment in ``folder`` was used now (what `fpemu env list` shows and prune reads)."""
    try:
        (folder / LAST_USED).touch()
    except OSError:  # a read-only shared cache: its last use stays unknown
        pass


def parse_size(text: str, where: str) -> int:
    """Bytes from ``20G``, ``512M``, ``300K`` or a plain number of bytes.

    Example:
      >>> parse_size("1.5G", "--max-size"), parse_size("4096", "--max-size")
      (1610612736, 4096)
    """
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    body = str(text).strip().upper().removesuffix("B").removesuffix("I")
    factor = units.get(body[-1:], 1)
    try:
        value = float(body[:-1] if body[-1:] in units else body)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise FpemuInputError(f"{where}: expected a size such as 20G, 512M or a number of bytes, got {text!r}")
    return int(value * factor)


def size_cap() -> Optional[int]:
    """The cache's size cap in bytes from ``$FPEMU_ENV_MAX_SIZE`` (None: no cap)."""
    text = os.environ.get(SIZE_CAP_VARIABLE)
    return parse_size(text, f"${SIZE_CAP_VARIABLE}") if text else None


@dataclasses.dataclass(frozen=True)
class CachedEnvironment:
    """One folder of the cache.

    Attributes:
      name: the environment's name (``paddle``, ``matrix-jax-0.4.31-1a2b3c4d``).
      folder: where it is.
      versions: name -> installed version of each package its own requirements name.
      size_bytes: its size when built (the manifest's).
      last_used: when it was last built, looked up or called (seconds since the epoch).
      building: a build in progress (a live builder's temporary folder): never pruned.
    """

    name: str
    folder: pathlib.Path
    versions: dict
    size_bytes: int
    last_used: float
    building: bool = False


def _requirement_name(requirement: str) -> str:
    import re
    return re.sub(r"[-_.]+", "-", re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0]).lower()


def _cached(folder: pathlib.Path) -> Optional[CachedEnvironment]:
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    core = {_requirement_name(r) for r in core_requirements()}
    own = [_requirement_name(r) for r in manifest.get("requirements", ())]
    installed = {_requirement_name(k): (k, v) for k, v in manifest.get("packages", {}).items()}
    versions = dict(installed[n] for n in dict.fromkeys(own) if n in installed and n not in core)
    stamp = folder / LAST_USED
    last = (stamp if stamp.exists() else folder / MANIFEST).stat().st_mtime
    return CachedEnvironment(manifest.get("name", folder.name.rsplit("-", 1)[0]), folder, versions,
                             int(manifest.get("size_bytes", 0)), last)


def _live_build(folder: pathlib.Path) -> bool:
    pid = folder.name.rsplit("-", 2)[-2] if ".building-" in folder.name else ""
    return pid.isdigit() and _pid_alive(int(pid))


def cached_environments() -> list:
    """Every environment in the cache (named ones, matrix sets, builds in progress), most recently used first."""
    root = environments_root()
    if not root.is_dir():
        return []
    found = []
    for folder in root.iterdir():
        if folder.name.startswith(".") and _live_build(folder):
            found.append(CachedEnvironment(folder.name[1:].split(".building-")[0], folder, {},
                                           _folder_bytes(folder), folder.stat().st_mtime, building=True))
        elif not folder.name.startswith(".") and folder.is_dir():
            entry = _cached(folder)
            found += [entry] if entry else []
    return sorted(found, key=lambda e: -e.last_used)


def _remove(folder: pathlib.Path) -> None:
    """Take the folder out of the cache at once (a rename: a lookup then sees it unbuilt), then delete it."""
    doomed = folder.with_name(f".{folder.name}.pruning-{os.getpid()}")
    os.rename(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune_environments(older_than: Optional[float] = None, max_bytes: Optional[int] = None, everything: bool = False,
                       dry_run: bool = False, keep=(), now: Optional[float] = None) -> list:
    """Remove environments from the cache; returns the CachedEnvironments removed (or, with ``dry_run``,
    that would be).

    Args:
      older_than: remove those last used more than this many seconds ago.
      max_bytes: then remove the least recently used until the cache holds at most this many bytes.
      everything: remove every environment.
      keep: folders never removed (the one just built).

    Never removes a build in progress or an environment used in the last :data:`RECENT_SECONDS` (a
    call or recording may be running in it); abandoned temporary folders of killed builds go too.
    """
    now = time.time() if now is None else now
    entries = [e for e in cached_environments() if not e.building]
    doomed = [e for e in entries if everything or (older_than is not None and now - e.last_used > older_than)]
    if max_bytes is not None:
        total = sum(e.size_bytes for e in entries if e not in doomed)
        for entry in sorted((e for e in entries if e not in doomed), key=lambda e: e.last_used):
            if total <= max_bytes:
                break
            doomed.append(entry)
            total -= entry.size_bytes
    kept = {pathlib.Path(k).resolve() for k in keep}
    doomed = [e for e in doomed if now - e.last_used >= RECENT_SECONDS and e.folder.resolve() not in kept]
    if not dry_run:
        for entry in doomed:
            _remove(entry.folder)
        _sweep_stale(environments_root())
    return doomed


def _sweep_stale(root: pathlib.Path) -> None:
    """Remove the temporary folders of builds and prunes whose process is gone."""
    if not root.is_dir():
        return
    for folder in root.glob(".*"):
        marker = ".building-" if ".building-" in folder.name else ".pruning-" if ".pruning-" in folder.name else ""
        pid = folder.name.rsplit(marker, 1)[-1].split("-")[0] if marker else ""
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


# -- calling into an environment -----------------------------------------------

def _write_all(fd: int, data: bytes, deadline: float) -> bool:
    """Write ``data`` to a non-blocking fd before ``deadline``; False if time ran out."""
    view = memoryview(data)
    while view:
        if not select.select([], [fd], [], max(deadline - time.monotonic(), 0))[1]:
            return False
        view = view[os.write(fd, view):]
    return True


def _read_exact(fd: int, size: int, deadline: float) -> Optional[bytes]:
    """``size`` bytes from fd before ``deadline``; None if time ran out, b"" on end of file."""
    chunks, left = [], size
    while left:
        if not select.select([fd], [], [], max(deadline - time.monotonic(), 0))[0]:
            return None
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            return b""
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


_WORKER_SCRIPT = pathlib.Path(__file__).with_name("worker.py")


class _Worker:
    """A process of an environment's Python serving calls; requests and replies are framed pickles."""

    def __init__(self, name: str, python: pathlib.Path):
        self.name = name
        self.python = python
        self.stderr = tempfile.TemporaryFile()
        env = {**isolated_env(), "PYTHONPATH": str(fpemu_source())}
        self.process = subprocess.Popen([str(python), str(_WORKER_SCRIPT)],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr,
                                        env=env)
        os.set_blocking(self.process.stdin.fileno(), False)

    def call(self, entry: str, args: tuple, timeout: float):
        where = f"environment {self.name!r}, {entry}"
        try:
            request = pickle.dumps((entry, args))
        except Exception as error:
            raise TypeError(f"{where}: the arguments cannot be pickled: {error}") from None
        deadline = time.monotonic() + timeout
        frame = self._exchange(FRAME.pack(len(request)) + request, deadline, where, timeout)
        try:
            status, payload, remote = pickle.loads(frame)
        except Exception as error:
            raise EnvironmentCallError(f"{where}: its result cannot be unpickled here ({type(error).__name__}: "
                                       f"{error}); return plain values") from None
        if status == "ok":
            return payload
        last = remote.strip().splitlines()[-1] if remote.strip() else payload
        raise EnvironmentCallError(f"{where} raised: {last}", remote)

    def _exchange(self, request: bytes, deadline: float, where: str, timeout: float) -> bytes:
        stdin, stdout = self.process.stdin.fileno(), self.process.stdout.fileno()
        try:
            sent = _write_all(stdin, request, deadline)
        except BrokenPipeError:
            sent = True  # the worker died; reading says so
        header = _read_exact(stdout, FRAME.size, deadline) if sent else None
        body = _read_exact(stdout, FRAME.unpack(header)[0], deadline) if header else header
        if body is None:
            self.close()
            raise EnvironmentTimeout(f"{where}: no result within {timeout:g} s (the worker was killed)")
        if not body:
            code = self.process.wait()
            tail = self._stderr_tail()
            self.close()
            raise EnvironmentCallError(f"{where}: the worker died (exit {code}); its stderr ends:\n{tail}")
        return body

    def _stderr_tail(self, lines: int = 15) -> str:
        self.stderr.seek(0)
        return "\n".join(self.stderr.read().decode(errors="replace").strip().splitlines()[-lines:])

    def alive(self) -> bool:
        return self.process.poll() is None

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()
        self.stderr.close()


_workers = {}


def _worker(name: str) -> _Worker:
    python = environment_python(name)
    if python is None:
        raise EnvironmentNotBuilt(f"environment {name!r} is not built in {environments_root()}: "
                                  f"run `fpemu env build {name}`")
    worker = _workers.get(name)
    if worker is not None and (not worker.alive() or worker.python != python):
        worker.close()
        worker = None
    if worker is None:
        worker = _workers[name] = _Worker(name, python)
    mark_used(python.parent.parent)
    return worker


@atexit.register
def close_workers() -> None:
    """Stop every environment worker this process started."""
    while _workers:
        _workers.popitem()[1].close()


def call_in_environment(name: str, entry: str, *args, timeout: float = 300.0):
    """Run ``entry`` ("module:function") with ``args`` in environment ``name`` and return its result.

    Raises:
      FpemuInputError: ``name`` is not a known environment.
      EnvironmentNotBuilt: it is known but not built here.
      EnvironmentCallError: the function raised (the message ends with the remote
        traceback's last line; ``remote_traceback`` has all of it), or the worker died.
      EnvironmentTimeout: no result within ``timeout`` seconds; the worker is killed and
        the next call starts a new one.
    """
    requirements_of(name)
    split_entry(entry)
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return _worker(name).call(entry, args, timeout)
