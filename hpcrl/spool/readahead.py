"""Read-ahead: the trainer's spool files parsed in a background thread while it trains.

Reading a small spool file costs ~0.3 ms, nearly all of it HDF5 and Python
(``scripts/bench_fs.py``, ``bench_async.py``); a batch of B files read when
the step starts is time the accelerator waits. ``ReadAhead`` reads the files
of the next batch during the current step instead, without taking them:

* Lifecycle: the trainer's :class:`~hpcrl.trainer.feed.BatchFeed` (rank 0)
  owns one and calls :meth:`kick` once a batch is taken. The worker thread
  (a daemon, started on the first kick) lists ``ready/`` once and parses the
  files it has not parsed yet, oldest first, at most ``limit`` of them, then
  sleeps until the next kick. :meth:`close` stops it.
* It moves, claims and quarantines nothing, and writes nothing: what the
  trainer decides (which files, against which version, what is stale or
  invalid) is decided at claim time exactly as without it. A file it cannot
  parse is simply not kept; the trainer's own read then finds the fault and
  quarantines the file with its reason.
* :meth:`read` (the trainer's read of a claimed file) returns the parsed
  group only if the file at that path is the very file that was parsed:
  same device, inode, size and modification time (a claim is a rename, which
  keeps them). Anything else, or a file not parsed yet, is read there and
  then, as before. A spool file is immutable once published (written to
  ``tmp/``, closed, renamed), so its identity stands for its content.

Costs: one listing of ``ready/`` per step and one ``stat`` per file read
ahead, on the shared filesystem's metadata server (the open and the read
move from the step to the worker). The worker holds the GIL while it parses
(h5py does not release it), so on a CPU-only trainer it competes with the
training loop's Python; on an accelerator the loop mostly waits on the
device and the reads overlap.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Callable, NamedTuple

from hpcrl.spool.format import TrajectoryGroup, read_group

log = logging.getLogger(__name__)


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

    def __init__(self, ready_dir: Path, limit: int, reader: Callable[[Path], TrajectoryGroup] = read_group) -> None:
        if limit < 1:
            raise ValueError(f"limit: must be >= 1, got {limit}")
        self.ready_dir, self.limit, self._reader = Path(ready_dir), limit, reader
        self._parsed: dict[str, tuple[_Identity, TrajectoryGroup]] = {}  # file name -> (identity, group)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.hits = self.misses = 0  # reads served from the worker's parse / read there and then

    def __len__(self) -> int:
        """How many parsed groups wait for their file's read."""
        with self._lock:
            return len(self._parsed)

    def kick(self) -> None:
        """Parse what is in ``ready/`` now (in the background; returns at once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="spool-read-ahead", daemon=True)
            self._thread.start()
        self._wake.set()

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

    def close(self) -> None:
        """Stop the worker (waits for the file it is parsing)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            self._parsed.clear()

    def _work(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop:
                return
            try:
                self._pass()
            except Exception:  # never let the worker die: the trainer reads for itself meanwhile
                log.exception("spool read-ahead pass failed; the trainer reads the files itself")

    def _pass(self) -> None:
        try:
            names = sorted(os.listdir(self.ready_dir))  # canonical names sort by ticket
        except FileNotFoundError:
            return
        listed = set(names)
        with self._lock:  # files no longer ready were claimed or set aside: their parse will not be asked for
            for name in [n for n in self._parsed if n not in listed]:
                del self._parsed[name]
            todo = [n for n in names if n.endswith(".h5") and n not in self._parsed]
            room = self.limit - len(self._parsed)
        for name in todo[:max(room, 0)]:
            if self._stop or self._wake.is_set():  # a newer kick: list again
                return
            path = self.ready_dir / name
            try:
                before = _Identity.of(os.stat(path))
                group = self._reader(path)
            except Exception:  # vanished (claimed meanwhile) or invalid: the trainer's read will tell
                continue
            with self._lock:
                self._parsed[name] = (before, group)
