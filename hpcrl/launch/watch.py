"""Watching a run: the supervisor's loop from the first submission to the run's end.

Every half second (:meth:`Watch.tick`): stop if a newer owner claimed the run, a signal or a cancel came;
poll every job; end when ``DONE`` is written and the trainer (and the evaluation component) exited 0;
otherwise let the autoscaler and the fleet plan start or drain replicas, restart what the watchdog says
to restart (a trainer as its whole group, a dead rollout's tickets reissued first), and restart what
stopped on a storage fault once the filesystem has room (:mod:`hpcrl.launch.storage_wait`). Temporaries of
writers it stopped are swept (:mod:`hpcrl.launch.leftovers`). At the end: rollouts stopped, the run's books
closed (:func:`hpcrl.launch.finalize.finalize`), every temporary removed.
"""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.config import RunConfig
from hpcrl.launch.autoscale import Autoscaler
from hpcrl.launch.control import cancel_requested
from hpcrl.launch.finalize import finalize
from hpcrl.launch.fleet import describe, plan, replica_of, scale_requested, wanted_replicas
from hpcrl.launch.jobs import (event, heartbeat_name, is_trainer, must_finish, stamp, write_registry,
                               writer_of)
from hpcrl.launch.leftovers import Sweeper, remove_all
from hpcrl.launch.progress import Progress, QueueWait
from hpcrl.launch.registry import scheduler_spec
from hpcrl.launch.scheduler import ComponentFailed, Scheduler, log_tail
from hpcrl.launch.specs import component_specs, no_self_requeue, rollout_spec
from hpcrl.launch.storage_wait import StorageWait
from hpcrl.runtime.heartbeat import read_heartbeats
from hpcrl.runtime.owner import ENV_INSTANCE, Fence, Owner
from hpcrl.runtime.preempt import PreemptionFlag
from hpcrl.spool.store import Spool
from hpcrl.fs.faults import EXIT_STORAGE, storage_fault
from hpcrl.watchdog.policy import Decision, Watchdog

log = logging.getLogger(__name__)


class RunTakenOver(RuntimeError):
    """A newer owner (another ``--resume``) claimed the run: this supervisor stopped its components."""


class RunCancelled(RuntimeError):
    """``python -m hpcrl cancel`` asked the run to stop: every component was asked to checkpoint and stop, and
    the run is not requeued; it continues with ``python -m hpcrl.submit --resume``."""


class RunPreempted(RuntimeError):
    """The supervisor was signalled (walltime, preemption, scancel): every component was asked to
    checkpoint and stop; the run continues with ``python -m hpcrl.submit --resume``."""


