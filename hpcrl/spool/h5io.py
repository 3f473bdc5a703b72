"""Low-level HDF5 access for spool files: an in-memory image on write, a few calls on read.

Spool files are small (a few KiB) and are written and read by the thousand,
so the fixed cost per HDF5 object dominates. h5py's high-level API spends
tens of microseconds of Python per object access and per attribute (and
converting a stored compound type to a numpy dtype alone costs ~30 us);
this module goes through h5py's low-level API (``h5f``/``h5d``/``h5a``)
with HDF5 types built once, and compares stored types with ``H5Tequal``.

Writing: :func:`encode` builds the whole file in memory (HDF5 core driver,
no backing store) and returns its bytes. The caller writes them with plain
file calls, so publication (one write, fsync, rename) stays the store's
job and the shared filesystem sees one write instead of HDF5's many small
ones. Strings are stored as fixed-length UTF-8.

Reading: :class:`H5File` opens a file read-only, reading it whole into
memory with one ``read`` (core driver), without HDF5 file locking: spool
files are published by rename after being closed, so no reader ever races a
writer, and locking is unreliable on NFS/Lustre. Every accessor
checks the stored type and rank before reading and raises
``SpoolFormatError`` naming the object: nothing is converted implicitly
(HDF5 would silently narrow an int64 into an int32 buffer, for instance).
"""

from __future__ import annotations

import functools
import itertools
import os
from pathlib import Path
from types import TracebackType
from typing import Mapping

import numpy as np
from h5py import h5a, h5d, h5f, h5p, h5s, h5t

from hpcrl.spool.errors import SpoolFormatError

_image_ids = itertools.count()


@functools.lru_cache(maxsize=None)
def _core_fapl() -> h5p.PropFAID:
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_fapl_core(block_size=16 * 1024, backing_store=False)
    # The 1.8 file format: readable by any HDF5 >= 1.8, and the first with dense attribute
    # storage, without which an attribute (the JSON header) could not exceed 64 KiB.
    fapl.set_libver_bounds(h5f.LIBVER_V18, h5f.LIBVER_V18)
    return fapl


@functools.lru_cache(maxsize=None)
def _read_fapl() -> h5p.PropFAID:
    fapl = h5p.create(h5p.FILE_ACCESS)
    fapl.set_file_locking(False, True)
    # The core driver reads the whole file with one read() at open instead of ~15 small preads
    # (superblock, object headers, data): the same cost on a local disk, fewer round trips on Lustre/NFS.
    fapl.set_fapl_core(backing_store=False)
    return fapl


@functools.lru_cache(maxsize=None)
def h5type(dtype: np.dtype) -> h5t.TypeID:
    """The HDF5 type of a numeric (possibly compound) numpy dtype, built once."""
    return h5t.py_create(np.dtype(dtype))


def _utf8_type(nbytes: int) -> h5t.TypeID:
    tid = h5t.C_S1.copy()
    tid.set_size(max(nbytes, 1))
    tid.set_cset(h5t.CSET_UTF8)
    tid.set_strpad(h5t.STR_NULLPAD)
    return tid


def encode(attrs: Mapping[str, int | str], datasets: Mapping[str, np.ndarray]) -> bytes:
    """The bytes of an HDF5 file holding scalar ``attrs`` (int64 or UTF-8) and 1-D ``datasets``."""
    # unique (HDF5 tracks open names), and under /dev/null/, where nothing can exist: the core driver probes the
    # name with open(2), and a relative name would cost a lookup in the working directory (often on the shared
    # filesystem, hence its metadata server) for every file written
    name = f"/dev/null/spool-image-{os.getpid()}-{next(_image_ids)}".encode()
    fid = h5f.create(name, h5f.ACC_TRUNC, fapl=_core_fapl())
    try:
        for key, value in attrs.items():
            _write_attr(fid, key, value)
        for key, arr in datasets.items():
            arr = np.ascontiguousarray(arr)
            if arr.ndim != 1:
                raise ValueError(f"dataset {key!r}: spool datasets are 1-D, got shape {arr.shape}")
            tid = h5type(arr.dtype)
            ds = h5d.create(fid, key.encode(), tid, h5s.create_simple(arr.shape))
            if arr.size:
                ds.write(h5s.ALL, h5s.ALL, arr, mtype=tid)
        h5f.flush(fid)  # the image is only complete after a flush
        return fid.get_file_image()
    finally:
        fid.close()


