"""Files are written whole or not at all."""

from __future__ import annotations

import os
import stat
import pathlib
import tempfile


def atomic_write(path, data, mode: str = "w") -> pathlib.Path:
    """Write ``data`` (str, or bytes with mode="wb") through a temporary file in the same folder
    and a rename, so a reader never sees a half-written file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
            handle.write(data)
        os.chmod(tmp, _file_mode(path))
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def _file_mode(path: pathlib.Path) -> int:
    """The mode a rewritten file keeps, or a new file's as open() would make it (0666 less the umask):
    mkstemp's 0600 would make committed goldens and reports private to their writer."""
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def read_text(path, error: type) -> str:
    """The UTF-8 text of ``path``; an unreadable file raises ``error`` naming it."""
    try:
        return pathlib.Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as problem:
        reason = getattr(problem, "strerror", None) or str(problem)
        raise error(f"{path}: cannot read: {reason}") from None


_KINDS = {stat.S_IFDIR: "a folder", stat.S_IFIFO: "a named pipe", stat.S_IFSOCK: "a socket",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device"}


def read_bounded(path, error: type, max_bytes: int) -> bytes:
    """The bytes of ``path``, refused (``error`` naming it) when it holds more than ``max_bytes``: the size
    is checked before anything is read; so is what it is (a named pipe or a socket would block the open
    or the read until a writer came, for ever)."""
    try:
        kind = os.stat(path).st_mode
        if not stat.S_ISREG(kind):
            raise error(f"{path}: not a regular file ({_KINDS.get(stat.S_IFMT(kind), 'a special file')}): "
                        "expected a file to read")
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes:
                raise error(f"{path}: {size:,} bytes, over the {max_bytes:,} a reader of it accepts")
            data = handle.read(max_bytes + 1)  # a file that grew (or a pipe) is bounded too
    except OSError as problem:
        raise error(f"{path}: cannot read: {problem.strerror or problem}") from None
    except ValueError as problem:  # a path holding a NUL byte
        raise error(f"{str(path)!r}: cannot read: {problem}") from None
    if len(data) > max_bytes:
        raise error(f"{path}: over the {max_bytes:,} bytes a reader of it accepts")
    return data