class Watch:
    """The supervisor's state while it watches a run: its jobs, the watchdog, the components parked until
    storage has room, the sweep of stopped writers' temporaries. :meth:`run` is the loop."""

    def __init__(self, cfg: RunConfig, run_dir: Path, scheduler: Scheduler, jobs: dict, owner: Owner,
                 preempt: PreemptionFlag | None) -> None:
        self.cfg, self.run_dir, self.scheduler, self.jobs, self.owner = cfg, run_dir, scheduler, jobs, owner
        self.preempt = preempt
        self.progress = Progress(run_dir / "logs" / "metrics.jsonl", cfg.trainer.total_steps,
                                 cfg.launch.progress_interval_s)
        self.waits = QueueWait(run_dir, after_s=cfg.launch.queue_note_s)
        self.watchdog, self.events = Watchdog(cfg.watchdog), run_dir / "jobs" / "events.jsonl"
        for name in jobs:
            self.watchdog.started(name)
        self.cleaned = time.time()
        self.draining: dict[str, float] = {}  # replica -> when it is killed if it has not exited
        self.parked: dict[str, float] = {}  # stopped on a storage fault -> earliest restart (monotonic)
        self.sweeper = Sweeper(run_dir, owner.epoch)
        self.stopping: dict[str, str] = {}  # job id -> instance: stopped, its end not seen yet
        self.storage = StorageWait(run_dir, int(cfg.launch.min_free_gb * 1e9),
                                   keep_alive=lambda: owner.beat(cfg.launch.heartbeat_interval_s),
                                   interrupted=self._interrupted)
        self.autoscaler = Autoscaler(cfg, run_dir) if cfg.launch.autoscale.enabled else None

    def _interrupted(self) -> bool:
        if self.preempt is not None and self.preempt.requested:
            return True
        try:
            return cancel_requested(self.run_dir) is not None
        except OSError as e:  # an unreadable CANCEL file is no request (yet)
            if storage_fault(e) is None:
                raise
            return False

    def run(self) -> None:
        """Supervise until the trainer is done; the watchdog resubmits what dies or hangs. A storage fault
        anywhere in a tick is said, backed off and the tick retried (each of its steps is idempotent)."""
        while True:
            try:
                if self.tick():
                    break
            except Exception as e:
                if storage_fault(e) is None:
                    raise
                if self._interrupted():  # a signal or a cancel while the fault repeats: stop the run as asked
                    self._stop_if_asked()
                self.storage.pause(self.storage.fault(e, "watching the run"))
                continue
            self.storage.clear()  # a fault met in an earlier tick is over once there is room (said once)
            time.sleep(0.5)
        self.progress.maybe_print(force=True)
        _stop_rollouts(self.scheduler, self.jobs, self.cfg.launch.shutdown_timeout_s)
        self.storage.retry(lambda: finalize(self.run_dir, Fence(self.run_dir, self.owner.epoch)), "closing the run")
        removed = remove_all(self.run_dir)  # nothing writes any more (what cannot be removed is logged)
        if removed:
            log.info("removed the temporaries stopped writers left: %s", dict(removed))

    def tick(self) -> bool:
        """One look at every job; True when the run is done."""
        cfg, run_dir, jobs = self.cfg, self.run_dir, self.jobs
        if self.owner.superseded():
            raise RunTakenOver(f"owner epoch {self.owner.epoch + 1} claimed this run: stopping this supervisor's "
                               "components and leaving the run to it")
        self.owner.beat(cfg.launch.heartbeat_interval_s)
        if time.time() - self.cleaned > 600:  # temporaries of writers that died since (a live write takes seconds)
            Spool(run_dir / "spool").clean_tmp(older_than_s=3600)
            self.cleaned = time.time()
        self._retire_ended()
        self.sweeper.tick()
        self.progress.maybe_print()
        self._stop_if_asked()
        codes = {n: self.scheduler.poll(j) for n, (j, _) in jobs.items()}
        trainer_codes = [c for n, c in codes.items() if is_trainer(n)]
        done = (run_dir / "DONE").exists()
        if done and all(c == 0 for n, c in codes.items() if must_finish(n)):
            return True
        said = self.autoscaler.tick(self._room) if self.autoscaler is not None and not done else None
        if said:
            log.info("autoscale: %s", said)
        if not done and self._rescale(codes):
            return False  # job set changed: poll again
        if self._unpark():
            return False
        beats = read_heartbeats(run_dir)
        queued = _queued(self.scheduler, jobs, codes, self.waits)
        for name, code in codes.items():
            if name in self.draining or name in self.parked:
                continue
            if code == 0 and (not is_trainer(name) or None in trainer_codes or done):
                continue  # a rank that finished first, a rollout that saw DONE, a finished trainer (eval goes on)
            if queued[name]:
                self.watchdog.started(name)  # waiting for resources (or requeued): its heartbeat clock starts later
                continue
            code = 1 if code == 0 else code  # every trainer rank exited 0 but nobody wrote DONE
            if is_trainer(name) and EXIT_STORAGE in trainer_codes:
                code = EXIT_STORAGE  # one rank met the fault; the others died of losing it
            beat = beats.get(heartbeat_name(name, jobs[name][1]), {})
            decision = self.watchdog.assess(name, code, beat.get("time"))
            if decision.action != "ok":
                self._act(name, code, decision)
                return False  # job set changed: poll again
        return False

    def _room(self) -> bool:
        cfg = self.cfg
        return self.scheduler.has_room(rollout_spec(cfg, self.run_dir, 0), cfg.launch.autoscale.room_within_s)

    def _stop_if_asked(self) -> None:
        if self.preempt is not None and self.preempt.requested:
            why = signal.Signals(self.preempt.signum).name
            _stop_all(self.cfg, self.scheduler, self.jobs, self.events, f"supervisor received {why}")
            raise RunPreempted(f"stopped on {why}: every component checkpointed or was stopped")
        request = cancel_requested(self.run_dir)
        if request is not None:
            who = f"{request.get('user', '?')} on {request.get('host', '?')}"
            _stop_all(self.cfg, self.scheduler, self.jobs, self.events, f"cancel requested by {who}")
            raise RunCancelled(f"cancelled by {who}: every component checkpointed or was stopped")

    def _cancel(self, name: str, how: signal.Signals = signal.SIGKILL) -> None:
        job_id, spec = self.jobs[name]
        self.scheduler.cancel(job_id, how)
        self.stopping[job_id] = spec.env[ENV_INSTANCE]

    def _retire_ended(self) -> None:
        """Hand the sweep the instances whose jobs were stopped and are now seen ended (a Slurm cancel is
        asynchronous: a job may write for a while after it)."""
        for job_id, instance in list(self.stopping.items()):
            if self.scheduler.poll(job_id) is not None:
                self.sweeper.retired(instance)
                del self.stopping[job_id]

    def _act(self, name: str, code: int | None, decision: Decision) -> None:
        """Log the decision, then fail the run, or cancel the component (the whole trainer group) and resubmit
        it; a component that stopped on a storage fault is parked until the filesystem has room."""
        job_id, spec = self.jobs[name]
        event(self.events, name, job_id, decision)
        if decision.action == "fail":
            raise ComponentFailed(name, job_id, code if code is not None else -1,
                                  f"{decision.reason}\n{log_tail(spec.log_path)}")
        group = [n for n in self.jobs if is_trainer(n)] if is_trainer(name) else [name]
        if decision.storage:
            self.storage.stopped(group)
        else:
            log.warning("watchdog: %s", decision.reason)
        for n in group:
            self._cancel(n)
        if name.startswith("rollout"):
            self.storage.retry(lambda: self._reclaim(writer_of(name, spec)), f"reissuing {name}'s tickets")
        if decision.storage:
            due = time.monotonic() + decision.delay_s
            for n in group:
                self.parked[n] = due
            return
        time.sleep(decision.delay_s)
        self._resubmit(group, decision.reason)

    def _unpark(self) -> bool:
        """Resubmit the components parked on a storage fault once their back-off passed and the filesystem has
        room; True when any was."""
        due = [n for n, t in self.parked.items() if time.monotonic() >= t]
        if not due or not self.storage.has_room():
            return False
        self.storage.clear()
        for n in due:
            del self.parked[n]
        log.info("restarting %s (stopped on a storage fault)", ", ".join(due))
        self._resubmit(due, "the filesystem has room again after a storage fault")
        return True

    def _resubmit(self, group: list[str], reason: str) -> None:
        cfg, run_dir, jobs = self.cfg, self.run_dir, self.jobs
        fresh = {s.name: s for s in component_specs(cfg, run_dir)}  # a trainer group gets a new rendezvous port
        for n in group:
            if replica_of(n) is not None:
                fresh[n] = no_self_requeue(rollout_spec(cfg, run_dir, replica_of(n)))
        for n in group:
            if self.owner.superseded():  # never start a component for a replaced owner
                raise RunTakenOver(f"owner epoch {self.owner.epoch + 1} claimed this run while {n} was restarting")
            spec = stamp(fresh[n], self.owner)
            jobs[n] = (self.storage.retry(lambda: self.scheduler.submit(spec), f"resubmitting {n}"), spec)
            self.watchdog.started(n)
            log.info("watchdog: resubmitted %s as %s", n, jobs[n][0])
            event(self.events, n, jobs[n][0], Decision("start", f"resubmitted as {jobs[n][0]} after: {reason}"))
        self.storage.retry(lambda: write_registry(cfg, run_dir, jobs), "recording the jobs")

    def _rescale(self, codes: dict) -> bool:
        """Retire drained replicas that exited, then start or drain replicas toward the wanted count
        (:mod:`hpcrl.launch.fleet`); True when the job set changed."""
        cfg, run_dir, jobs, draining = self.cfg, self.run_dir, self.jobs, self.draining
        if cfg.launch.mode == "colocated":
            return False
        changed = False
        for name in [n for n in draining if codes.get(n) is not None or time.time() > draining[n]]:
            (job_id, spec), code = jobs[name], codes.get(name)
            if code is None:
                log.warning("%s did not stop within %.0fs of being drained; killing it", name,
                            cfg.launch.preempt_grace_s)
                self.scheduler.cancel(job_id, signal.SIGKILL)
            self.stopping[job_id] = spec.env[ENV_INSTANCE]
            self.storage.retry(lambda: self._reclaim(writer_of(name, spec)), f"reissuing {name}'s tickets")
            del jobs[name], draining[name]
            self.parked.pop(name, None)
            event(self.events, name, job_id, Decision("scale", f"{name} drained and retired (exit {code})"))
            changed = True
        start, drain = plan([n for n in jobs if n not in draining], wanted_replicas(cfg, run_dir))
        why = describe(scale_requested(run_dir))
        for name in drain:
            log.info("scale: draining %s (%s)", name, why)
            self.scheduler.cancel(jobs[name][0], signal.SIGUSR2)  # hand back, exit 75
            draining[name] = time.time() + cfg.launch.preempt_grace_s
            event(self.events, name, jobs[name][0], Decision("scale", f"draining {name}: {why}"))
        for name in start:
            spec = stamp(no_self_requeue(rollout_spec(cfg, run_dir, replica_of(name))), self.owner)
            jobs[name] = (self.storage.retry(lambda: self.scheduler.submit(spec), f"starting {name}"), spec)
            self.watchdog.started(name)
            log.info("scale: started %s (%s %s: %s)", name, scheduler_spec(cfg.launch.scheduler).job_word,
                     jobs[name][0], why)
            event(self.events, name, jobs[name][0], Decision("scale", f"started {name}: {why}"))
            event(self.events, name, jobs[name][0], Decision("start", f"submitted as {jobs[name][0]} (scaled up)"))
        if changed or start or drain:
            self.storage.retry(lambda: write_registry(cfg, run_dir, jobs), "recording the jobs")
        return changed or bool(start)

    def _reclaim(self, writer: str) -> None:
        """Reissue the tickets a dead rollout job instance held, so no prompt group is lost."""
        ledger = AdmissionLedger(self.run_dir / "admission", self.cfg.admission, num_rows=1,
                                 fence=Fence(self.run_dir, self.owner.epoch))
        lost = ledger.reclaim(writer, Spool(self.run_dir / "spool").live_tickets(), incarnations=True)
        if lost:
            log.warning("watchdog: reissued %d tickets held by dead rollout %s", len(lost), writer)


