"""The scheduler boundary: start, watch and stop component processes.

:class:`LocalScheduler` runs every component as a local subprocess in its own
session (so a whole process tree can be signalled), with stdout and stderr
appended to a log file in the run directory. :mod:`hpcrl.launch.slurm`
implements the same Protocol with Slurm: each component its own job through
submitit (``SlurmScheduler``), or each component an ``srun`` step of one
heterogeneous allocation (``SrunScheduler``, used by
``sbatch/run_async_ppo.sh``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hpcrl.launch.config import ResourcesConfig


@dataclass
class ComponentSpec:
    name: str  # e.g. "trainer-r0", "rollout-1"
    argv: list[str]  # command line (python -m ...)
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)  # added to the parent's environment
    resources: ResourcesConfig | None = None  # what a Slurm job/step for it asks for (slurm and srun schedulers)
    tasks: int = 1  # processes of this component in one job (trainer ranks under Slurm); "{rank}" in log_path
    comment: str = ""  # Slurm job/step comment (squeue %k, sacct Comment): run, component, owner epoch, start


class ComponentFailed(RuntimeError):
    def __init__(self, name: str, job_id: str, exit_code: int, log_tail: str) -> None:
        super().__init__(f"{name} (job {job_id}) exited with code {exit_code}; last log lines:\n{log_tail}")
        self.name, self.job_id, self.exit_code, self.log_tail = name, job_id, exit_code, log_tail


class SubmitRejected(ComponentFailed):
    """The scheduler refused to start a component (e.g. sbatch rejected the job)."""

    def __init__(self, name: str, message: str) -> None:
        RuntimeError.__init__(self, f"{name}: the scheduler rejected the job: {message}")
        self.name, self.job_id, self.exit_code, self.log_tail = name, "", 1, message


class Scheduler(Protocol):
    def submit(self, spec: ComponentSpec) -> str: ...

    def poll(self, job_id: str) -> int | None: ...

    # several components with the same resources in one request (a Slurm job array), one id each, in order; a
    # scheduler without arrays submits them one by one
    def submit_array(self, specs: list[ComponentSpec]) -> list[str]: ...

    def cancel(self, job_id: str, sig: int = signal.SIGTERM) -> None: ...

    def wait(self, job_id: str, timeout: float) -> int | None: ...

    # whether the job waits for resources (a Slurm job pending, or requeued by a preemption): its component
    # does not run, so the watchdog does not expect its heartbeat and does not call it hung
    def queued(self, job_id: str) -> bool: ...

    # whether a job for ``spec`` would start within ``within_s`` seconds (the autoscaler adds a rollout replica
    # only then)
    def has_room(self, spec: ComponentSpec, within_s: float) -> bool: ...


class LocalScheduler:
    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}

    def submit(self, spec: ComponentSpec) -> str:
        spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log_path, "ab") as log:
            proc = subprocess.Popen(spec.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **spec.env}, start_new_session=True)
        self._procs[str(proc.pid)] = proc
        return str(proc.pid)

    def submit_array(self, specs: list[ComponentSpec]) -> list[str]:
        return [self.submit(spec) for spec in specs]

    def poll(self, job_id: str) -> int | None:
        return self._procs[job_id].poll()

    def cancel(self, job_id: str, sig: int = signal.SIGTERM) -> None:
        proc = self._procs[job_id]
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass

    def queued(self, job_id: str) -> bool:
        return False  # a process runs as soon as it is started

    def has_room(self, spec: ComponentSpec, within_s: float) -> bool:
        return True  # this host runs whatever it is given

    def wait(self, job_id: str, timeout: float) -> int | None:
        try:
            return self._procs[job_id].wait(timeout)
        except subprocess.TimeoutExpired:
            return None


def build_local(cfg, run_dir: Path) -> LocalScheduler:
    """``launch.scheduler: local`` (:mod:`hpcrl.launch.registry`)."""
    return LocalScheduler()


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def log_tail(path: Path, lines: int = 30) -> str:
    path = Path(str(path).replace("{rank}", "0"))  # a multi-task component: rank 0's log
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"
