"""Storage faults on the run directory's filesystem: which errors they are, where they happened, how full it is.

A run lives on a shared filesystem (Lustre, GPFS, NFS) whose quota fills and whose servers fail or stall. An
``OSError`` with one of :data:`FAULTS`' errnos (full, over quota, I/O error, stale handle, read-only, timed out)
is a *storage fault*: not a bug of the component that met it, and gone once space or the server comes back.
:func:`guarded` turns such an error into a :class:`StorageError` that names the operation, the path and the
filesystem (mount point, free bytes and inodes from ``statvfs``); it is still an ``OSError`` with the same
errno, so existing handlers keep working. :func:`storage_fault` finds one anywhere in an exception's chain
(h5py and torch wrap the ``OSError`` they met; safetensors reports only its text).

Who does what with one (design.md §4.12): a component stops with :data:`EXIT_STORAGE`
(:func:`hpcrl.runtime.exits.component_exit`); the watchdog reads that code as "wait for storage", not as a
crash; the supervisor retries its own writes and resubmits the component once the filesystem has room
(:mod:`hpcrl.launch.storage_wait`).
"""

from __future__ import annotations

import errno
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

EXIT_STORAGE = 74  # EX_IOERR: the component stopped on a storage fault; restart it once storage is back

FAULTS = {errno.ENOSPC: "full", errno.EDQUOT: "over quota", errno.EIO: "I/O error", errno.ESTALE: "stale file handle",
          errno.EROFS: "read-only", errno.ETIMEDOUT: "timed out"}
SPACE = (errno.ENOSPC, errno.EDQUOT)  # faults that more free space clears


@dataclass(frozen=True)
class Filesystem:
    """The filesystem holding a path, as ``statvfs`` saw it."""
    mount: str
    free_bytes: int  # available to this user (f_bavail)
    total_bytes: int
    free_inodes: int
    total_inodes: int

    def describe(self) -> str:
        share = self.free_bytes / self.total_bytes if self.total_bytes else 0.0
        inodes = f", {self.free_inodes:,} of {self.total_inodes:,} inodes free" if self.total_inodes else ""
        return f"{self.mount}: {human_bytes(self.free_bytes)} free of {human_bytes(self.total_bytes)} " \
               f"({share:.1%}){inodes}"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (a file being created is not there yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def mount_point(path: str | os.PathLike) -> str:
    """The mount point of the filesystem holding ``path``: the highest ancestor on the same device."""
    path = _existing(Path(path))
    dev = path.stat().st_dev
    while path != path.parent and path.parent.stat().st_dev == dev:
        path = path.parent
    return str(path)


def filesystem(path: str | os.PathLike) -> Filesystem | None:
    """The filesystem holding ``path`` (None if even ``statvfs`` fails: the server is gone)."""
    try:
        where = _existing(Path(path))
        st = os.statvfs(where)
        return Filesystem(mount_point(where), st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize,
                          st.f_favail, st.f_files)
    except OSError:
        return None


class StorageError(OSError):
    """A storage fault met by ``op`` on ``path``; ``filesystem`` as it was right after (None if unreadable)."""

    def __init__(self, op: str, path: str | os.PathLike, cause: OSError) -> None:
        super().__init__(cause.errno, cause.strerror or str(cause), str(path))
        self.op, self.path, self.kind = op, str(path), FAULTS.get(cause.errno or 0, "fault")
        self.filesystem = filesystem(path)

    @property
    def needs_space(self) -> bool:
        return self.errno in SPACE

    def __str__(self) -> str:
        fs = self.filesystem.describe() if self.filesystem else "its filesystem does not answer statvfs"
        return f"storage fault ({self.kind}, {errno.errorcode.get(self.errno or 0, self.errno)}) during " \
               f"{self.op} of {self.path}: {self.strerror}; filesystem {fs}"


def is_fault(e: BaseException) -> bool:
    """An ``OSError`` with a storage errno; ETIMEDOUT only from a call on a path (a network timeout, e.g. a
    connect to an inference server, is not one)."""
    if not isinstance(e, OSError) or e.errno not in FAULTS:
        return False
    return e.errno != errno.ETIMEDOUT or bool(e.filename)


def _inner(error: BaseException) -> list[BaseException]:
    """The exceptions ``error`` carries: its cause and context, an ExceptionGroup's members, and the per-rank
    failures of torch.distributed.checkpoint's ``CheckpointException`` (``failures``: rank -> (exception,
    traceback))."""
    found = [e for e in (error.__cause__, error.__context__) if e is not None]
    found += list(getattr(error, "exceptions", None) or [])
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict):
        for v in failures.values():
            found += [x for x in (v if isinstance(v, tuple) else (v,)) if isinstance(x, BaseException)]
    return found


# how libraries that do not raise OSError report one: Rust's io::Error (safetensors: "... (os error 28)"),
# Python's own text of an OSError wrapped in another exception ("[Errno 28] ..."), HDF5 ("errno = 28")
_ERRNO_IN_TEXT = re.compile(r"(?:\(os error |\[Errno |errno = )(\d+)")


def _from_text(error: BaseException) -> OSError | None:
    """The storage fault a non-``OSError`` exception reports in its message, as an ``OSError``."""
    if isinstance(error, OSError):
        return None
    for match in _ERRNO_IN_TEXT.finditer(str(error)):
        code = int(match.group(1))
        if code in FAULTS and code != errno.ETIMEDOUT:  # a text has no path to tell a network timeout apart
            fault = OSError(code, f"{os.strerror(code)} (reported by {type(error).__name__}: {error})")
            fault.__cause__ = error
            return fault
    return None


def storage_fault(error: BaseException | None) -> OSError | None:
    """The storage fault behind ``error`` (itself, or an exception it carries: :func:`_inner`; also one a library
    reports only in its message: :func:`_from_text`), if any."""
    todo, seen = [error] if error is not None else [], 0
    while todo and seen < 50:
        e, seen = todo.pop(0), seen + 1
        if is_fault(e):
            return e  # type: ignore[return-value]
        fault = _from_text(e)
        if fault is not None:
            return fault
        todo += _inner(e)
    return None


def as_storage_error(error: OSError, op: str = "an operation", path: str | os.PathLike | None = None) -> StorageError:
    """``error`` as a :class:`StorageError` (itself if it is one already)."""
    if isinstance(error, StorageError):
        return error
    return StorageError(op, path or error.filename or "?", error)


@contextmanager
def guarded(op: str, path: str | os.PathLike) -> Iterator[None]:
    """Raise a storage fault met inside as a :class:`StorageError` naming ``op``, ``path`` and the filesystem;
    other errors pass unchanged."""
    try:
        yield
    except StorageError:
        raise
    except OSError as e:
        if e.errno in FAULTS:
            raise StorageError(op, path, e) from e
        raise


def has_room(path: str | os.PathLike, need_bytes: int) -> bool:
    """Whether the filesystem holding ``path`` has ``need_bytes`` free (True when it cannot be asked: the
    write itself will say what is wrong)."""
    fs = filesystem(path)
    return fs is None or fs.free_bytes >= need_bytes
