"""How much room a run takes, and how much its filesystem has left: the ``storage`` part of ``python -m hpcrl
status`` (:mod:`hpcrl.launch.control`). Read-only; one walk of the run directory per call, so it costs what
listing the spool costs (about a second per 100,000 files)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from hpcrl.fs.faults import filesystem, human_bytes
from hpcrl.launch.leftovers import temporaries

AREAS = ("spool", "weights", "ckpt", "logs", "admission", "eval")


def _size(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (allocated blocks: a 100-byte ledger record takes a whole
    block; files that vanish while walking are skipped)."""
    total, todo = 0, [path]
    while todo:
        try:
            entries = list(os.scandir(todo.pop()))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    todo.append(Path(e.path))
                else:
                    total += e.stat(follow_symlinks=False).st_blocks * 512  # what a quota counts
            except FileNotFoundError:
                continue
    return total


def footprint(run_dir: Path) -> dict[str, int]:
    """Bytes by area of the run directory (``other``: everything else, the configs and records)."""
    sizes = {a: _size(run_dir / a) for a in AREAS}
    sizes["other"] = max(0, _size(run_dir) - sum(sizes.values()))
    return sizes


def storage_status(run_dir: Path, min_free_gb: float) -> dict:
    fs = filesystem(run_dir)
    return {"filesystem": asdict(fs) if fs else None, "footprint": footprint(run_dir),
            "temporaries": len(temporaries(run_dir)), "min_free_bytes": int(min_free_gb * 1e9)}


def format_storage(st: dict) -> str:
    fs, sizes = st["filesystem"], st["footprint"]
    where = "filesystem: statvfs does not answer" if fs is None else (
        f"filesystem {fs['mount']}: {human_bytes(fs['free_bytes'])} free of {human_bytes(fs['total_bytes'])}"
        f", {fs['free_inodes']:,} inodes free"
        + ("  BELOW launch.min_free_gb: no new prompt group starts, periodic checkpoints and components stopped by "
           "a storage fault wait"
           if fs["free_bytes"] < st["min_free_bytes"] else ""))
    parts = ", ".join(f"{a} {human_bytes(n)}" for a, n in sizes.items() if n)
    return f"{where}\nrun footprint {human_bytes(sum(sizes.values()))}: {parts}" + \
        (f"; {st['temporaries']} temporaries" if st["temporaries"] else "")
