"""Writing finished groups to the spool from a background thread.

A spool publish is an in-memory encode, one write, two fsyncs and a rename
(:meth:`hpcrl.spool.store.Spool.publish`). Next to a trainer that also
writes, the fsyncs take milliseconds, time the rollout's generation loop
would otherwise stand still; fsync releases the GIL, so a writer thread lets
decoding go on meanwhile.

Lifecycle: created by the rollout worker -> :meth:`submit` per finished group
(returns at once; blocks only while ``max_pending`` groups are waiting, which
bounds memory and holds generation back when the filesystem cannot keep up)
-> :meth:`drain` whenever the caller needs everything submitted to be in
``ready/`` (the colocated loop before it looks for a batch, a rollout before
it exits on a signal) -> :meth:`close` (drain, stop the thread).

Failure: a write error stops the writer; the next :meth:`submit`,
:meth:`drain` or :meth:`close` raises it in the caller's thread, so the
process fails the way a synchronous write would have. A process killed with
groups still pending loses them like the ones it was generating: their
tickets belong to this incarnation's writer id and are reissued when the
watchdog declares it dead. Files are still published atomically, one at a
time, so no reader ever sees a partial one.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable

from hpcrl.spool.format import TrajectoryGroup
from hpcrl.spool.store import Spool


class PublishError(RuntimeError):
    """A background spool write failed; the cause is chained."""


class BackgroundPublisher:
    def __init__(self, spool: Spool, on_published: Callable[[TrajectoryGroup, float], None] | None = None,
                 max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending: must be >= 1, got {max_pending}")
        self.spool, self.on_published = spool, on_published
        self._queue: queue.Queue[TrajectoryGroup | None] = queue.Queue(max_pending)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="spool-publisher", daemon=True)
        self._thread.start()

    @property
    def pending(self) -> int:
        """Groups submitted and not yet in ``ready/``."""
        return self._queue.unfinished_tasks

    def submit(self, group: TrajectoryGroup) -> None:
        self._raise_error()
        if self._closed:
            raise RuntimeError("submit: the publisher is closed")
        self._queue.put(group)

    def drain(self) -> None:
        """Wait until every submitted group is published (or a write failed: raise it)."""
        self._queue.join()
        self._raise_error()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()
        self._raise_error()

    def _loop(self) -> None:
        while True:
            group = self._queue.get()
            try:
                if group is None:
                    return
                if self._error is None:  # after a failure the rest is dropped: the caller will raise
                    t0 = time.perf_counter()
                    self.spool.publish(group)
                    if self.on_published is not None:
                        self.on_published(group, time.perf_counter() - t0)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                self._error = e
            finally:
                self._queue.task_done()

    def _raise_error(self) -> None:
        if self._error is not None:
            raise PublishError(f"writing a group to the spool failed: {self._error}") from self._error
