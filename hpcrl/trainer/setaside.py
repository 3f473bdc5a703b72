"""Set-asides off the trainer's loop: a file that can no longer be trained, moved aside by a worker thread.

A ready file found stale (or from a lost policy) is opened and checked, moved to ``dropped/`` with its reason
(the reason's content fsynced first) and its ticket reissued (:meth:`~hpcrl.trainer.feed.BatchFeed.regenerate`):
about 1.5 ms of the trainer's loop per file on this project's CPU machine, once per step at η = 1 in
``scripts/bench_async.py``. With ``trainer.read_ahead`` on, the feed hands that work to a :class:`SetAsides`
instead, and it runs while the step trains or the batch waits.

Lifecycle: the feed (rank 0) owns one. :meth:`put` queues a file (the worker thread, a daemon, starts at the first
one); the worker does ``work`` for each in turn holding ``lock``, the lock the feed holds while it uses the spool
and the ledger itself, so the two never interleave and the decisions are the ones the feed would have made in
line. A file queued and not done yet is :meth:`pending`: the feed's listing skips it (it is still in ``ready/``).
:meth:`flush` waits until every queued file is done (before the spool is synced for a checkpoint, and before
DONE) and raises what the worker raised (a lost fence, say: the worker then does nothing more); :meth:`check`
raises it without waiting (each batch starts with it). :meth:`close` (the trainer's exit) lets the worker finish
what is queued, for at most ``timeout_s``; a file it did not get to is still in ``ready/``, and the next listing,
or the next trainer's, sets it aside again. ``busy_s`` and ``done`` say what it did.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable

from hpcrl.spool.store import SpoolEntry

log = logging.getLogger(__name__)


class SetAsides:
    """Queue of files to set aside, done by one worker thread under the feed's lock (see module docstring)."""

    def __init__(self, work: Callable[[SpoolEntry, str, str], None], lock: threading.Lock) -> None:
        self._work, self._lock = work, lock
        self._queue: queue.Queue[tuple[SpoolEntry, str, str] | None] = queue.Queue()
        self._pending: set[str] = set()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # the worker's time on set-asides (under the lock)
        self.done = 0

    def put(self, entry: SpoolEntry, kind: str, reason: str) -> None:
        """Queue ``entry`` to be set aside as ``kind`` with ``reason``; raises what the worker raised before."""
        self.check()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hpcrl-set-aside", daemon=True)
            self._thread.start()
        self._pending.add(entry.name)
        self._queue.put((entry, kind, reason))

    def pending(self, name: str) -> bool:
        """Whether the file ``name`` is queued or being set aside."""
        return name in self._pending

    def check(self) -> None:
        """Raise what the worker raised (once)."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def flush(self) -> None:
        """Wait until every queued file is done, then raise what the worker raised."""
        if self._thread is not None:
            self._queue.join()
        self.check()

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the worker finish what is queued (at most ``timeout_s``) and stop it."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("set-aside worker still busy after %.0fs; %d file(s) left in ready/", timeout_s,
                        len(self._pending))
        self._thread = None
        if self._error is not None:
            log.warning("set-aside worker stopped: %s", self._error)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if self._error is None:  # after a failure nothing more is done: the loop raises it next
                    with self._lock:
                        t0 = time.monotonic()
                        self._work(*item)
                        self.busy_s += time.monotonic() - t0
                    self.done += 1
            except BaseException as e:  # noqa: BLE001 - handed to the loop's thread, which raises it
                self._error = e
            finally:
                if item is not None:
                    self._pending.discard(item[0].name)
                self._queue.task_done()
