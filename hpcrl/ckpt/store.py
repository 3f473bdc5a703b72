"""The checkpoint directory: atomic commit, verification, retention.

Layout: ``<run_dir>/ckpt/step_<N>/`` holds a torch.distributed.checkpoint
(DCP) save of the sharded model and optimizer state (``*.distcp`` and
``.metadata``), ``rng-r<rank>.json`` per rank, ``trainer.json`` (version,
LR-scheduler state, counters) and ``manifest.json`` (size and sha256 of every
file), and last the ``COMMITTED`` marker.

Ordering rules: every rank writes into ``step_<N>.tmp/``; after a barrier
rank 0 writes the manifest and ``COMMITTED`` and renames the directory to
``step_<N>`` — one atomic rename, so a reader never sees half a checkpoint.
A directory without ``COMMITTED``, or whose files do not match the
manifest, is skipped by :func:`latest_valid` with a warning, and the previous
committed checkpoint is used.

Rewind (``python -m hpcrl.submit --resume <run_dir>/ckpt/step_N --rewind``):
:func:`request_rewind` leaves ``REWIND.json`` naming step N; the trainer's
rank 0 carries it out with :func:`apply_rewind` before it restores, so no
trainer of an earlier owner can race it: every committed checkpoint after N
(and any temporary) moves to ``rewound/<time>/``, N becomes the newest, and
the trainer's reconcile returns the groups trained after N to the queue.
Nothing is deleted: the set-aside checkpoints stay there until removed by
hand. Applying a request twice is the same as once.
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import time
from pathlib import Path

from hpcrl.fs import atomic

log = logging.getLogger(__name__)
STEP_RE = re.compile(r"^step_(\d{6,})$")
COMMITTED = "COMMITTED"
MANIFEST = "manifest.json"
REWIND = "REWIND.json"
REWOUND = "rewound"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used (missing, uncommitted, corrupt)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def committed(root: Path) -> list[tuple[int, Path]]:
    """Committed checkpoint directories, oldest first."""
    out = []
    for p in root.glob("step_*") if root.exists() else []:
        m = STEP_RE.match(p.name)
        if m and (p / COMMITTED).exists():
            out.append((int(m.group(1)), p))
    return sorted(out)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> None:
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p.name not in (MANIFEST, COMMITTED)}
    atomic.write_json(directory / MANIFEST, files)


def verify(directory: Path, full: bool = True) -> list[str]:
    """Problems found in a checkpoint directory (empty list = intact)."""
    if not (directory / COMMITTED).exists():
        return [f"{directory}: no {COMMITTED} marker (interrupted save)"]
    try:
        manifest = atomic.read_json(directory / MANIFEST)
    except (OSError, ValueError) as e:
        return [f"{directory}: unreadable {MANIFEST}: {e}"]
    problems = []
    for name, rec in manifest.items():
        p = directory / name
        if not p.exists():
            problems.append(f"{name}: missing")
        elif p.stat().st_size != rec["bytes"]:
            problems.append(f"{name}: {p.stat().st_size} bytes, manifest says {rec['bytes']} (truncated?)")
        elif full and _sha256(p) != rec["sha256"]:
            problems.append(f"{name}: checksum mismatch")
    return problems


def latest_valid(root: Path) -> tuple[int, Path] | None:
    """The newest committed checkpoint that verifies; corrupt ones are skipped with a warning."""
    for step, path in reversed(committed(root)):
        problems = verify(path)
        if not problems:
            return step, path
        log.warning("skipping checkpoint %s: %s", path, "; ".join(problems[:3]))
    return None


def commit(tmp: Path, final: Path) -> None:
    """Rank 0, after every rank wrote into ``tmp``: manifest, marker, atomic rename."""
    write_manifest(tmp)
    atomic.write_text(tmp / COMMITTED, "ok\n")
    atomic.fsync_dir(tmp)
    if final.exists():  # an earlier save of the same step that was never committed, or a re-save
        shutil.rmtree(final)
    tmp.rename(final)
    atomic.fsync_dir(final.parent)


def prune(root: Path, keep_last: int, keep_every: int = 0, full_check: bool = False) -> list[Path]:
    """Delete committed checkpoints beyond the retention policy and stale temporaries; returns what went.

    The newest checkpoint that verifies is always kept, whatever the policy, so a run is never left with
    only damaged checkpoints to resume from. The check compares sizes with the manifest
    (``full_check``: checksums too, which reads every byte; the trainer's own pruning skips that)."""
    items = committed(root)
    keep = {s for s, _ in items[-keep_last:]} if keep_last > 0 else set()
    keep |= {next((s for s, p in reversed(items) if not verify(p, full=full_check)), -1)}
    if keep_every:
        keep |= {s for s, _ in items if s % keep_every == 0}
    removed = [p for s, p in items if s not in keep]
    removed += [p for p in root.glob("step_*.tmp*")] if items else []
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


def request_rewind(root: Path, step: int, reason: str) -> list[int]:
    """Ask the next trainer to resume from ``step`` although newer checkpoints exist; the steps it sets aside."""
    newer = [s for s, _ in committed(root) if s > step]
    atomic.write_json(root / REWIND, {"step": step, "reason": reason, "set_aside": newer})
    return newer


def apply_rewind(root: Path) -> tuple[int, list[Path]] | None:
    """Carry out a pending :func:`request_rewind`: (its step, where the newer checkpoints went), or None.

    Raises CheckpointError if the checkpoint to rewind to no longer verifies."""
    if not (root / REWIND).exists():
        return None
    step = int(atomic.read_json(root / REWIND)["step"])
    target = step_dir(root, step)
    problems = verify(target, full=False)
    if problems:
        raise CheckpointError(f"cannot rewind to {target}: {'; '.join(problems[:3])} (remove {root / REWIND} to "
                              "resume from the newest checkpoint instead)")
    aside = root / REWOUND / time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for p in [p for s, p in committed(root) if s > step] + sorted(root.glob("step_*.tmp*")):
        aside.mkdir(parents=True, exist_ok=True)
        p.rename(aside / p.name)
        moved.append(aside / p.name)
    atomic.fsync_dir(root)
    (root / REWIND).unlink()
    return step, moved