def _queued(scheduler: Scheduler, jobs: dict, codes: dict[str, int | None], waits: QueueWait) -> dict[str, bool]:
    """Which components' jobs wait in the scheduler's queue now (not running, not ended); each one's wait is
    noted, and said once it lasts (:class:`hpcrl.launch.progress.QueueWait`)."""
    queued = {n: c is None and scheduler.queued(jobs[n][0]) for n, c in codes.items()}
    for name, code in codes.items():
        waits.see(name, jobs[name][0], queued[name], ended=code is not None)
    return queued


def _stop_all(cfg: RunConfig, scheduler: Scheduler, jobs: dict, events: Path, why: str) -> None:
    """Ask every component to checkpoint and stop (SIGUSR2) and wait for them (``launch.preempt_grace_s``)."""
    grace = cfg.launch.preempt_grace_s
    log.warning("%s: asking every component to checkpoint and stop (grace %.0fs)", why, grace)
    for name, (job_id, _) in jobs.items():
        event(events, name, job_id, Decision("stop", why))
        scheduler.cancel(job_id, signal.SIGUSR2)
    deadline = time.time() + grace
    for name, (job_id, _) in jobs.items():
        code = scheduler.wait(job_id, max(0.1, deadline - time.time()))
        if code is None:
            log.warning("%s did not stop within %.0fs; killing it (a trainer resumes from its previous "
                        "checkpoint)", name, grace)
        else:
            log.info("%s stopped (exit %s)", name, code)


def _stop_rollouts(scheduler: Scheduler, jobs: dict, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    for name, (job_id, spec) in jobs.items():
        code = scheduler.wait(job_id, max(0.1, deadline - time.time()))
        if code is None:
            log.warning("%s did not exit %.0fs after the run ended; stopping it", name, timeout_s)
            scheduler.cancel(job_id)
        elif code != 0:
            log.warning("%s exited with code %s after the run ended:\n%s", name, code, log_tail(spec.log_path, 10))
