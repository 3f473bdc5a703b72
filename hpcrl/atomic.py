"""Atomic publication of files and directories on a shared filesystem.

Every file another process reads is written as ``<name>.tmp.<pid>``, flushed,
fsynced and then ``os.replace``d onto its final name, so readers that list
only final names never see a partial file. Directories are built under
``<name>.tmp.<pid>/`` and renamed as a whole. No ``flock``: this must hold on
NFS and Lustre.
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

TMP_MARK = ".tmp."

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


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")


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
    tmp = _tmp_name(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if sync_dir:
        fsync_dir(path.parent)


def write_text(path: str | os.PathLike, text: str, sync_dir: bool = True) -> None:
    write_bytes(path, text.encode(), sync_dir)


def write_json(path: str | os.PathLike, obj: Any, sync_dir: bool = True) -> None:
    write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", sync_dir)


def read_json(path: str | os.PathLike) -> Any:
    return json.loads(Path(path).read_text())


@contextlib.contextmanager
def temporary_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of ``path``; on success rename it onto ``path``.

    The caller writes and closes the file (e.g. with h5py); this fsyncs it and
    publishes it. On error the temporary file is removed.
    """
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        yield tmp
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
    tmp = _tmp_name(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        yield tmp
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
