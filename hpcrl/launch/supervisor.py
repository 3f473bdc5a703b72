"""The supervisor: start every component of a run, watch them, stop them.

Lifecycle: claim the run with a new owner epoch (design.md §4.7, :mod:`hpcrl.runtime.owner`) -> stop what a
previous owner left running and remove its writers' temporaries (:mod:`hpcrl.launch.takeover`) -> submit every
component (:mod:`hpcrl.launch.specs`) through the scheduler ``launch.scheduler`` names (local processes, a Slurm
job each, or srun steps of one allocation), each stamped with the epoch and a fresh instance id and recorded in
``jobs/`` (:mod:`hpcrl.launch.jobs`) -> watch them until the trainer wrote ``DONE`` (:class:`hpcrl.launch.watch.
Watch`: the watchdog's restarts, scaling, storage faults, the run's close) -> release the epoch.

How it ends: normally; :class:`ComponentFailed` when a component's restart budget is spent (with its log's
tail); :class:`RunTakenOver` when a newer owner claimed the run; :class:`RunPreempted` on SIGUSR2/SIGTERM
(every component was asked to checkpoint within ``launch.preempt_grace_s``; ``hpcrl.submit`` asks Slurm to
requeue and exits 75); :class:`RunCancelled` on ``python -m hpcrl cancel``. A storage fault never ends it
(design.md §4.12): its writes retry and what stopped on the fault restarts once there is room.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

from hpcrl.config import RunConfig
from hpcrl.launch.jobs import event, stamp, write_registry
from hpcrl.launch.control import cancel_requested
from hpcrl.launch.fleet import replica_of
from hpcrl.launch.registry import scheduler_spec
from hpcrl.launch.scheduler import ComponentFailed, ComponentSpec, Scheduler
from hpcrl.launch.specs import component_specs
from hpcrl.launch.takeover import clean_temporaries, take_over
from hpcrl.launch.watch import RunCancelled, RunPreempted, RunTakenOver, Watch
from hpcrl.plugins import resolve
from hpcrl.runtime.owner import Owner, claim
from hpcrl.runtime.preempt import PreemptionFlag
from hpcrl.fs.faults import as_storage_error, storage_fault
from hpcrl.watchdog.policy import Decision

__all__ = ["ComponentFailed", "RunCancelled", "RunPreempted", "RunTakenOver", "component_specs", "make_scheduler", "supervise"]
log = logging.getLogger(__name__)


def make_scheduler(cfg: RunConfig, run_dir: Path) -> Scheduler:
    """The scheduler ``launch.scheduler`` names, built by its spec (its module imported here: submitit only
    where Slurm is used)."""
    return resolve(scheduler_spec(cfg.launch.scheduler).build, "launch.scheduler")(cfg, run_dir)


def supervise(cfg: RunConfig, run_dir: Path, scheduler: Scheduler | None = None,
              preempt: PreemptionFlag | None = None) -> None:
    """Run all components to completion; raise ComponentFailed if one fails, RunPreempted on a signal
    (``preempt``: the caller's flag, installed early; by default one is installed here)."""
    scheduler = scheduler or make_scheduler(cfg, run_dir)
    jobs: dict[str, tuple[str, ComponentSpec]] = {}
    # signal handlers can only be set from the main thread (tests may supervise from another one)
    own = preempt is None and threading.current_thread() is threading.main_thread()
    preempt = PreemptionFlag() if own else preempt
    owner = claim(run_dir, scheduler=cfg.launch.scheduler)
    log.info("owner epoch %d claimed (%s)", owner.epoch, owner.path)
    try:
        if take_over(cfg, run_dir, owner.epoch):
            clean_temporaries(run_dir)  # nothing of the previous owner runs any more
        if preempt is not None and preempt.requested:
            raise RunPreempted(f"stopped on {signal.Signals(preempt.signum).name} before the components started")
        if cancel_requested(run_dir) is not None:
            raise RunCancelled("cancelled before the components started")
        _submit_all(cfg, run_dir, scheduler, jobs, owner)
        Watch(cfg, run_dir, scheduler, jobs, owner, preempt).run()
    finally:
        for job_id, _ in jobs.values():
            scheduler.cancel(job_id, signal.SIGKILL)
        _release(owner)
        if own:
            preempt.close()


def _release(owner: Owner) -> None:
    try:
        owner.release()
    except OSError as e:  # a full filesystem: the components then wait out launch.orphan_grace_s
        if storage_fault(e) is None:
            raise
        log.warning("could not mark owner epoch %d released (%s)", owner.epoch, as_storage_error(e, "release"))


def _submit_all(cfg: RunConfig, run_dir: Path, scheduler: Scheduler, jobs: dict, owner: Owner) -> None:
    (run_dir / "jobs").mkdir(exist_ok=True)
    specs = component_specs(cfg, run_dir)
    rollouts = [s for s in specs if replica_of(s.name) is not None]  # one request (a Slurm job array)
    for batch in [[s] for s in specs if s not in rollouts] + ([rollouts] if rollouts else []):
        for spec, job_id in zip(batch, scheduler.submit_array([stamp(s, owner) for s in batch])):
            jobs[spec.name] = (job_id, spec)
            word = scheduler_spec(cfg.launch.scheduler).job_word
            log.info("started %s (%s %s), log %s", spec.name, word, job_id, spec.log_path)
            event(run_dir / "jobs" / "events.jsonl", spec.name, job_id,
                  Decision("start", f"submitted as {word} {job_id} (owner epoch {owner.epoch})"))
        write_registry(cfg, run_dir, jobs)
