"""Restart policy: what to do about a component, given its exit code and heartbeat.

The supervisor calls :meth:`Watchdog.assess` for every component on every
tick and acts on the :class:`Decision`:

* ``ok``: running (fresh heartbeat or still within its start-up grace), or
  finished normally;
* ``restart``: it exited non-zero (a crash, kill, OOM, Slurm FAILED /
  CANCELLED / TIMEOUT / NODE_FAIL), asked to be requeued (exit 75 after a
  preemption signal: free of charge), or is hung (stale heartbeat: the
  supervisor cancels it first) — and the component still has restart budget;
  ``delay_s`` is the back-off before resubmitting; a component that stopped on
  a storage fault (exit 74, :mod:`hpcrl.fs.faults`) is restarted free of charge
  with ``storage`` set: the supervisor waits for the filesystem to have room;
* ``fail``: the budget is spent; the supervisor stops the run.

Every decision other than ``ok`` carries a human-readable reason, which the
supervisor logs and appends to ``<run_dir>/jobs/events.jsonl``. The clock is
injectable so tests control time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from hpcrl.runtime.preempt import EXIT_REQUEUE
from hpcrl.fs.faults import EXIT_STORAGE
from hpcrl.watchdog.config import WatchdogConfig


@dataclass
class Decision:
    # stop: the whole run stops (preemption, walltime, cancel); scale: the supervisor started, drained or retired a
    # rollout replica (hpcrl.launch.fleet); start: the supervisor submitted a component's job (its first start, or
    # the new job after a restart: jobs/events.jsonl only, never the watchdog's decision)
    action: Literal["ok", "restart", "fail", "stop", "scale", "start"]
    reason: str = ""
    delay_s: float = 0.0
    hung: bool = False  # the process may still be alive: cancel it before resubmitting
    storage: bool = False  # it stopped on a storage fault: resubmit once the run directory's filesystem has room


@dataclass
class _State:
    started: float
    restarts: int = 0
    free_restarts: int = 0
    storage_stops: int = 0
    history: list[str] = field(default_factory=list)


class Watchdog:
    def __init__(self, cfg: WatchdogConfig, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.clock = cfg, clock
        self.states: dict[str, _State] = {}

    def started(self, name: str) -> None:
        """Record a (re)start of ``name`` (its heartbeat clock starts now)."""
        state = self.states.setdefault(name, _State(started=self.clock()))
        state.started = self.clock()

    def assess(self, name: str, exit_code: int | None, heartbeat_time: float | None) -> Decision:
        state = self.states.setdefault(name, _State(started=self.clock()))
        if exit_code == 0:
            return Decision("ok")
        if exit_code is None:
            reason = self._hung(state, heartbeat_time)
            if reason is None:
                return Decision("ok")
            return self._restart(name, state, reason, hung=True)
        if exit_code == EXIT_REQUEUE:
            state.free_restarts += 1
            return Decision("restart", f"{name} stopped for preemption/requeue (exit {exit_code})", 0.0)
        if exit_code == EXIT_STORAGE:  # not its fault: free of charge, but backed off while the fault lasts
            if self.clock() - state.started >= self.cfg.backoff_max_s:
                state.storage_stops = 0  # it ran a while since the last one: a new fault, not the same one
            delay = min(self.cfg.backoff_max_s, self.cfg.backoff_s * (2 ** min(state.storage_stops, 16)))
            state.storage_stops += 1
            return Decision("restart", f"{name} stopped on a storage fault (exit {exit_code}); restarting it once "
                                       f"the run directory's filesystem has room (free of charge, {delay:.1f}s "
                                       "back-off)", delay, storage=True)
        return self._restart(name, state, f"{name} exited with code {exit_code}")

    def _hung(self, state: _State, heartbeat_time: float | None) -> str | None:
        timeout = self.cfg.heartbeat_timeout_s
        if timeout <= 0:
            return None
        now = self.clock()
        last = heartbeat_time if heartbeat_time is not None and heartbeat_time >= state.started else None
        if last is None:
            if now - state.started > self.cfg.startup_grace_s:
                return f"no heartbeat {now - state.started:.0f}s after start (grace {self.cfg.startup_grace_s:.0f}s)"
            return None
        if now - last > timeout:
            return f"heartbeat {now - last:.0f}s old (timeout {timeout:.0f}s): hung"
        return None

    def _restart(self, name: str, state: _State, reason: str, hung: bool = False) -> Decision:
        state.history.append(reason)
        if not self.cfg.enabled or state.restarts >= self.cfg.max_restarts:
            return Decision("fail", f"{reason}; restart budget spent ({state.restarts}/{self.cfg.max_restarts})",
                            hung=hung)
        delay = min(self.cfg.backoff_max_s, self.cfg.backoff_s * (2 ** state.restarts))
        state.restarts += 1
        return Decision("restart", f"{reason}; restart {state.restarts}/{self.cfg.max_restarts} in {delay:.1f}s",
                        delay, hung)
