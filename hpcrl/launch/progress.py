"""What the supervisor prints while it watches a run: a progress line from the newest metrics record, and the
components whose jobs wait in the scheduler's queue.

Lifecycle: the supervisor builds one :class:`Progress` and one :class:`QueueWait` when it starts watching and
calls :meth:`Progress.maybe_print` on every pass of its loop (at most one line per ``launch.progress_interval_s``,
and only when the trainer reached a new step), and once more, forced, when the run ends; and
:meth:`QueueWait.see` for every component on every pass.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from hpcrl.metrics.writer import read_evals, read_metrics

log = logging.getLogger("hpcrl.launch.supervisor")  # the supervisor's own lines, as they always were


class Progress:
    """Prints one line per interval from the newest metrics record."""

    def __init__(self, metrics_path: Path, total_steps: int, interval_s: float) -> None:
        self.path, self.total, self.interval = metrics_path, total_steps, interval_s
        self._last_print, self._last_step = 0.0, -1

    def maybe_print(self, force: bool = False) -> None:
        if not force and time.time() - self._last_print < self.interval:
            return
        records = read_metrics(self.path)
        if not records or records[-1].get("step", -1) == self._last_step:
            return
        self._last_print, r = time.time(), records[-1]
        self._last_step = r.get("step", -1)
        evals = read_evals(self.path.parent)
        acc = evals[-1]["eval/accuracy"] if evals else None
        log.info("step %d/%d | reward %s | held-out acc %s | staleness max %s | %s samples/s | %.0fs",
                 r.get("step", 0), self.total, _fmt(r.get("reward/mean")), _fmt(acc),
                 _fmt(r.get("staleness/max"), "{:.0f}"), _fmt(r.get("throughput/samples_per_s"), "{:.1f}"),
                 r.get("time/elapsed_s", 0.0))


def _fmt(v, spec: str = "{:.3f}") -> str:
    return "-" if v is None else spec.format(v)


class QueueWait:
    """What the supervisor says of a component whose job waits in the scheduler's queue (a Slurm job pending for
    its nodes, or requeued by a preemption): the progress line alone stands still then, and a user cannot tell a
    queue from a hang. Once a job has waited ``after_s`` seconds it is said (with the command that shows its
    state, and on Slurm why it waits), again every ``every_s`` while it waits, and once more when it leaves the
    queue. The wait is counted from this supervisor's first look at the job queued.

    Lifecycle: one per supervisor; :meth:`see` on every pass for every component, with whether its job is queued
    now or ended; a component resubmitted as a new job starts a new wait."""

    def __init__(self, run_dir: Path, after_s: float = 60.0, every_s: float = 600.0, clock=time.monotonic) -> None:
        self.run_dir, self.after, self.every, self.clock = run_dir, after_s, every_s, clock
        self._since: dict[str, tuple[str, float]] = {}  # component -> (job id, when it was first seen queued)
        self._said: dict[str, float] = {}  # component -> when its wait was last said

    def see(self, name: str, job_id: str, queued: bool, ended: bool = False) -> str | None:
        """Note whether ``name``'s job ``job_id`` is queued now, or ``ended`` (it left the queue without starting,
        or ran and ended: its wait is forgotten unsaid); returns the line it logged, if any."""
        now = self.clock()
        since = self._since.get(name)
        if since is not None and (since[0] != job_id or not queued):
            del self._since[name]
            said = self._said.pop(name, None)
            if said is not None and since[0] == job_id and not ended:
                return self._say(f"{name}: job {job_id} started after {now - since[1]:.0f} s in the queue")
            since = None
        if not queued or ended:
            return None
        if since is None:
            self._since[name] = since = (job_id, now)
        waited, said = now - since[1], self._said.get(name)
        if waited >= self.after and (said is None or now - said >= self.every):
            self._said[name] = now
            return self._say(f"{name}: job {job_id} has waited {waited:.0f} s in the scheduler's queue "
                             f"(see: python -m hpcrl status {self.run_dir})")
        return None

    @staticmethod
    def _say(line: str) -> str:
        log.info("%s", line)
        return line
