"""The supervisor: start every component of a run, watch them, stop them.

Lifecycle: build the component list from the config (trainer ranks and
rollout replicas, or the one colocated process; under Slurm the trainer is
one job/step whose tasks are its ranks, and every spec carries the
resources of its component) -> choose the scheduler (``launch.scheduler``,
:mod:`hpcrl.launch.registry`: local processes, a Slurm job per component, or
srun steps of one allocation) -> submit each and record its job id in ``<run_dir>/jobs/``
(a rejected submission cancels what was already submitted) -> loop: print a
progress line from ``logs/metrics.jsonl``, check every job -> the run ends
when the trainer ranks exit 0 after writing ``DONE`` and, with
``eval.mode: component``, the evaluation component exits 0 after recording
the final version (rollouts exit by themselves once ``DONE`` is written, or
are stopped after a grace period). A component that dies or
hangs is cancelled and resubmitted by the watchdog
(:mod:`hpcrl.watchdog.policy`); when its budget is spent the others are
stopped and :class:`ComponentFailed` carries the failing log's tail.

Ownership (design.md §4.7, :mod:`hpcrl.runtime.owner`): before anything else
the supervisor claims the run with a new owner epoch. It then stops what a
previous owner left running (:mod:`hpcrl.launch.takeover`: the processes and
jobs in ``jobs/registry.json``; each sees the new epoch and exits by itself,
or is killed after ``launch.takeover_timeout_s``), removes their temporary
files, and only then starts its own components, each with its epoch and a
fresh instance id (``HPCRL_EPOCH``, ``HPCRL_INSTANCE``). While it watches
it touches its epoch file (components stop cleanly when it stays silent for
``launch.orphan_grace_s``); when a newer owner appears it stops its own jobs
and raises :class:`RunTakenOver`.

Walltime and preemption of the supervisor's own job: on SIGUSR2 or SIGTERM
(``sbatch --signal=B:USR2@N``, ``scancel``, a preempting scheduler) the
supervisor forwards SIGUSR2 to every component, gives them
``launch.preempt_grace_s`` to checkpoint and exit (killing what is left),
and raises :class:`RunPreempted`; ``hpcrl.submit`` then asks Slurm to
requeue the job and exits 75. Nothing is lost: the trainer resumes from the
checkpoint it just wrote, rollouts from the ledger.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import threading
import time
from pathlib import Path

from hpcrl import atomic
from hpcrl.config import RunConfig
from hpcrl.runtime.net import free_port
from hpcrl.launch.registry import PROCESS_JOBS, scheduler_spec
from hpcrl.launch.scheduler import ComponentFailed, ComponentSpec, Scheduler, log_tail, python_module
from hpcrl.plugins import resolve
from hpcrl.admission.ledger import AdmissionLedger
from hpcrl.launch.control import cancel_requested
from hpcrl.launch.finalize import finalize
from hpcrl.launch.progress import Progress, QueueWait
from hpcrl.launch.autoscale import Autoscaler
from hpcrl.launch.fleet import describe, plan, replica_of, scale_requested, wanted_replicas
from hpcrl.runtime.heartbeat import read_heartbeats
from hpcrl.runtime.preempt import PreemptionFlag
from hpcrl.launch.takeover import clean_temporaries, registry, start_ticks, take_over
from hpcrl.runtime.owner import ENV_EPOCH, ENV_INSTANCE, Fence, Owner, claim
from hpcrl.spool.store import Spool
from hpcrl.watchdog.policy import Decision, Watchdog

log = logging.getLogger(__name__)


def component_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """Every component of the run. The watchdog restarts them, so none asks Slurm to requeue itself
    (a self-requeued job beside the watchdog's resubmission would be a second trainer)."""
    return [_no_self_requeue(spec) for spec in _specs(cfg, run_dir)]


def _no_self_requeue(spec: ComponentSpec) -> ComponentSpec:
    spec.env["HPCRL_SLURM_REQUEUE"] = "0"
    return spec


def _rollout_spec(cfg: RunConfig, run_dir: Path, k: int) -> ComponentSpec:
    """Rollout replica ``k``: its own process or job, with the resources of ``launch.rollout``."""
    return ComponentSpec(f"rollout-{k}", python_module("hpcrl.rollout", "--run-dir", str(run_dir), "--replica", str(k)),
                         run_dir / "logs" / f"rollout-{k}.log", resources=cfg.launch.rollout)


def _specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    return _trainer_rollout_specs(cfg, run_dir) + _eval_specs(cfg, run_dir) + _reward_specs(cfg, run_dir)


def _reward_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """The reward service (``reward.service``), with the resources of ``launch.reward``."""
    if not cfg.reward.service:
        return []
    return [ComponentSpec("reward", python_module("hpcrl.reward", "--run-dir", str(run_dir)),
                          run_dir / "logs" / "reward.log", resources=cfg.launch.reward)]


def _eval_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """The evaluation component (``eval.mode: component``), with the resources of ``launch.eval``."""
    if cfg.eval.mode != "component":
        return []
    return [ComponentSpec("eval", python_module("hpcrl.eval", "--run-dir", str(run_dir)),
                          run_dir / "logs" / "eval.log", resources=cfg.launch.eval)]


def _trainer_rollout_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    logs = run_dir / "logs"
    rd = ["--run-dir", str(run_dir)]
    if cfg.launch.mode == "colocated":
        return [ComponentSpec("colocated", python_module("hpcrl.colocated", *rd), logs / "colocated.log")]
    if scheduler_spec(cfg.launch.scheduler).places_ranks:
        return _job_specs(cfg, run_dir)
    world, port = cfg.trainer.world_size, str(free_port())
    specs = [ComponentSpec(f"trainer-r{r}", python_module("hpcrl.trainer", *rd), logs / f"trainer-r{r}.log",
                           {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world),
                            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(world)]
    return specs + [_rollout_spec(cfg, run_dir, k) for k in range(wanted_replicas(cfg, run_dir))]


def _job_specs(cfg: RunConfig, run_dir: Path) -> list[ComponentSpec]:
    """For a scheduler that places ranks: one trainer job/step with world_size tasks (ranks from
    SLURM_PROCID), one per rollout replica."""
    logs, rd = run_dir / "logs", ["--run-dir", str(run_dir)]
    if cfg.launch.mode == "colocated":
        return [ComponentSpec("colocated", python_module("hpcrl.colocated", *rd), logs / "colocated.log",
                              resources=cfg.launch.trainer)]
    specs = [ComponentSpec("trainer", python_module("hpcrl.trainer", *rd), logs / "trainer-r{rank}.log",
                           resources=cfg.launch.trainer, tasks=cfg.trainer.world_size)]
    return specs + [_rollout_spec(cfg, run_dir, k) for k in range(wanted_replicas(cfg, run_dir))]


def make_scheduler(cfg: RunConfig, run_dir: Path) -> Scheduler:
    """The scheduler ``launch.scheduler`` names, built by its spec (its module imported here: submitit only
    where Slurm is used)."""
    return resolve(scheduler_spec(cfg.launch.scheduler).build, "launch.scheduler")(cfg, run_dir)


class RunTakenOver(RuntimeError):
    """A newer owner (another ``--resume``) claimed the run: this supervisor stopped its components."""


class RunCancelled(RuntimeError):
    """``python -m hpcrl cancel`` asked the run to stop: every component was asked to checkpoint and stop, and
    the run is not requeued; it continues with ``python -m hpcrl.submit --resume``."""


class RunPreempted(RuntimeError):
    """The supervisor was signalled (walltime, preemption, scancel): every component was asked to
    checkpoint and stop; the run continues with ``python -m hpcrl.submit --resume``."""


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
        _watch(cfg, run_dir, scheduler, jobs, owner, preempt)
    finally:
        for job_id, _ in jobs.values():
            scheduler.cancel(job_id, signal.SIGKILL)
        owner.release()
        if own:
            preempt.close()


def _stamp(spec: ComponentSpec, owner: Owner) -> ComponentSpec:
    """Give a spec its owner epoch, a fresh instance id (the writer id and heartbeat of the process) and the
    comment its Slurm job carries."""
    owner.submissions += 1
    owner.starts[spec.name] = owner.starts.get(spec.name, 0) + 1
    spec.env[ENV_EPOCH] = str(owner.epoch)
    spec.env[ENV_INSTANCE] = f"e{owner.epoch}n{owner.submissions}"
    # what sacct/squeue users see beside the job name: which run, which start of the component
    spec.comment = "".join(f"hpcrl,run={owner.run_dir.resolve()},component={spec.name},epoch={owner.epoch},"
                           f"instance={spec.env[ENV_INSTANCE]},start={owner.starts[spec.name]}".split())
    return spec


def _submit_all(cfg: RunConfig, run_dir: Path, scheduler: Scheduler, jobs: dict, owner: Owner) -> None:
    (run_dir / "jobs").mkdir(exist_ok=True)
    specs = component_specs(cfg, run_dir)
    rollouts = [s for s in specs if replica_of(s.name) is not None]  # one request (a Slurm job array)
    for batch in [[s] for s in specs if s not in rollouts] + ([rollouts] if rollouts else []):
        for spec, job_id in zip(batch, scheduler.submit_array([_stamp(s, owner) for s in batch])):
            jobs[spec.name] = (job_id, spec)
            word = scheduler_spec(cfg.launch.scheduler).job_word
            log.info("started %s (%s %s), log %s", spec.name, word, job_id, spec.log_path)
            _event(run_dir / "jobs" / "events.jsonl", spec.name, job_id,
                   Decision("start", f"submitted as {word} {job_id} (owner epoch {owner.epoch})"))
        _write_registry(cfg, run_dir, jobs)


def _write_registry(cfg: RunConfig, run_dir: Path, jobs: dict) -> None:
    """Who runs what, for a take-over and ``python -m hpcrl status``; a ``srun`` step's job id is the local
    ``srun`` pid, so its allocation and step name (as ``sacct``/``squeue --steps`` show them) are added."""
    host = socket.gethostname()
    sched = scheduler_spec(cfg.launch.scheduler)
    known = registry(run_dir)

    def started(name: str, job, instance: str) -> dict:  # read once: the pid may be reused after it ends
        if sched.jobs != PROCESS_JOBS:
            return {}
        rec = known.get(name, {})
        same = str(rec.get("job_id")) == str(job) and rec.get("instance") == instance and "start_ticks" in rec
        return {"start_ticks": rec["start_ticks"] if same else start_ticks(int(job))}

    atomic.write_json(run_dir / "jobs" / "registry.json",
                      {n: {"job_id": j, "scheduler": cfg.launch.scheduler, "jobs": sched.jobs, "argv": s.argv,
                           "tasks": s.tasks, "host": host, "epoch": int(s.env[ENV_EPOCH]),
                           "instance": s.env[ENV_INSTANCE], **started(n, j, s.env[ENV_INSTANCE]),
                           **(sched.record(n) if sched.record else {})}
                       for n, (j, s) in jobs.items()})


def _is_trainer(name: str) -> bool:
    return name.startswith(("trainer", "colocated"))


def _must_finish(name: str) -> bool:
    """Components the run waits for: the trainer, and the evaluation component (the final version's accuracy)."""
    return _is_trainer(name) or name == "eval"


def _heartbeat_name(name: str, spec: ComponentSpec) -> str:
    """The heartbeat of this job instance (a Slurm trainer job: rank 0 speaks for it)."""
    return f"{'trainer-r0' if name == 'trainer' else name}@{spec.env[ENV_INSTANCE]}"


def _writer(name: str, spec: ComponentSpec) -> str:
    """The writer id a rollout job instance uses (``hpcrl.rollout.main``)."""
    return f"r{name.removeprefix('rollout-')}-{spec.env[ENV_INSTANCE]}"


def _watch(cfg: RunConfig, run_dir: Path, scheduler: Scheduler, jobs: dict, owner: Owner,
           preempt: PreemptionFlag | None = None) -> None:
    """Supervise until the trainer is done; the watchdog resubmits what dies or hangs."""
    progress = Progress(run_dir / "logs" / "metrics.jsonl", cfg.trainer.total_steps, cfg.launch.progress_interval_s)
    waits = QueueWait(run_dir, after_s=cfg.launch.queue_note_s)
    watchdog, events = Watchdog(cfg.watchdog), run_dir / "jobs" / "events.jsonl"
    for name in jobs:
        watchdog.started(name)
    cleaned, draining = time.time(), {}  # draining: replica -> when it is killed if it has not exited
    autoscaler = Autoscaler(cfg, run_dir) if cfg.launch.autoscale.enabled else None
    room = (lambda: scheduler.has_room(_rollout_spec(cfg, run_dir, 0), cfg.launch.autoscale.room_within_s))
    while True:
        if owner.superseded():
            raise RunTakenOver(f"owner epoch {owner.epoch + 1} claimed this run: stopping this supervisor's "
                               "components and leaving the run to it")
        owner.beat(cfg.launch.heartbeat_interval_s)
        if time.time() - cleaned > 600:  # temporaries of writers that died since (a live write takes seconds)
            Spool(run_dir / "spool").clean_tmp(older_than_s=3600)
            cleaned = time.time()
        progress.maybe_print()
        if preempt is not None and preempt.requested:
            _stop_all(cfg, scheduler, jobs, events, f"supervisor received {signal.Signals(preempt.signum).name}")
            raise RunPreempted(f"stopped on {signal.Signals(preempt.signum).name}: every component checkpointed "
                               "or was stopped")
        request = cancel_requested(run_dir)
        if request is not None:
            who = f"{request.get('user', '?')} on {request.get('host', '?')}"
            _stop_all(cfg, scheduler, jobs, events, f"cancel requested by {who}")
            raise RunCancelled(f"cancelled by {who}: every component checkpointed or was stopped")
        codes = {n: scheduler.poll(j) for n, (j, _) in jobs.items()}
        trainer_codes = [c for n, c in codes.items() if _is_trainer(n)]
        done = (run_dir / "DONE").exists()
        if done and all(c == 0 for n, c in codes.items() if _must_finish(n)):
            break
        said = autoscaler.tick(room) if autoscaler is not None and not done else None
        if said:
            log.info("autoscale: %s", said)
        if not done and _rescale(cfg, run_dir, scheduler, jobs, codes, draining, watchdog, owner, events):
            continue  # job set changed: poll again
        beats = read_heartbeats(run_dir)
        queued = _queued(scheduler, jobs, codes, waits)
        for name, code in codes.items():
            if name in draining:
                continue
            if code == 0 and (not _is_trainer(name) or None in trainer_codes or done):
                continue  # a rank that finished first, a rollout that saw DONE, a finished trainer (eval goes on)
            if queued[name]:
                watchdog.started(name)  # waiting for resources (or requeued): its heartbeat clock starts later
                continue
            code = 1 if code == 0 else code  # every trainer rank exited 0 but nobody wrote DONE
            beat = beats.get(_heartbeat_name(name, jobs[name][1]), {})
            decision = watchdog.assess(name, code, beat.get("time"))
            if decision.action != "ok":
                _act(cfg, run_dir, scheduler, jobs, watchdog, name, code, decision, owner, events)
                break  # job set changed: poll again
        time.sleep(0.5)
    progress.maybe_print(force=True)
    _stop_rollouts(scheduler, jobs, cfg.launch.shutdown_timeout_s)
    finalize(run_dir, Fence(run_dir, owner.epoch))


def _queued(scheduler: Scheduler, jobs: dict, codes: dict[str, int | None], waits: QueueWait) -> dict[str, bool]:
    """Which components' jobs wait in the scheduler's queue now (not running, not ended); each one's wait is
    noted, and said once it lasts (:class:`hpcrl.launch.progress.QueueWait`)."""
    queued = {n: c is None and scheduler.queued(jobs[n][0]) for n, c in codes.items()}
    for name, code in codes.items():
        waits.see(name, jobs[name][0], queued[name], ended=code is not None)
    return queued


def _act(cfg: RunConfig, run_dir: Path, scheduler: Scheduler, jobs: dict, watchdog: Watchdog, name: str,
         code: int | None, decision: Decision, owner: Owner, events: Path) -> None:
    """Log the decision, then fail the run or cancel and resubmit the component (the whole trainer group)."""
    job_id, spec = jobs[name]
    _event(events, name, job_id, decision)
    if decision.action == "fail":
        raise ComponentFailed(name, job_id, code if code is not None else -1,
                              f"{decision.reason}\n{log_tail(spec.log_path)}")
    log.warning("watchdog: %s", decision.reason)
    group = [n for n in jobs if _is_trainer(n)] if _is_trainer(name) else [name]
    for n in group:
        scheduler.cancel(jobs[n][0], signal.SIGKILL)
    if name.startswith("rollout"):
        _reclaim(run_dir, cfg, _writer(name, spec), owner)
    time.sleep(decision.delay_s)
    fresh = {s.name: s for s in component_specs(cfg, run_dir)}  # a trainer group gets a new rendezvous port
    if replica_of(name) is not None:
        fresh[name] = _no_self_requeue(_rollout_spec(cfg, run_dir, replica_of(name)))
    for n in group:
        if owner.superseded():  # never start a component for a replaced owner
            raise RunTakenOver(f"owner epoch {owner.epoch + 1} claimed this run while {n} was restarting")
        jobs[n] = (scheduler.submit(_stamp(fresh[n], owner)), fresh[n])
        watchdog.started(n)
        log.info("watchdog: resubmitted %s as %s", n, jobs[n][0])
        _event(events, n, jobs[n][0], Decision("start", f"resubmitted as {jobs[n][0]} after: {decision.reason}"))
    _write_registry(cfg, run_dir, jobs)


def _rescale(cfg: RunConfig, run_dir: Path, scheduler: Scheduler, jobs: dict, codes: dict, draining: dict,
             watchdog: Watchdog, owner: Owner, events: Path) -> bool:
    """Retire drained replicas that exited, then start or drain replicas toward the wanted count
    (:mod:`hpcrl.launch.fleet`); True when the job set changed."""
    if cfg.launch.mode == "colocated":
        return False
    changed = False
    for name in [n for n in draining if codes.get(n) is not None or time.time() > draining[n]]:
        (job_id, spec), code = jobs.pop(name), codes.get(name)
        del draining[name]
        if code is None:
            log.warning("%s did not stop within %.0fs of being drained; killing it", name, cfg.launch.preempt_grace_s)
            scheduler.cancel(job_id, signal.SIGKILL)
        _reclaim(run_dir, cfg, _writer(name, spec), owner)
        _event(events, name, job_id, Decision("scale", f"{name} drained and retired (exit {code})"))
        changed = True
    start, drain = plan([n for n in jobs if n not in draining], wanted_replicas(cfg, run_dir))
    why = describe(scale_requested(run_dir))
    for name in drain:
        log.info("scale: draining %s (%s)", name, why)
        scheduler.cancel(jobs[name][0], signal.SIGUSR2)  # hand back, exit 75
        draining[name] = time.time() + cfg.launch.preempt_grace_s
        _event(events, name, jobs[name][0], Decision("scale", f"draining {name}: {why}"))
    for name in start:
        spec = _no_self_requeue(_rollout_spec(cfg, run_dir, replica_of(name)))
        jobs[name] = (scheduler.submit(_stamp(spec, owner)), spec)
        watchdog.started(name)
        log.info("scale: started %s (%s %s: %s)", name, scheduler_spec(cfg.launch.scheduler).job_word, jobs[name][0], why)
        _event(events, name, jobs[name][0], Decision("scale", f"started {name}: {why}"))
        _event(events, name, jobs[name][0], Decision("start", f"submitted as {jobs[name][0]} (scaled up)"))
    if changed or start or drain:
        _write_registry(cfg, run_dir, jobs)
    return changed or bool(start)


def _reclaim(run_dir: Path, cfg: RunConfig, writer: str, owner: Owner) -> None:
    """Reissue the tickets a dead rollout job instance held, so no prompt group is lost."""
    ledger = AdmissionLedger(run_dir / "admission", cfg.admission, num_rows=1, fence=Fence(run_dir, owner.epoch))
    lost = ledger.reclaim(writer, Spool(run_dir / "spool").live_tickets(), incarnations=True)
    if lost:
        log.warning("watchdog: reissued %d tickets held by dead rollout %s", len(lost), writer)


def _event(path: Path, name: str, job_id: str, decision: Decision) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"time": time.time(), "component": name, "job_id": job_id,
                            "action": decision.action, "reason": decision.reason}) + "\n")


def _stop_all(cfg: RunConfig, scheduler: Scheduler, jobs: dict, events: Path, why: str) -> None:
    """Ask every component to checkpoint and stop (SIGUSR2) and wait for them (``launch.preempt_grace_s``)."""
    grace = cfg.launch.preempt_grace_s
    log.warning("%s: asking every component to checkpoint and stop (grace %.0fs)", why, grace)
    for name, (job_id, _) in jobs.items():
        _event(events, name, job_id, Decision("stop", why))
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
