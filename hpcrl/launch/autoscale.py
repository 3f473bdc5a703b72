"""Autoscaling the rollout fleet to the trainer's demand (``launch.autoscale``).

Lifecycle: with ``launch.autoscale.enabled`` the supervisor builds one
:class:`Autoscaler` and calls :meth:`Autoscaler.tick` from its loop. Every
``interval_s`` it reads the signals (:func:`read_signals`): the trainer's
wait share (the part of its step time it spent waiting for a batch,
``time/wait_s`` less the spool pass that completed its batch,
``time/spool_tail_s`` (its earlier passes happened while it waited for data), over
``time/step_s`` of ``logs/metrics.jsonl``, over the
last ``window_s`` of training since the previous decision), and the ready
groups in the spool against what the staleness bound lets be outstanding
((η+1)·B prompt groups). It then decides (:meth:`Autoscaler.decide`):

* **add** a replica when the trainer waited more than ``add_wait_share`` of
  the window, the count is below ``max_replicas`` and the cluster has room
  (the scheduler's :meth:`~hpcrl.launch.scheduler.Scheduler.has_room`: for
  Slurm, ``sbatch --test-only`` says the job would start within
  ``room_within_s``);
* **drain** one when the trainer waited less than ``drain_wait_share`` and
  the ready groups fill at least ``drain_ready_share`` of the bound (the
  rollouts make more than the trainer may use, and wait on admission), and
  the count is above ``min_replicas``;
* keep the count within ``[min_replicas, max_replicas]``.

Hysteresis: the two thresholds are far apart, a decision needs a full
window of training after the previous one (``window_s``, at least
``min_steps`` steps) and none comes within ``cooldown_s`` of another.
A decision is a scale request like ``python -m hpcrl scale`` writes (by
"autoscaler", with its reason), so the supervisor's fleet logic starts or
drains the replica (:mod:`hpcrl.launch.fleet`); a manual ``scale`` sets the
count the autoscaler goes on from. Every assessment goes to
``logs/fleet.jsonl`` (count, wait share, ready groups, decision and reason),
which ``status`` shows.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from hpcrl.launch.fleet import request_scale, wanted_replicas

FLEET_LOG = "fleet.jsonl"  # in <run_dir>/logs/


@dataclass
class Signals:
    wait_share: float | None  # share of the trainer's step time spent waiting for data; None: too few steps
    steps: int  # trainer steps in the window
    window_s: float  # seconds of training the window covers
    ready_groups: int  # published groups waiting for the trainer
    bound_groups: int  # what the staleness bound lets be outstanding: (eta + 1) * B


def tail_records(path: Path, max_bytes: int = 1 << 20) -> list[dict]:
    """The complete JSON lines in the last ``max_bytes`` of ``path`` (a line being written is skipped)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            data = f.read()
    except FileNotFoundError:
        return []
    lines = data.split(b"\n")
    if size > max_bytes:
        lines = lines[1:]  # the first one is cut
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_signals(run_dir: Path, cfg, since_elapsed_s: float) -> Signals:
    """The signals over the last ``launch.autoscale.window_s`` of training after ``since_elapsed_s`` (the
    trainer's ``time/elapsed_s`` at the previous decision)."""
    records = [r for r in tail_records(run_dir / "logs" / "metrics.jsonl")
               if "time/wait_s" in r and "time/step_s" in r and r.get("time/elapsed_s", 0.0) > since_elapsed_s]
    if records:
        newest = records[-1]["time/elapsed_s"]
        records = [r for r in records if r["time/elapsed_s"] >= newest - cfg.launch.autoscale.window_s]
    step_s = sum(r["time/step_s"] for r in records)
    window = records[-1]["time/elapsed_s"] - records[0]["time/elapsed_s"] + records[0]["time/step_s"] if records else 0.0
    try:
        ready = sum(1 for n in (run_dir / "spool" / "ready").iterdir() if n.name.endswith(".h5"))
    except FileNotFoundError:
        ready = 0
    waited = sum(max(0.0, r["time/wait_s"] - r.get("time/spool_tail_s", 0.0)) for r in records)  # not the last pass
    return Signals(wait_share=waited / step_s if step_s > 0 else None,
                   steps=len(records), window_s=window, ready_groups=ready,
                   bound_groups=(cfg.admission.max_staleness + 1) * cfg.admission.batch_size)


class Autoscaler:
    def __init__(self, cfg, run_dir: Path, clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.run_dir, self.clock = cfg, Path(run_dir), clock
        self.acfg = cfg.launch.autoscale
        self.last_tick = 0.0
        self.last_decision = -float("inf")  # clock time
        self.since_elapsed_s = 0.0  # the trainer's elapsed time at the last decision: signals start after it

    def decide(self, wanted: int, sig: Signals, has_room: Callable[[], bool]) -> tuple[int, str] | None:
        """The count to go to and why, or None (keep it)."""
        a = self.acfg
        if wanted < a.min_replicas:
            return a.min_replicas, f"{wanted} is below launch.autoscale.min_replicas"
        if wanted > a.max_replicas:
            return a.max_replicas, f"{wanted} is above launch.autoscale.max_replicas"
        if self.clock() - self.last_decision < a.cooldown_s or sig.wait_share is None:
            return None
        if sig.steps < a.min_steps or sig.window_s < a.window_s:
            return None  # not yet a full window of training with this count
        waited = f"the trainer waited for data {sig.wait_share:.0%} of the last {sig.window_s:.0f}s ({sig.steps} steps)"
        if sig.wait_share > a.add_wait_share and wanted < a.max_replicas:
            if not has_room():
                return None
            return wanted + 1, f"{waited} > {a.add_wait_share:.0%}"
        full = sig.ready_groups >= a.drain_ready_share * sig.bound_groups
        if sig.wait_share < a.drain_wait_share and full and wanted > a.min_replicas:
            return wanted - 1, (f"{waited} < {a.drain_wait_share:.0%} and {sig.ready_groups} ready groups fill "
                                f">= {a.drain_ready_share:.0%} of the {sig.bound_groups} the staleness bound allows")
        return None

    def tick(self, has_room: Callable[[], bool]) -> str | None:
        """Assess every ``interval_s``: log the signals, write a scale request on a decision; its reason or None."""
        now = self.clock()
        if now - self.last_tick < self.acfg.interval_s:
            return None
        self.last_tick = now
        wanted = wanted_replicas(self.cfg, self.run_dir)
        sig = read_signals(self.run_dir, self.cfg, self.since_elapsed_s)
        decision = self.decide(wanted, sig, has_room)
        record = {"time": now, "wanted": wanted, **asdict(sig)}
        if decision is not None:
            count, why = decision
            request_scale(self.run_dir, count, by="autoscaler", reason=why)
            self.last_decision = now
            newest = tail_records(self.run_dir / "logs" / "metrics.jsonl", 1 << 16)
            self.since_elapsed_s = max([r.get("time/elapsed_s", 0.0) for r in newest] or [0.0])
            record.update(decision=count, reason=why)
        with open(self.run_dir / "logs" / FLEET_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")
        return None if decision is None else f"{wanted} -> {decision[0]}: {decision[1]}"


def last_assessment(run_dir: Path) -> dict | None:
    """The newest record of ``logs/fleet.jsonl`` (and the newest decision in it), for ``status``."""
    records = tail_records(Path(run_dir) / "logs" / FLEET_LOG, 1 << 18)
    if not records:
        return None
    decisions = [r for r in records if "decision" in r]
    return {**records[-1], "last_decision": decisions[-1] if decisions else None}
