"""The rollout fleet's size while a run goes on: ``python -m hpcrl scale <run_dir> N``.

Lifecycle: ``scale`` writes ``<run_dir>/jobs/scale.json`` (the count, who
asked, when; :func:`request_scale`). The supervisor reads it on every tick
(:func:`wanted_replicas`; without a request the count is
``rollout.replicas``) and plans with :func:`plan`: while fewer replicas run
it starts ``rollout-K`` for the lowest free K (a job of its own, with the
resources of ``launch.rollout``); while more run it drains the highest
numbered one: SIGUSR2, on which the rollout publishes what it finished,
hands the rest of its tickets back and exits 75 (as on a preemption signal).
A drained replica is retired, not restarted; if it has not exited after
``launch.preempt_grace_s`` it is killed, and whatever it still held is
reclaimed like a dead rollout's tickets. Each decision goes to
``jobs/events.jsonl`` (action ``scale``, with its reason) and the log. A
run resumed later starts with the requested count. Admission is global in
the run directory, so a replica that joins takes tickets at once under the
same staleness bound, with the newest published weights; the trainer goes
on whatever the count, and waits (without failing) while it is 0.

This module is light (no torch): ``python -m hpcrl scale`` imports it.
"""

from __future__ import annotations

import getpass
import os
import re
import socket
import time
from pathlib import Path
from typing import Callable

from hpcrl.fs import atomic

SCALE = "scale.json"  # in <run_dir>/jobs/
_ROLLOUT = re.compile(r"^rollout-(\d+)$")


def request_scale(run_dir: Path, replicas: int, by: str = "", reason: str = "") -> dict:
    """Ask the run's supervisor for ``replicas`` rollout replicas (``by``: who asks, default the user; ``reason``:
    why, for the autoscaler's decisions); returns the request written."""
    if replicas < 0:
        raise ValueError(f"the number of rollout replicas must be >= 0, got {replicas}")
    req = {"replicas": replicas, "time": time.time(), "user": by or getpass.getuser(), "host": socket.gethostname(),
           "pid": os.getpid(), **({"reason": reason} if reason else {})}
    (Path(run_dir) / "jobs").mkdir(parents=True, exist_ok=True)
    atomic.write_json(Path(run_dir) / "jobs" / SCALE, req)
    return req


def scale_requested(run_dir: Path) -> dict | None:
    """The newest ``scale`` request of the run, or None."""
    try:
        req = atomic.read_json(Path(run_dir) / "jobs" / SCALE)
    except (FileNotFoundError, ValueError):
        return None
    return req if isinstance(req, dict) and isinstance(req.get("replicas"), int) else None


def wanted_replicas(cfg, run_dir: Path) -> int:
    """How many rollout replicas the run should have now: the newest request, else ``rollout.replicas``."""
    req = scale_requested(run_dir)
    return cfg.rollout.replicas if req is None else req["replicas"]


def fleet_size(cfg, run_dir: Path, every_s: float = 5.0) -> Callable[[], int]:
    """:func:`wanted_replicas`, read again at most every ``every_s`` (a rollout asks on every pass of its loop)."""
    seen = {"at": -float("inf"), "n": cfg.rollout.replicas}

    def size() -> int:
        now = time.monotonic()
        if now - seen["at"] >= every_s:  # scale_requested reads a missing or unreadable request as none
            seen["n"], seen["at"] = max(1, wanted_replicas(cfg, run_dir)), now
        return seen["n"]
    return size


def replica_of(name: str) -> int | None:
    """K of a component named ``rollout-K``, else None."""
    m = _ROLLOUT.match(name)
    return int(m.group(1)) if m else None


def plan(running: list[str], wanted: int) -> tuple[list[str], list[str]]:
    """(replicas to start, replicas to drain) to go from the ``running`` rollout names (draining ones left out)
    to ``wanted``: new ones take the lowest free numbers, the highest numbered ones drain first."""
    ks = sorted(k for k in map(replica_of, running) if k is not None)
    if len(ks) > wanted:
        return [], [f"rollout-{k}" for k in sorted(ks, reverse=True)[:len(ks) - wanted]]
    free = (k for k in range(len(ks) + wanted + 1) if k not in ks)
    return [f"rollout-{next(free)}" for _ in range(wanted - len(ks))], []


def describe(req: dict | None) -> str:
    """Who asked for the current count, for logs and ``status``."""
    if req is None:
        return "rollout.replicas of the config"
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(req.get("time", 0)))
    why = f" ({req['reason']})" if req.get("reason") else ""
    return f"scale {req['replicas']} by {req.get('user', '?')} on {req.get('host', '?')} at {when}{why}"
