"""hpcrl.fs.atomic.rename_noreplace: one renameat2 where the filesystem has it, the portable way elsewhere."""

from __future__ import annotations

import ctypes
import errno
from pathlib import Path

import pytest

import hpcrl.fs.atomic as atomic


def _paths(tmp_path: Path) -> tuple[Path, Path]:
    src, dst = tmp_path / "a", tmp_path / "b"
    src.write_text("moved")
    return src, dst


def _unsupported(*args) -> int:  # a filesystem without RENAME_NOREPLACE (NFS) says EINVAL
    ctypes.set_errno(errno.EINVAL)
    return -1


@pytest.mark.parametrize("way", ["native", "portable", "unsupported"])
def test_rename_noreplace_moves_refuses_an_existing_target_and_tells_a_vanished_source(tmp_path: Path, monkeypatch,
                                                                                      way: str) -> None:
    if way == "native" and atomic._renameat2 is None:
        pytest.skip("no renameat2 here")
    if way != "native":
        monkeypatch.setattr(atomic, "_renameat2", None if way == "portable" else _unsupported)
    src, dst = _paths(tmp_path)
    atomic.rename_noreplace(src, dst)
    assert dst.read_text() == "moved" and not src.exists()
    if way == "unsupported":
        assert atomic._renameat2 is None, "falls back for the rest of the process"
    src.write_text("second")
    with pytest.raises(FileExistsError):
        atomic.rename_noreplace(src, dst)
    assert (src.read_text(), dst.read_text()) == ("second", "moved"), "nothing overwritten"
    src.unlink()
    with pytest.raises(FileNotFoundError, match="vanished"):  # moved already, e.g. by a concurrent claimer
        atomic.rename_noreplace(src, dst)
    with pytest.raises(FileNotFoundError, match="(?i)no such file"):
        atomic.rename_noreplace(src, tmp_path / "c")
    src.write_text("third")
    with pytest.raises(FileNotFoundError, match="(?i)no directory|no such file"):
        atomic.rename_noreplace(src, tmp_path / "missing" / "c")


def test_rename_noreplace_passes_other_errors_on(tmp_path: Path) -> None:
    if atomic._renameat2 is None:
        pytest.skip("no renameat2 here")
    src, _ = _paths(tmp_path)
    (tmp_path / "d").mkdir()
    with pytest.raises(OSError) as info:
        atomic.rename_noreplace(tmp_path / "d", tmp_path / "d" / "inside")  # a directory into itself
    assert info.value.errno == errno.EINVAL and atomic._renameat2 is not None
