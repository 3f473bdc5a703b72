"""The supervisor's records of the jobs it runs: each submission stamped with its owner epoch and instance,
``jobs/registry.json`` (who runs what, for a takeover and ``status``), ``jobs/events.jsonl`` (every decision),
and what a component's name says of its role.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

from hpcrl.fs import atomic
from hpcrl.config import RunConfig
from hpcrl.launch.registry import PROCESS_JOBS, scheduler_spec
from hpcrl.launch.scheduler import ComponentSpec
from hpcrl.launch.takeover import registry, start_ticks
from hpcrl.runtime.owner import ENV_EPOCH, ENV_INSTANCE, Owner
from hpcrl.fs.faults import as_storage_error, storage_fault
from hpcrl.watchdog.policy import Decision

log = logging.getLogger(__name__)


def stamp(spec: ComponentSpec, owner: Owner) -> ComponentSpec:
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


def write_registry(cfg: RunConfig, run_dir: Path, jobs: dict) -> None:
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


def is_trainer(name: str) -> bool:
    return name.startswith(("trainer", "colocated"))


def must_finish(name: str) -> bool:
    """Components the run waits for: the trainer, and the evaluation component (the final version's accuracy)."""
    return is_trainer(name) or name == "eval"


def heartbeat_name(name: str, spec: ComponentSpec) -> str:
    """The heartbeat of this job instance (a Slurm trainer job: rank 0 speaks for it)."""
    return f"{'trainer-r0' if name == 'trainer' else name}@{spec.env[ENV_INSTANCE]}"


def writer_of(name: str, spec: ComponentSpec) -> str:
    """The writer id a rollout job instance uses (``hpcrl.rollout.main``)."""
    return f"r{name.removeprefix('rollout-')}-{spec.env[ENV_INSTANCE]}"


def event(path: Path, name: str, job_id: str, decision: Decision) -> None:
    """Append the decision to ``jobs/events.jsonl``; on a storage fault the line is left out (the log has it):
    the record of a decision must not stop the supervisor from carrying it out."""
    line = json.dumps({"time": time.time(), "component": name, "job_id": job_id, "action": decision.action,
                       "reason": decision.reason})
    try:
        atomic.append_line(path, line)
    except OSError as e:
        if storage_fault(e) is None:
            raise
        log.warning("event not recorded in %s (%s): %s", path, as_storage_error(e, "event append", path),
                    line)
