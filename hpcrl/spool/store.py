"""The spool directory: where rollouts publish groups and the trainer takes them.

Layout under ``root`` (``<run_dir>/spool``)::

    tmp/                    files being written (``<name>.tmp.<instance>.<pid>``); never read
    ready/                  published, waiting for a trainer
    claimed/                taken by the trainer, not yet committed by a checkpoint
    trained/step_XXXXXX/    trained at that optimizer step (committed)
    dropped/                not trained on purpose; ``<name>.reason.json`` beside it
    quarantine/             failed validation; ``<name>.reason.json`` beside it
    taken                   the version whose batch the trainer has in hand (:mod:`hpcrl.spool.taken`)

Life cycle of one file: a rollout writes it in ``tmp/``, fsyncs it and
renames it into ``ready/`` (``publish``), so a reader of ``ready/`` only ever
sees complete files. The trainer selects from ``ready/`` by name only (the
version range is in the name), takes files by renaming them into
``claimed/`` (``claim``; a file that vanished is skipped), loads them
(``load``; an invalid file goes to ``quarantine/`` and ``None`` is returned),
and after the step moves them to ``trained/step_N/`` (``mark_trained``: one
rename of ``claimed/`` itself when it holds just them) or to
``dropped/`` with a reason (``drop``). On resume, files still in ``claimed/``
that the checkpoint does not cover go back to ``ready/`` (``release_claimed``).

Durability: a publish is fsynced at once (data, then the directory entry):
it is the rollout's hand-over. The trainer's moves are renames whose
directories :meth:`Spool.sync` fsyncs before the trainer commits a
checkpoint (design.md §3.5), so its per-step cost is renames only. That is
enough because resume puts every file that is claimed, or trained after the
checkpoint it restores, back in ``ready/``: a claim or commit that a crash
of the machine undid changes nothing resume would keep. A move aside (its
reason file's content is fsynced before the move) that a crash undid leaves
the file where it was, and the trainer's next look sets it aside again, or
quarantines it when the ledger already records its ticket's outcome
(:class:`~hpcrl.trainer.feed.BatchFeed`); the ledger's records are durable
on their own.

Ordering rules: every move is one ``rename`` on the same filesystem, hence
atomic (``renameat2`` with ``RENAME_NOREPLACE`` where the filesystem has it,
:func:`hpcrl.fs.atomic.rename_noreplace`); a reason file is written (atomically) *before* its data file is moved,
so a dropped or quarantined file always has its reason. Moves never overwrite:
into ready/, claimed/ or trained/ a name collision means a ticket was produced
twice, which is a bug, and raises ``FileExistsError``; in dropped/ and
quarantine/ a ticket regenerated and set aside again under the same name goes
to ``again-<k>/`` beside the first. Each destination directory has a single owner (rollouts
own ``ready/`` names by ticket and writer id, the trainer owns the rest), which
is what makes the check-then-rename free of races. No ``flock`` anywhere.

Fencing: every move and every publish first checks the ownership fence
(:class:`hpcrl.runtime.owner.Fence`; a publish checks it after the data is
written and before the rename that makes it visible), so a component of a
replaced owner changes nothing here. Retention: :meth:`Spool.clean_tmp`
removes temporaries of dead writers; :meth:`Spool.prune_set_aside` deletes
the data of old dropped files and keeps their reason records.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hpcrl.fs.atomic import TMP_MARK, fsync_dir, read_json, rename_noreplace, temporary_name, write_json
from hpcrl.runtime.owner import Fence, NoFence
from hpcrl.spool.format import (
    SpoolFormatError,
    TrajectoryGroup,
    encode_group,
    encode_group_read,
    file_name,
    parse_name,
    read_group,
)

logger = logging.getLogger(__name__)

_STEP_RE = re.compile(r"^step_(\d{6,})$")
REASON_SUFFIX = ".reason.json"


@dataclass(frozen=True)
class SpoolEntry:
    """A spool file known by its name (no file opened to build it)."""

    path: Path  # current location of the file
    ticket: int  # admission ticket id
    min_version: int  # oldest policy version of any token
    max_version: int  # newest policy version of any token
    writer: str  # rollout writer id

    @property
    def name(self) -> str:
        return self.path.name


def _rename_noreplace(src: Path, dst: Path) -> None:
    """A rename that refuses to overwrite (FileNotFoundError if ``src`` is gone; :func:`atomic.rename_noreplace`)."""
    try:
        rename_noreplace(src, dst)
    except FileExistsError as e:
        raise FileExistsError(f"spool name collision: {dst} already exists (moving {src})") from e


class Spool:
    """<root>/ready, claimed, trained/step_XXXXXX, dropped, quarantine, tmp."""

    def __init__(self, root: Path, fence: Fence | NoFence | None = None) -> None:
        self.root = Path(root)
        self.fence = fence or NoFence()
        self.tmp_dir = self.root / "tmp"
        self.ready_dir = self.root / "ready"
        self.claimed_dir = self.root / "claimed"
        self.trained_dir = self.root / "trained"
        self.dropped_dir = self.root / "dropped"
        self.quarantine_dir = self.root / "quarantine"
        for d in (self.tmp_dir, self.ready_dir, self.claimed_dir, self.trained_dir,
                  self.dropped_dir, self.quarantine_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._dropped_data: list[Path] | None = None  # dropped/ files with data, oldest first (prune_set_aside)
        self._unsynced: set[Path] = set()  # directories with claims or commits not yet made durable (sync)
        self._ready_known: dict[str, SpoolEntry] = {}  # the last listing of ready/, by name (ready)
        self._ready_names: list[str] | None = None  # ... its names as listed, and its entries sorted
        self._ready_sorted: list[SpoolEntry] = []
        # a reader in this process (colocated mode's read-ahead): handed each file's final path, its identity (the
        # written file's stat, which the rename keeps) and the group ``read_group`` would return from it, before
        # the rename makes it visible, so that nothing parses what this process writes (publish)
        self.on_publish: Callable[[Path, os.stat_result, TrajectoryGroup], None] | None = None

    # -- rollout side -----------------------------------------------------
    def publish(self, group: TrajectoryGroup) -> Path:
        """Write ``group`` in tmp/, fsync, rename into ready/; return the final path.

        The file is built in memory first (``encode_group``: an invalid group
        raises before anything touches the filesystem), then written with one
        write and fsynced through the same descriptor. With ``on_publish`` set,
        it is handed the group as read back (``encode_group_read``) just before
        the rename.
        """
        name = file_name(group)
        data, view = encode_group_read(group) if self.on_publish is not None else (encode_group(group), None)
        final = self.ready_dir / name
        tmp = temporary_name(self.tmp_dir / name)
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
                written = os.fstat(f.fileno())
            self.fence.check("spool publish")
            if view is not None:
                self._offer(final, written, view)
            _rename_noreplace(tmp, final)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.ready_dir)
        logger.debug("published %s", name)
        return final

    def _offer(self, final: Path, written: os.stat_result, view: TrajectoryGroup) -> None:
        """Hand ``view`` to ``on_publish``; its failure costs only the saved parse, never the publish. (If the
        rename then fails, the offer names a file that is not this one and is never matched.)"""
        try:
            if self.on_publish is not None:
                self.on_publish(final, written, view)
        except Exception:
            logger.exception("handing %s to this process's reader failed; it will read the file", final.name)

    def clean_tmp(self, older_than_s: float = 3600.0) -> int:
        """Remove temporary files left by crashed writers (spool/tmp/ and the reason temporaries in
        dropped/ and quarantine/) older than ``older_than_s`` (0: all; only when no writer runs);
        returns how many."""
        now = time.time()
        removed = 0
        candidates = list(self.tmp_dir.iterdir())
        for d in (self.dropped_dir, self.quarantine_dir):
            candidates += [p for p in d.rglob(f"*{TMP_MARK}*") if p.is_file()]
        for p in candidates:
            try:
                if now - p.stat().st_mtime >= older_than_s:
                    p.unlink()
                    removed += 1
            except FileNotFoundError:
                continue
        return removed

    def prune_set_aside(self, keep: int) -> int:
        """Delete the data of all but the ``keep`` most recently dropped files in dropped/ (their reason records
        stay: ticket, writer, why); returns how many were deleted. The first call lists dropped/ (oldest first
        by modification time); later ones follow the drops this process made, so a call costs what was dropped
        since the last one, not the run's length."""
        self.fence.check("spool pruning")
        if self._dropped_data is None:
            files = [p for p in self.dropped_dir.rglob("*.h5") if parse_name(p.name) is not None]
            self._dropped_data = sorted(files, key=lambda p: p.stat().st_mtime)
        files = self._dropped_data
        if len(files) <= keep:
            return 0
        old, self._dropped_data = files[: len(files) - keep], files[len(files) - keep:]
        for p in old:
            p.unlink(missing_ok=True)
        return len(old)

    # -- listing ------------------------------------------------------------
    @staticmethod
    def _list(directory: Path, known: dict[str, SpoolEntry] | None = None) -> list[SpoolEntry]:
        """The spool files in ``directory``, sorted by (min_version, ticket, writer). ``known``: the entries of the
        last listing of the same directory by name, reused (an entry follows from its name alone), and replaced by
        this listing's."""
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return []
        return Spool._entries(directory, names, known)

    @staticmethod
    def _entries(directory: Path, names: list[str], known: dict[str, SpoolEntry] | None) -> list[SpoolEntry]:
        seen, listed = known or {}, {}
        for name in names:
            entry = seen.get(name)
            if entry is None:
                info = parse_name(name)
                if info is None:
                    continue
                entry = SpoolEntry(directory / name, info.ticket, info.min_version, info.max_version, info.writer)
            listed[name] = entry
        if known is not None:
            known.clear()
            known.update(listed)
        return sorted(listed.values(), key=lambda e: (e.min_version, e.ticket, e.writer))

    def ready(self) -> list[SpoolEntry]:
        """Published files, from names only, sorted by (min_version, ticket). The trainer lists ready/ on every
        look while it waits: entries of names listed before are reused, and a listing with the names of the last
        one, in the same order, returns its sorted entries again; so a look costs the listing and what arrived."""
        try:
            names = os.listdir(self.ready_dir)
        except FileNotFoundError:
            return []
        if names != self._ready_names:
            self._ready_names, self._ready_sorted = names, self._entries(self.ready_dir, names, self._ready_known)
        return list(self._ready_sorted)

    def claimed(self) -> list[SpoolEntry]:
        """Files the trainer has claimed and not yet committed or released."""
        return self._list(self.claimed_dir)

    def trained(self) -> dict[int, list[SpoolEntry]]:
        """Trained files by optimizer step."""
        out: dict[int, list[SpoolEntry]] = {}
        for d in self.trained_dir.iterdir():
            m = _STEP_RE.match(d.name)
            if m and d.is_dir():
                out[int(m.group(1))] = self._list(d)
        return dict(sorted(out.items()))

    def dropped(self) -> list[SpoolEntry]:
        return self._list(self.dropped_dir)

    def quarantined(self) -> list[SpoolEntry]:
        return self._list(self.quarantine_dir)

    def live_tickets(self) -> set[int]:
        """Tickets with a file on the way to training (ready, claimed or trained).

        Listed in the direction files move (ready -> claimed -> trained), so a
        file moving during the scan is seen at least once.
        """
        out: set[int] = set()
        for directory in (self.ready_dir, self.claimed_dir):
            out |= {e.ticket for e in self._list(directory)}
        for entries in self.trained().values():
            out |= {e.ticket for e in entries}
        return out

    def counts(self) -> dict[str, int]:
        """File counts: ready, claimed, trained, dropped, quarantined."""
        return {
            "ready": len(self.ready()),
            "claimed": len(self.claimed()),
            "trained": sum(len(v) for v in self.trained().values()),
            "dropped": len(self.dropped()),
            "quarantined": len(self.quarantined()),
        }

    # -- trainer side -------------------------------------------------------
    def claim(self, entries: list[SpoolEntry]) -> list[SpoolEntry]:
        """Rename ``entries`` into claimed/; skip those that vanished. Returns the claimed. Not fsynced: a claim
        that a crash undid leaves the file in ready/, where resume would have put it (:meth:`sync`)."""
        self.fence.check("spool claim")
        taken = []
        for e in entries:
            dst = self.claimed_dir / e.name
            try:
                _rename_noreplace(e.path, dst)
            except FileNotFoundError:
                logger.info("spool file %s vanished before claim; skipped", e.name)
                continue
            taken.append(SpoolEntry(dst, e.ticket, e.min_version, e.max_version, e.writer))
        if taken:
            self._unsynced |= {self.claimed_dir, self.ready_dir}
        return taken

    def load(self, entry: SpoolEntry,
             read: Callable[[Path], TrajectoryGroup] = read_group) -> TrajectoryGroup | None:
        """Read (with ``read``: ``read_group`` or a read-ahead's) and validate ``entry``; quarantine it and return
        None if it is invalid."""
        try:
            group = read(entry.path)
            got = (group.ticket, *group.version_range(), group.writer)
            want = (entry.ticket, entry.min_version, entry.max_version, entry.writer)
            if got != want:
                raise SpoolFormatError(
                    f"file name says (ticket, min_version, max_version, writer)={want}, content says {got}"
                )
            return group
        except FileNotFoundError:
            logger.error("spool file %s vanished before load; not quarantined", entry.path)
            return None
        except (SpoolFormatError, OSError) as e:
            reason = f"{type(e).__name__}: {e}"
            logger.warning("quarantining spool file %s: %s", entry.name, reason)
            self.quarantine(entry, reason)
            return None

    def mark_trained(self, entries: list[SpoolEntry], step: int) -> None:
        """Move ``entries`` into trained/step_{step:06d}/ (idempotent for already moved files). Durable after the
        next :meth:`sync`: resume releases what is trained after its checkpoint, so only a checkpoint needs it.

        When claimed/ holds exactly ``entries`` and the step has no folder yet (every step of a running trainer),
        claimed/ itself becomes the step's folder: one rename of the directory and a new claimed/, instead of a
        rename per file. Otherwise each file is moved."""
        self.fence.check("spool commit")
        d = self.trained_dir / f"step_{step:06d}"
        if entries and self._commit_folder(entries, d):
            return
        d.mkdir(exist_ok=True)
        for e in entries:
            dst = d / e.name
            try:
                _rename_noreplace(e.path, dst)
            except FileNotFoundError:
                if not dst.exists():
                    raise
                # already moved by an earlier, interrupted call
        self._unsynced |= {d, self.claimed_dir, self.trained_dir}  # the step folder's own entry too, made or found

    def _commit_folder(self, entries: list[SpoolEntry], step_dir: Path) -> bool:
        """Rename claimed/ to ``step_dir`` if it holds exactly the names of ``entries`` (one listing; names are unique
        across the spool) and ``step_dir`` does not exist; True if it did, False (nothing moved) otherwise. Only
        this trainer claims: the fence, checked again just before the rename, keeps a newer owner's claims out
        of it but for that syscall's own window. The files' names in the renamed folder are durable when
        :meth:`sync` fsyncs ``step_dir`` (the directory they were claimed into); the spool root's and trained/'s
        entries are synced with it."""
        try:
            if sorted(os.listdir(self.claimed_dir)) != sorted(e.name for e in entries):
                return False
            self.fence.check("spool commit")
            rename_noreplace(self.claimed_dir, step_dir)
        except OSError:  # gone, taken, or a filesystem that will not move the folder: file by file
            return False
        self.claimed_dir.mkdir(exist_ok=True)
        self._unsynced |= {step_dir, self.claimed_dir, self.trained_dir, self.root}
        return True

    def sync(self) -> int:
        """Make every move since the last sync durable (one fsync per directory the claims, commits and moves
        aside touched, sub-folders before their parent); the trainer calls it before it commits a checkpoint, the
        run's finalizer at its end. Returns the count of directories."""
        dirs = sorted(self._unsynced, key=lambda d: (-len(d.parts), str(d)))
        for d in dirs:
            fsync_dir(d)
        self._unsynced.clear()
        return len(dirs)

    def drop(self, entry: SpoolEntry, reason: str) -> None:
        """Move ``entry`` into dropped/ with dropped/<name>.reason.json."""
        self._set_aside(entry, self.dropped_dir, reason)

    def quarantine(self, entry: SpoolEntry, reason: str) -> None:
        """Move ``entry`` into quarantine/ with quarantine/<name>.reason.json."""
        self._set_aside(entry, self.quarantine_dir, reason)

    def reason(self, entry: SpoolEntry) -> dict | None:
        """The reason record of a dropped or quarantined entry (None if there is none)."""
        p = entry.path.with_name(entry.name + REASON_SUFFIX)
        return read_json(p) if p.exists() else None

    def _set_aside(self, entry: SpoolEntry, directory: Path, reason: str) -> None:
        """Move ``entry`` aside with its reason (durable at the next :meth:`sync`). A second file of the same name
        (a ticket regenerated and set aside again, e.g. across trainer restarts) goes to ``again-<k>/``: nothing is
        overwritten."""
        self.fence.check(f"spool move to {directory.name}/")
        dst, k = directory / entry.name, 0
        while dst.exists() or dst.with_name(dst.name + REASON_SUFFIX).exists():  # data pruned, reason kept
            k += 1
            (directory / f"again-{k}").mkdir(exist_ok=True)
            self._unsynced.add(directory)  # the again-<k>/ folder's own entry
            dst = directory / f"again-{k}" / entry.name
        record = {"reason": reason, "time": time.time(), "from": entry.path.parent.name,
                  "ticket": entry.ticket, "writer": entry.writer}
        write_json(dst.parent / (entry.name + REASON_SUFFIX), record, sync_dir=False)  # content durable now
        _rename_noreplace(entry.path, dst)
        self._unsynced |= {dst.parent, entry.path.parent}  # both names durable at the next sync
        if directory == self.dropped_dir and self._dropped_data is not None:
            self._dropped_data.append(dst)  # followed for prune_set_aside

    def release(self, entries: list[SpoolEntry]) -> int:
        """Move the given claimed ``entries`` back to ready/; returns the count moved."""
        self.fence.check("spool release")
        for e in entries:
            _rename_noreplace(e.path, self.ready_dir / e.name)
        if entries:
            fsync_dir(self.ready_dir)
            fsync_dir(self.claimed_dir)
            logger.info("released %d claimed spool files back to ready/", len(entries))
        return len(entries)

    def release_claimed(self) -> int:
        """Move every file in claimed/ back to ready/ (resume); returns the count."""
        return self.release(self.claimed())
