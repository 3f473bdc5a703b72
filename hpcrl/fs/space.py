"""A floor of free space under which a writer holds off: admission pauses, a checkpoint waits for the next one.

:class:`SpaceFloor` answers whether the filesystem holding a path has at least ``min_free_bytes`` free
(``launch.min_free_gb``), asking ``statvfs`` at most every ``every_s`` (on Lustre a statvfs asks every
storage target). It says once when the space falls below the floor and once when it is back, with the
numbers; a floor of 0 is always met. Lifecycle: one per writer process, asked before each write it may skip.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Callable

from hpcrl.fs.faults import filesystem, human_bytes

log = logging.getLogger(__name__)


class SpaceFloor:
    def __init__(self, path: str | os.PathLike, min_free_bytes: int, what: str, every_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path, self.min_free_bytes, self.what, self.every_s, self.clock = Path(path), min_free_bytes, what, \
            every_s, clock
        self._asked: float | None = None
        self._extra = 0
        self._ok = True

    def ok(self, extra_bytes: int = 0) -> bool:
        """Whether the floor (plus ``extra_bytes``, what the caller is about to write) is free now; the answer of
        the last look for the same ``extra_bytes`` within ``every_s``."""
        if self.min_free_bytes <= 0 and extra_bytes <= 0:
            return True
        now = self.clock()
        if self._asked is not None and now - self._asked < self.every_s and extra_bytes == self._extra:
            return self._ok
        self._asked, self._extra = now, extra_bytes
        fs = filesystem(self.path)
        ok = fs is None or fs.free_bytes >= self.min_free_bytes + extra_bytes  # unanswered: let the write say
        if ok != self._ok:
            need = human_bytes(self.min_free_bytes + extra_bytes)
            if ok:
                log.warning("%s resumed: %s (floor %s)", self.what, fs.describe() if fs else self.path, need)
            else:
                log.warning("%s held off: %s, below %s (launch.min_free_gb%s); it goes on once there is room",
                            self.what, fs.describe(), need, f" + {human_bytes(extra_bytes)} to write"
                            if extra_bytes else "")
        self._ok = ok
        return ok
