"""Read-ahead: the trainer's spool files parsed in a background thread while it trains.

Reading a small spool file costs ~0.3 ms, nearly all of it HDF5 and Python
(``scripts/bench_fs.py``, ``bench_async.py``); a batch of B files read when
the step starts is time the accelerator waits. ``ReadAhead`` reads the files
of the next batch during the current step instead, without taking them:

* Lifecycle: the trainer's :class:`~hpcrl.trainer.feed.BatchFeed` (rank 0)
  owns one, calls :meth:`kick` once the trainer has resumed (the first
  batch is read during its start-up), whenever a step starts training and
  while its batch waits for groups, and :meth:`hold` when a pass is about
  to claim the files that complete the batch (it asks :meth:`has` before
  it claims a file while the batch cannot complete yet). Between the two the worker
  thread (a daemon, started on the first kick) lists ``ready/`` every
  ``relist_s`` and parses the files it has not parsed yet, in the order the
  trainer takes them (head version, then ticket), at most ``limit`` kept at
  once; held, it sleeps. While the batch waits, each of the feed's looks
  ends with a kick naming the files it listed and the worker has not
  parsed: the worker parses those at once, without a listing of its own
  (the feed looks every 10 ms, the worker every ``relist_s``; before, the
  files that arrived since the worker's last look were read by the pass
  that completed the batch). :meth:`close` stops it (the trainer's exit).
* It moves, claims and quarantines nothing, and writes nothing: what the
  trainer decides (which files, against which version, what is stale or
  invalid) is decided at claim time exactly as without it. A file it cannot
  parse is simply not kept; the trainer's own read then finds the fault and
  quarantines the file with its reason.
* In colocated mode the files are written by the same process, which hands
  each group to :meth:`offer` just before the rename that publishes it
  (``Spool.on_publish``, with the group exactly as ``read_group`` returns it
  and validated the same way: ``encode_group_read``); neither the worker
  nor the claim parses those files, up to ``limit`` kept at once.
* :meth:`read` (the trainer's read of a claimed file) returns the parsed
  group only if the file at that path is the very file that was parsed:
  same device, inode, size and modification time (a claim is a rename, which
  keeps them), taken before and again after the parse, so a file that changed
  hands while it was read is not kept. Anything else, or a file not parsed
  yet, is read there and then, as before. A spool file is immutable once
  published (written to ``tmp/``, closed, renamed), so its identity stands
  for its content.

Costs: a ``stat`` of ``ready/`` every ``relist_s`` while a step trains or
the batch waits, a
listing only when its modification time changed since a pass that parsed
everything it listed and began over two seconds after that modification
(timestamps can be coarse; a file that arrived unseen by the timestamp
is parsed once the feed's look names it), and
two ``stat`` per file read ahead, on the shared filesystem's metadata
server, and one ``stat`` per claimed file in the step (the open and the
read move from the step to the worker; on Lustre a stat also asks the
object servers for the size, so what a hit saves is mostly the parse). The
worker holds the GIL while it parses (h5py does not release it), so on a
CPU-only trainer it competes with the training loop's Python; on an
accelerator the loop mostly waits on the device and the reads overlap.
``busy_s``, ``hits`` and ``misses`` say what it did (the trainer reports
them per step). While a disaggregated trainer waits for groups its loop
does nothing else, so what the worker parses then costs the loop nothing;
in colocated mode the wait is generation in the same process, which the
parsing competes with for the GIL.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, NamedTuple

from hpcrl.spool.format import TrajectoryGroup, parse_name, read_group

log = logging.getLogger(__name__)

# a listing that began less than this after the directory's modification time may have missed a file that arrived
# within the same timestamp tick (1 s on some filesystems), plus a margin for a file server's clock: such a pass
# never lets the next one skip the listing, as git treats a "racily clean" index entry
_RACY_NS = 2_000_000_000


def _spool_files(names: list[str]) -> dict[str, tuple[int, int]]:
    """The spool files among ``names``, each with its place in the trainer's order (head version, then ticket)."""
    out = {}
    for name in names:
        info = parse_name(name)
        if info is not None:
            out[name] = (info.min_version, info.ticket)
    return out


