"""Heartbeats: one small JSON file per live component process.

A component calls :meth:`Heartbeat.beat` often (cheap: it writes at most
once per interval); the file ``<run_dir>/heartbeats/<name>.json`` carries the
wall time, pid, host and whatever progress the component reports. A
supervisor reads them with :func:`read_heartbeats` to tell a live process
from a hung one.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from hpcrl.fs import atomic


class Heartbeat:
    def __init__(self, run_dir: str | Path, name: str, interval_s: float = 5.0) -> None:
        self.path = Path(run_dir) / "heartbeats" / f"{name}.json"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.interval_s = interval_s
        self._last = 0.0
        self._info: dict[str, Any] = {}

    def beat(self, force: bool = False, **info: Any) -> None:
        """Say the process is alive, with progress ``info``; a beat without any (e.g. while the component waits)
        repeats the last progress with a new time."""
        if info:
            self._info = info
        now = time.time()
        if force or now - self._last >= self.interval_s:
            atomic.write_json(self.path, {"time": now, "pid": os.getpid(), "host": socket.gethostname(),
                                          **self._info})
            self._last = now


@contextmanager
def beating(heartbeat: Heartbeat | None) -> Iterator[None]:
    """Beat from a thread while the caller blocks where it cannot (a trainer rank > 0 in the batch broadcast,
    waiting as long as rank 0 waits for rollouts; rank 0 beats for itself, so a hung rank 0 still shows)."""
    if heartbeat is None:
        yield
        return
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(min(heartbeat.interval_s, 5.0)):
            heartbeat.beat()

    thread = threading.Thread(target=loop, name="heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def read_heartbeats(run_dir: str | Path) -> dict[str, dict]:
    out = {}
    for p in (Path(run_dir) / "heartbeats").glob("*.json"):
        if not atomic.is_temporary(p.name):
            out[p.stem] = atomic.read_json(p)
    return out
