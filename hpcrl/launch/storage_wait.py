"""The supervisor's side of storage faults: keep going through them, say each once, wait for room.

The supervisor is the one process a run cannot lose, so a full quota or a failing filesystem must never
end it (design.md §4.12). One :class:`StorageWait` per supervision:

* :meth:`StorageWait.retry` runs one of the supervisor's writes (a ledger reclaim, a resubmission) until it
  succeeds, backing off 1 s, 2 s, ... up to 10 s while the fault lasts, keeping the owner's heartbeat alive
  meanwhile; a preemption or cancel request ends the wait (the error is raised, the loop then stops the run
  the usual way);
* :meth:`StorageWait.fault` notes a fault met anywhere in a tick of the supervisor's loop (which is retried
  whole: every step of it is idempotent) and gives the back-off;
* a fault is said once, as one error line with the path, the operation and the filesystem's free space and
  inodes, and what the user can do (:meth:`StorageWait.stopped` when the first to meet it is a component);
  its end is said once too. Further components stopping on the same fault are logged at INFO only.
* :meth:`StorageWait.has_room`: whether the run directory's filesystem has ``launch.min_free_gb`` free,
  the condition for restarting a component that stopped on a storage fault.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, TypeVar

from hpcrl.fs.faults import as_storage_error, filesystem, human_bytes, storage_fault

log = logging.getLogger(__name__)
T = TypeVar("T")


class StorageWait:
    def __init__(self, run_dir: Path, min_free_bytes: int, keep_alive: Callable[[], None] = lambda: None,
                 interrupted: Callable[[], bool] = lambda: False, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic, max_delay_s: float = 10.0) -> None:
        self.run_dir, self.min_free_bytes = run_dir, min_free_bytes
        self.keep_alive, self.interrupted, self.sleep, self.clock = keep_alive, interrupted, sleep, clock
        self.max_delay_s = max_delay_s
        self._since: float | None = None  # when the fault now open began
        self._said: str | None = None  # the filesystem it was said of
        self._delay = 1.0
        self.faults = 0  # faults said, over the supervision

    def fault(self, error: BaseException, what: str) -> float:
        """Note a storage fault met while doing ``what``; the seconds to wait before trying again."""
        fault = storage_fault(error) or error
        # a fault without a path (a wrapped one) is the run directory's: its filesystem is the one said
        err = as_storage_error(fault, what, None if getattr(fault, "filename", None) else self.run_dir)  # type: ignore
        mount = err.filesystem.mount if err.filesystem else None
        if self._since is None or mount != self._said:  # one episode per filesystem, whatever met it first
            self._open(mount, f"while {what}: {err}")
        delay, self._delay = self._delay, min(self.max_delay_s, self._delay * 2)
        return delay

    def stopped(self, names: list[str]) -> None:
        """Components stopped on a storage fault (exit 74): said as the fault's first line if it is new."""
        what = f"{', '.join(names)} stopped on it (exit 74)"
        if self._since is not None:
            log.info("storage fault: %s too", what)
            return
        fs = filesystem(self.run_dir)
        if fs is not None and fs.free_bytes >= self.min_free_bytes:  # a fault already over (or not one of space)
            log.warning("%s stopped on a storage fault (exit 74; its log says which write failed); the filesystem "
                        "has room now (%s): restarting it", ", ".join(names), fs.describe())
            return
        self._open(fs.mount if fs else None, f"{what}; filesystem {fs.describe() if fs else self.run_dir}")

    def _open(self, mount: str | None, what: str) -> None:
        if self._since is None:
            self._since = self.clock()
        self._said, self.faults = mount, self.faults + 1
        log.error("storage fault %s. The run goes on by itself once the filesystem has room: what stopped on it "
                  "restarts, free of charge, when %s are free (launch.min_free_gb). Free space there, or stop the "
                  "run with: python -m hpcrl cancel %s", what, human_bytes(self.min_free_bytes), self.run_dir)

    def clear(self) -> None:
        """Writes succeed again and the filesystem has room: say the fault's end once (a write that needed no
        room leaves the fault open)."""
        if self._since is None or not self.has_room():
            return
        fs = filesystem(self.run_dir)
        log.warning("storage fault over after %.0fs%s", self.clock() - self._since,
                    f" ({fs.describe()})" if fs else "")
        self._since, self._said, self._delay = None, None, 1.0

    def pause(self, seconds: float) -> None:
        """Wait ``seconds`` in short slices, keeping the owner's heartbeat alive; return early if interrupted.
        Both callbacks touch the filesystem: a storage fault in them is the fault being waited out."""
        end = self.clock() + seconds
        while not self._quietly(self.interrupted, False):
            self._quietly(self.keep_alive, None)
            left = end - self.clock()
            if left <= 0:
                return
            self.sleep(min(0.5, left))

    @staticmethod
    def _quietly(fn: Callable[[], T], otherwise: T) -> T:
        try:
            return fn()
        except OSError as e:
            if storage_fault(e) is None:
                raise
            return otherwise

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """``fn()`` until it returns; a storage fault is noted and retried after a back-off, and raised as a
        :class:`hpcrl.fs.faults.StorageError` if the run is interrupted meanwhile; other errors pass."""
        while True:
            try:
                result = fn()
            except Exception as e:
                fault = storage_fault(e)
                if fault is None:
                    raise
                self.pause(self.fault(fault, what))
                if self._quietly(self.interrupted, False):
                    raise as_storage_error(fault, what) from e
                continue
            self.clear()
            return result

    def has_room(self) -> bool:
        fs = filesystem(self.run_dir)
        return fs is not None and fs.free_bytes >= self.min_free_bytes
