"""The scheduler registry: the one place that maps ``launch.scheduler`` to an implementation.

A :class:`SchedulerSpec` says how to build the scheduler (a
:class:`~hpcrl.launch.scheduler.Scheduler`), how a component of several
ranks is started under it, what a dry run shows of each request, what the
run's job registry (``jobs/registry.json``) records of its jobs, and how a
recorded job is reached afterwards: by ``status``, ``cancel`` and the next
owner's take-over (:mod:`hpcrl.launch.takeover`), which may run on another
host and long after the scheduler object is gone. That last one is a kind
of job, written into each record (``"jobs"``), so those commands read it
from the record and import no scheduler:

- ``process`` (:data:`PROCESS_JOBS`): a process group on the host that
  recorded it, its pid the job id (the ``local`` scheduler; ``srun``, whose
  job is the ``srun`` process of one step);
- ``slurm`` (:data:`SLURM_JOBS`): a job id that Slurm knows, reached with
  ``squeue``/``sacct``/``scancel`` from any host of the cluster.

:data:`SCHEDULERS` holds the built-in ones (``local``, ``slurm``, ``srun``);
:func:`register_scheduler` adds one within a process, and a config names one
of its own by import path (``launch.scheduler: my_pkg.sched:SPEC``).

This module is light (no torch, no submitit): the config layer imports it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcrl.plugins import Registry

__all__ = ["PROCESS_JOBS", "SCHEDULERS", "SLURM_JOBS", "SchedulerSpec", "jobs_of", "register_scheduler",
           "scheduler_spec"]

PROCESS_JOBS = "process"  # a job id is a pid on the recording host: its process group is the job
SLURM_JOBS = "slurm"  # a job id is Slurm's: squeue/sacct/scancel reach it from any host of the cluster


@dataclass(frozen=True)
class SchedulerSpec:
    name: str
    # (cfg: RunConfig, run_dir: Path) -> Scheduler, or its "module:function" (imported when a run starts)
    build: str | Callable[..., Any]
    # True: a component of N ranks is one job of N tasks, which the scheduler starts and numbers (SLURM_PROCID);
    # False: one job per rank, given its rank and a rendezvous on this host by the supervisor
    places_ranks: bool = False
    jobs: str = PROCESS_JOBS  # how a recorded job is reached afterwards (PROCESS_JOBS or SLURM_JOBS)
    # (cfg, spec: ComponentSpec, run_dir, scratch: Path) -> (would it be taken, what it would be asked), or its
    # "module:function": the dry run's line per component; None: the command line
    describe: str | Callable[..., tuple[bool, str]] | None = None
    # (component name) -> extra fields of its job record, e.g. the allocation a step runs in; or None
    record: Callable[[str], dict] | None = None
    job_word: str = "job"  # how logs name a job id ("pid")

    def __post_init__(self) -> None:
        if self.jobs not in (PROCESS_JOBS, SLURM_JOBS):
            raise ValueError(f"launch.scheduler: {self.name!r}: jobs must be {PROCESS_JOBS!r} or {SLURM_JOBS!r}, "
                             f"got {self.jobs!r}")

    def describe_request(self, cfg: Any, spec: Any, run_dir: Path, scratch: Path) -> tuple[bool, str]:
        """What this scheduler would be asked to start ``spec`` (a ComponentSpec of the run config ``cfg``), and
        whether it would take it (the dry run). Untyped: this module belongs to the config layer, which imports
        no component."""
        if self.describe is None:
            env = " ".join(f"{k}={v}" for k, v in sorted(spec.env.items()))
            return True, f"{env} {' '.join(spec.argv)}".strip()
        from hpcrl.plugins import resolve

        return resolve(self.describe, "launch.scheduler")(cfg, spec, run_dir, scratch)


def _srun_step(name: str) -> dict:
    """A step of the allocation this supervisor runs in: what ``sacct``/``squeue --steps`` show of it."""
    return {"allocation": os.environ.get("SLURM_JOB_ID"), "step_name": f"hpcrl-{name}"}


SCHEDULERS = Registry("launch.scheduler", SchedulerSpec)
register_scheduler = SCHEDULERS.register  # make a spec a choice of launch.scheduler (within this process)
scheduler_spec = SCHEDULERS.lookup  # the spec a value of launch.scheduler names (a registered name, or module:attr)


def jobs_of(rec: dict) -> str:
    """How a job record is reached: its own ``jobs`` field, or (a record written before it existed) its
    scheduler's."""
    return rec.get("jobs") or scheduler_spec(rec.get("scheduler") or "local").jobs


register_scheduler(SchedulerSpec("local", build="hpcrl.launch.scheduler:build_local", job_word="pid"))
register_scheduler(SchedulerSpec("slurm", build="hpcrl.launch.slurm:build_slurm", places_ranks=True, jobs=SLURM_JOBS,
                                 describe="hpcrl.launch.dry_run:describe_sbatch"))
register_scheduler(SchedulerSpec("srun", build="hpcrl.launch.slurm:build_srun", places_ranks=True,
                                 describe="hpcrl.launch.dry_run:describe_srun", record=_srun_step))