def _write_attr(fid: h5f.FileID, key: str, value: int | str) -> None:
    if isinstance(value, str):
        data = value.encode("utf-8")
        tid = _utf8_type(len(data))
        arr = np.array(data, dtype=f"S{tid.get_size()}")
    else:
        tid = h5type(np.dtype(np.int64))
        arr = np.array(int(value), np.int64)
    h5a.create(fid, key.encode(), tid, h5s.create(h5s.SCALAR)).write(arr, mtype=tid)


class H5File:
    """A spool file opened read-only for a few typed reads; use as a context manager.

    Opening raises ``FileNotFoundError`` for a missing file and
    ``SpoolFormatError`` for anything HDF5 cannot open (truncated, not HDF5).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            self._fid = h5f.open(os.fsencode(Path(path)), h5f.ACC_RDONLY, fapl=_read_fapl())
        except FileNotFoundError:
            raise
        except OSError as e:
            raise SpoolFormatError(f"unreadable HDF5 file ({e})") from e

    def __enter__(self) -> H5File:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._fid.close()

    def _attr(self, name: str) -> h5a.AttrID:
        try:
            attr = h5a.open(self._fid, name.encode())
        except KeyError:
            raise SpoolFormatError(f"missing attribute {name!r}") from None
        if attr.shape != ():
            raise SpoolFormatError(f"attribute {name!r}: expected a scalar, got shape {attr.shape}")
        return attr

    def _number(self, name: str, classes: tuple[int, ...], what: str, into: np.dtype) -> int | float:
        """Read a numeric scalar of one of ``classes`` converted to ``into`` (int64 or float64)."""
        attr = self._attr(name)
        if attr.get_type().get_class() not in classes:
            raise SpoolFormatError(f"attribute {name!r}: expected {what}, got {attr.dtype}")
        arr = np.empty((), into)
        attr.read(arr, mtype=h5type(into))
        return arr.item()

    def int_attr(self, name: str) -> int:
        """A scalar integer attribute."""
        return int(self._number(name, (h5t.INTEGER,), "an integer", np.dtype(np.int64)))

    def float_attr(self, name: str) -> float:
        """A scalar integer or floating-point attribute, as a float."""
        return float(self._number(name, (h5t.INTEGER, h5t.FLOAT), "a number", np.dtype(np.float64)))

    def str_attr(self, name: str) -> str:
        """A scalar string attribute (fixed- or variable-length), decoded as UTF-8."""
        attr = self._attr(name)
        tid = attr.get_type()
        if tid.get_class() != h5t.STRING:
            raise SpoolFormatError(f"attribute {name!r}: expected a string, got {attr.dtype}")
        if tid.is_variable_str():
            arr = np.empty((), attr.dtype)
            attr.read(arr)
        else:
            arr = np.empty((), f"S{tid.get_size()}")
            attr.read(arr, mtype=tid)  # raw bytes, whatever the declared character set
        value = arr.item()
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    def dataset(self, name: str, dtype: np.dtype | type) -> np.ndarray:
        """The whole of 1-D dataset ``name``, whose stored type must be exactly ``dtype``."""
        try:
            ds = h5d.open(self._fid, name.encode())
        except KeyError:
            raise SpoolFormatError(f"missing dataset {name!r}") from None
        dtype = np.dtype(dtype)
        want = h5type(dtype)
        shape = ds.shape
        if len(shape) != 1 or not ds.get_type().equal(want):
            raise SpoolFormatError(f"dataset {name!r}: expected 1-D {_describe(dtype)}, "
                                   f"got {len(shape)}-D {_describe(ds.dtype)}")
        arr = np.empty(shape, dtype)
        if arr.size:
            ds.read(h5s.ALL, h5s.ALL, arr, mtype=want)
        return arr


def _describe(dtype: np.dtype) -> str:
    if dtype.names:
        return "{" + ", ".join(f"{n}: {dtype.fields[n][0]}" for n in dtype.names) + "}"
    return str(dtype)
