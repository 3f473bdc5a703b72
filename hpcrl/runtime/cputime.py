"""CPU seconds per thread of this process, by the thread's name.

:func:`thread_cpu_s` reads ``/proc/self/task/<tid>/stat`` (user + system
ticks) for every live thread and names each by the Python thread that owns
that native id (``threading.Thread.name``: ``MainThread``, ``spool-publisher``,
``spool-read-ahead``, ``heartbeat`` ...). Threads Python did not start (the
torch intra-op pool, gloo's, a library's) are summed under ``native``.
Threads that have ended are not counted. Off Linux (no ``/proc``) it returns
an empty dict. A component reads it when its work starts and again at the
end; :func:`since` gives what each thread burned in between, which is what
its stats file shows.
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
    """CPU seconds of each live thread since it started, summed by name; unnamed (non-Python) threads under
    ``native``. Never raises: what cannot be read is left out (a stats writer calls it on the way out)."""
    try:
        entries = list(task_dir.iterdir())
    except OSError:
        return {}
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for entry in entries:
        try:
            ticks, tid = _ticks((entry / "stat").read_text()), int(entry.name)
        except (OSError, ValueError, IndexError):
            continue  # the thread ended while we looked, or not a thread's entry
        name = names.get(tid, "native")
        out[name] = out.get(name, 0.0) + ticks / _TICK
    return {k: round(v, 2) for k, v in sorted(out.items())}


def since(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """Each name's CPU seconds between two :func:`thread_cpu_s` readings (at least 0: a thread that ended and was
    replaced by one of the same name counts from the new one's start)."""
    return {k: round(max(0.0, v - before.get(k, 0.0)), 2) for k, v in now.items()}