class _Identity(NamedTuple):
    dev: int
    ino: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> _Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class ReadAhead:
    """Parse ``ready/`` files ahead of their claim; hand the parsed group over when the same file is read."""

    def __init__(self, ready_dir: Path, limit: int, reader: Callable[[Path], TrajectoryGroup] = read_group,
                 relist_s: float = 0.05) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self.ready_dir, self.limit, self.relist_s, self._reader = Path(ready_dir), limit, relist_s, reader
        self._parsed: dict[str, tuple[_Identity, TrajectoryGroup]] = {}  # file name -> (identity, group)
        self._failed: set[str] = set()  # names that did not parse: left to the claim, not parsed again
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._active = self._stop = False
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # the worker's time listing and parsing
        self.hits = self.misses = 0  # reads served from the worker's parse / read there and then
        self.offered = 0  # groups kept from their writer in this process (offer), never parsed
        self.passes = 0  # passes the worker finished (listings, looks that skipped one, named files)
        self.skipped = 0  # looks at ready/ that found its modification time unchanged: no listing
        self._listed_mtime: int | None = None  # ready/'s mtime at the last pass that left nothing to parse
        self._wanted: list[str] = []  # names the feed listed and waits on (kick): the next pass parses them

    def __len__(self) -> int:
        """How many parsed groups wait for their file's read."""
        with self._lock:
            return len(self._parsed)

    def kick(self, wanted: list[str] | None = None) -> None:
        """A step starts training, or the batch waits: read ahead (in the background; returns at once) until
        :meth:`hold`. ``wanted``: ``ready/`` files the feed has listed (oldest first) and waits on, not parsed yet:
        parsed now, without a listing of the worker's own (its next look may be ``relist_s`` away, and a file that
        arrived within ``ready/``'s timestamp tick would be unseen by it); a later kick's names replace them."""
        with self._cond:
            self._wanted = list(wanted or ())
            if not self._active or wanted:
                self._active = True
                self._cond.notify()  # active, it looks again every relist_s by itself
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="spool-read-ahead", daemon=True)
            self._thread.start()

    def hold(self) -> None:
        """The trainer takes its batch: stop reading ahead (the file being parsed is finished)."""
        with self._cond:
            self._active, self._wanted = False, []

    def has(self, name: str) -> bool:
        """Whether the file ``name`` has been through the worker: parsed (its read is a hand-over if the file is
        the same) or found unparsable (the read finds the fault again)."""
        with self._lock:
            return name in self._parsed or name in self._failed

    def offer(self, path: Path, written: os.stat_result, group: TrajectoryGroup) -> None:
        """``group`` is what ``read_group(path)`` will return, from the process about to publish ``path``
        (colocated mode: ``Spool.on_publish``, before the rename that makes the file visible; ``written``: the
        written file's stat, which the rename keeps): kept as if the worker had parsed it, so neither the worker
        nor the claim parses it. Not kept when ``limit`` parses wait already (the worker reads it later) or after
        :meth:`close`."""
        with self._lock:
            if not self._stop and len(self._parsed) < self.limit:
                self._parsed[Path(path).name] = (_Identity.of(written), group)
                self.offered += 1

    def read(self, path: Path) -> TrajectoryGroup:
        """The group in ``path``: the worker's parse if it is the same file, else read now."""
        with self._lock:
            kept = self._parsed.pop(Path(path).name, None)
        if kept is not None:
            try:
                same = _Identity.of(os.stat(path)) == kept[0]
            except OSError:
                same = False
            if same:
                self.hits += 1
                return kept[1]
        self.misses += 1
        return self._reader(Path(path))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the worker: wait up to ``timeout_s`` for the file it is parsing (a daemon: it cannot block exit)."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        with self._lock:
            self._parsed.clear()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._active and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
            t0 = time.perf_counter()
            try:
                self._pass()
            except Exception:  # never let the worker die: the trainer reads for itself meanwhile
                log.exception("spool read-ahead pass failed; the trainer reads the files itself")
            self.busy_s += time.perf_counter() - t0
            self.passes += 1
            with self._cond:
                if self._active and not self._stop and not self._wanted:  # names given meanwhile: at once
                    self._cond.wait(self.relist_s)  # files published during the step: list again

    def _pass(self) -> None:
        if not self._active:
            return
        with self._lock:
            wanted, self._wanted = self._wanted, []
        if wanted:  # the feed's listing: no look of our own, unless room must be made (a listing finds what to drop)
            order = _spool_files(wanted)
            with self._lock:
                todo = sorted((n for n in order if n not in self._parsed and n not in self._failed), key=order.get)
                room = len(self._parsed) + len(todo) <= self.limit
            if room:
                self._parse(todo, None)  # nothing learnt about the rest of ready/: the next look lists it
                return
            self._listed_mtime = None  # named files it has not listed: list ready/ whatever its timestamp says
        try:
            mtime = os.stat(self.ready_dir).st_mtime_ns
            if mtime == self._listed_mtime:
                self.skipped += 1  # nothing entered or left ready/ since a pass that parsed all it listed
                return
            self._listed_mtime, listed_at = None, time.time_ns()
            names = os.listdir(self.ready_dir)
        except FileNotFoundError:
            return
        listed = _spool_files(names)
        with self._lock:
            todo = sorted((n for n in listed if n not in self._parsed and n not in self._failed), key=listed.get)
            if len(self._parsed) + len(todo) > self.limit:
                # room needed: a kept parse whose file left ready/ otherwise than by a claim that reads it (set
                # aside, released) is never asked for. Only when room is needed, because a file the trainer has
                # just claimed has left ready/ too and is about to be asked for.
                for name in [n for n in self._parsed if n not in listed]:
                    del self._parsed[name]
            self._failed &= listed.keys()
            room = self.limit - len(self._parsed)
        # the listing shows the directory as of ``mtime`` only if it began well after ``mtime``: with coarse
        # timestamps a file arriving in the same tick leaves ``mtime`` unchanged (git's "racily clean" rule)
        complete = mtime if len(todo) <= room and listed_at - mtime > _RACY_NS else None
        self._listed_mtime = self._parse(todo[:max(room, 0)], complete)

    def _parse(self, todo: list[str], complete: int | None) -> int | None:
        """Parse the files ``todo`` (in order, while the trainer does not take its batch and room is left);
        returns ``complete``, or None if a file changed hands while it was parsed or the pass was cut short."""
        for name in todo:
            if len(self) >= self.limit:
                return None
            if self._stop or not self._active:  # the trainer is taking its batch: out of its way
                return None
            path = self.ready_dir / name
            try:
                before = _Identity.of(os.stat(path))
                group = self._reader(path)
                after = _Identity.of(os.stat(path))
            except FileNotFoundError:  # claimed or set aside meanwhile
                continue
            except Exception:  # invalid: the trainer's read finds out and quarantines it with the reason
                self._failed.add(name)
                continue
            if before != after:  # it changed hands while it was parsed: not kept, and this pass is not complete
                complete = None
                continue
            with self._lock:
                self._parsed[name] = (before, group)
        return complete
