"""CPU seconds per thread of this process, by the thread's name.

:func:`thread_cpu_s` reads ``/proc/self/task/<tid>/stat`` (user + system
ticks) for every live thread and names each by the Python thread that owns
that native id (``threading.Thread.name``: ``MainThread``, ``spool-publisher``,
``spool-read-ahead``, ``heartbeat`` ...). Threads Python did not start (the
torch intra-op pool, gloo's, a library's) are summed under ``native``.
Threads that have ended are not counted. Off Linux (no ``/proc``) it returns
an empty dict. A stats writer calls it once, at the end of a component's run,
to show which threads kept the process's cores busy.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _ticks(stat: str) -> int:
    """utime + stime from a ``stat`` line; the fields after ``comm``, which may hold spaces, are split."""
    fields = stat[stat.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5), counted from the state (field 3)


def thread_cpu_s(task_dir: Path = Path("/proc/self/task")) -> dict[str, float]:
    """CPU seconds of each live thread, summed by name; unnamed (non-Python) threads under ``native``."""
    if not task_dir.is_dir():
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for entry in task_dir.iterdir():
        try:
            ticks = _ticks((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # the thread ended while we looked
        name = names.get(int(entry.name), "native")
        out[name] = out.get(name, 0.0) + ticks / _TICK
    return {k: round(v, 2) for k, v in sorted(out.items())}
