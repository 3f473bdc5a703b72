"""Atomic publication of files and directories on a shared filesystem.

Every file another process reads is written as ``<name>.tmp.<writer>``, flushed,
fsynced and then ``os.replace``d onto its final name, so readers that list
only final names never see a partial file. Directories are built under
``<name>.tmp.<writer>/`` and renamed as a whole. Records created exclusively
(:func:`create_exclusive`) are written and fsynced under a temporary name and
hard-linked into place. No ``flock``: this must hold on NFS and Lustre.

``<writer>`` is ``<instance>.<pid>`` in a component (its job instance,
``HPCRL_INSTANCE``), ``<pid>`` elsewhere, so the supervisor can tell whose a
leftover is and sweep those of dead writers (:func:`temporary_writer`).
A write that fails removes its temporary and raises a storage fault as
:class:`hpcrl.fs.faults.StorageError` (path, operation, filesystem).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterator

from hpcrl.fs.faults import guarded

TMP_MARK = ".tmp."
ENV_INSTANCE = "HPCRL_INSTANCE"  # hpcrl.runtime.owner sets it for every component

_AT_FDCWD, _RENAME_NOREPLACE = -100, 1
try:  # Linux (glibc >= 2.28): a rename that refuses an existing target in one call
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
except (AttributeError, OSError, TypeError):
    _renameat2 = None
_NOT_SUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP)  # a filesystem without RENAME_NOREPLACE (NFS)


def rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename ``src`` to ``dst`` unless ``dst`` exists: ``FileExistsError`` then, ``FileNotFoundError`` when
    ``src`` is gone (moved already, e.g. by a concurrent claimer). One ``renameat2(RENAME_NOREPLACE)`` where the
    kernel and the filesystem have it (atomic, one metadata operation); elsewhere a look at ``dst`` and a rename
    (safe where each target directory has a single writer, as in the spool)."""
    global _renameat2
    native = _renameat2  # read once: another thread may switch it off meanwhile
    if native is None:
        _portable_rename_noreplace(src, dst)
        return
    if native(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return
    err = ctypes.get_errno()
    if err == errno.EEXIST:  # the kernel reports a missing source first: this one was there
        raise FileExistsError(errno.EEXIST, f"{dst} already exists (moving {src})", str(dst))
    if err == errno.ENOENT:
        _refused(src, dst)
    if err not in _NOT_SUPPORTED:
        raise OSError(err, os.strerror(err), str(src), None, str(dst))
    _portable_rename_noreplace(src, dst)  # raises if the arguments were at fault, not the filesystem
    _renameat2 = None  # it worked without the flag: this process's filesystem lacks it, the portable way from now on


def _portable_rename_noreplace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    if os.path.lexists(dst):
        _refused(src, dst)
    os.rename(src, dst)


def _refused(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    if not os.path.lexists(src):
        raise FileNotFoundError(errno.ENOENT, f"{src} vanished" if os.path.lexists(dst) else "no such file",
                                str(src))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, f"{dst} already exists (moving {src})", str(dst))
    raise FileNotFoundError(errno.ENOENT, f"no directory for {dst}", str(dst))


def is_temporary(name: str) -> bool:
    """True for names produced by this module while a write is in flight."""
    return TMP_MARK in name


def temporary_name(path: str | os.PathLike) -> Path:
    """The name this process writes ``path`` under before publishing it: ``<name>.tmp.[<instance>.]<pid>``."""
    path = Path(path)
    instance = os.environ.get(ENV_INSTANCE, "")
    return path.with_name(f"{path.name}{TMP_MARK}{instance + '.' if instance else ''}{os.getpid()}")


def temporary_writer(name: str) -> str | None:
    """The job instance that wrote the temporary ``name`` (None: not a temporary, or written outside a
    component)."""
    if TMP_MARK not in name:
        return None
    parts = name.rsplit(TMP_MARK, 1)[1].split(".")
    return parts[0] if len(parts) == 2 and parts[1].isdigit() else None


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes(path: str | os.PathLike, data: bytes, sync_dir: bool = True) -> None:
    """Atomically replace ``path`` with ``data`` (its content fsynced before the rename; the rename made durable
    too unless ``sync_dir`` is False: a caller that fsyncs the directory later itself)."""
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with guarded("write", path):
            _write_synced(tmp, data)
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def create_exclusive(path: str | os.PathLike, data: bytes, tmp_dir: str | os.PathLike) -> bool:
    """Create ``path`` holding ``data`` unless it exists; True if this call created it.

    The data is written and fsynced under a temporary name in ``tmp_dir`` (same filesystem, a directory no
    reader lists) and hard-linked onto ``path``: the link fails if ``path`` exists, so exactly one of any number
    of concurrent creators wins (as ``O_CREAT | O_EXCL`` would), and a full filesystem fails the write before
    anything appears under ``path``: no reader ever sees an empty or partial record.
    """
    path = Path(path)
    tmp = temporary_name(Path(tmp_dir) / f"{path.parent.name}-{path.name}")  # tickets/t1 and reissue/t1 differ
    try:
        with guarded("exclusive create", path):
            _write_synced(tmp, data)
            try:
                os.link(tmp, path)
            except FileExistsError:  # NFS: a retransmitted link that succeeded the first time says EEXIST too
                return os.stat(tmp).st_nlink > 1
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                return _create_in_place(path, data)
            return True
    finally:
        with contextlib.suppress(OSError):  # left behind, it is a temporary the sweep removes
            tmp.unlink(missing_ok=True)


_NO_LINKS = (errno.EPERM, errno.EXDEV, errno.EOPNOTSUPP, errno.EMLINK)  # filesystems without hard links here


def _create_in_place(path: Path, data: bytes) -> bool:
    """``O_CREAT | O_EXCL`` and a write: where hard links are refused. One creator still wins; a write that fails
    removes the record again (a reader may see it empty meanwhile, and takes an empty record as being written)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return True


def write_text(path: str | os.PathLike, text: str, sync_dir: bool = True) -> None:
    write_bytes(path, text.encode(), sync_dir)


def write_json(path: str | os.PathLike, obj: Any, sync_dir: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", sync_dir)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one record (a newline is added) to a log that readers take line by line, such as
    ``jobs/events.jsonl``. A line an earlier append left torn (a full filesystem, a kill) is ended first, so
    this record is never glued to it and lost with it; the torn line itself stays unreadable."""
    path = Path(path)
    data = line.rstrip("\n").encode() + b"\n"
    with guarded("append", path):
        with open(path, "ab") as f:
            if f.tell() > 0 and _last_byte(path) != b"\n":
                data = b"\n" + data
            f.write(data)


def _last_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def temporary_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success rename it onto ``path``.

    The caller writes and closes the file (e.g. with h5py); this fsyncs it and
    publishes it. On error the temporary file is removed.
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        yield tmp
        with guarded("write", path):
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            tmp.unlink()


@contextlib.contextmanager
def directory(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it onto ``path``.

    ``path`` must not exist yet (published directories are immutable).
    """
    path = Path(path)
    tmp = temporary_name(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        with guarded("directory creation", path):
            tmp.mkdir(parents=True)
        yield tmp
        with guarded("directory write", path):
            for child in tmp.iterdir():
                if child.is_file():
                    with open(child, "rb") as f:
                        os.fsync(f.fileno())
            fsync_dir(tmp)
            os.rename(tmp, path)
        fsync_dir(path.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
