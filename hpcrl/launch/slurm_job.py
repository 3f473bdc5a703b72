"""What runs inside a component's Slurm job: the component's command line, once per task.

Kept free of heavy imports: submitit unpickles :class:`RunCommand` in every
task of the job before anything else. Each task appends its output to the
component's log (``{rank}`` in the path becomes ``SLURM_PROCID``), forwards
SIGTERM/SIGINT/SIGUSR2 to the component (submitit itself ignores SIGTERM),
and hands the component's exit code to the supervisor:

- 0 (done) and 75 (stopped to be restarted, e.g. at its walltime) are the
  job's result (submitit's result file); the job ends COMPLETED 0:0;
- any other code is written to ``exit.<task>.json`` in the job's submitit
  folder (an ``srun`` step, :func:`run_step`, writes every code to its own
  folder), and the task then ends the way the component did, so ``sacct``
  tells the truth: killed by signal N, the task kills itself with N (the
  job ends FAILED, exit code ``0:N``); exit code C, it exits C (FAILED
  ``C:0``). The scheduler reads the file (``SlurmScheduler.poll``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import json
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2)
RESULTS = (0, 75)  # codes that end the job COMPLETED: done, and stopped on purpose to be restarted


def exit_file(folder: str | Path, task: str | int) -> Path:
    return Path(folder) / f"exit.{task}.json"


class RunCommand:
    def __init__(self, argv: list[str], env: dict[str, str], log_path: str, folder: str = "") -> None:
        # folder: the job's submitit folder ("%j" = the job id), where a failing code is written
        self.argv, self.env, self.log_path, self.folder = list(argv), dict(env), log_path, folder

    def __call__(self) -> int:
        rank = os.environ.get("SLURM_PROCID", "0")
        folder = self.folder.replace("%j", job_name())
        if folder:  # a run of a job that Slurm requeued: the code the run before wrote is not this run's
            exit_file(folder, rank).unlink(missing_ok=True)
        path = Path(self.log_path.replace("{rank}", rank))
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as log:
            code = run_forwarding(self.argv, {**os.environ, **self.env}, log)
        if code in RESULTS or not self.folder:
            return code
        exit_file(folder, rank).write_text(json.dumps({"code": code, "time": time.time()}))
        end_like(code)
        return code  # not reached


def job_name() -> str:
    """This job's id as submitit names its folder: ``<array id>_<task>`` for a task of a job array."""
    if os.environ.get("SLURM_ARRAY_TASK_ID"):
        return f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID", "%j")


def run_forwarding(argv: list[str], env: dict[str, str], stdout=None) -> int:
    """Run ``argv`` to its end, forwarding SIGTERM/SIGINT/SIGUSR2 to it; its exit code (-N: signal N)."""
    proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.STDOUT if stdout else None,
                            stdin=subprocess.DEVNULL, env=env)
    previous = {s: signal.signal(s, lambda sig, _f: proc.send_signal(sig)) for s in FORWARDED}
    try:
        return proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def step_codes(folder: str | Path) -> dict[str, int]:
    """Task -> exit code, as :func:`run_step` wrote them for one ``srun`` step ({} before any task ended)."""
    return {p.name.split(".")[1]: int(json.loads(p.read_text())["code"]) for p in Path(folder).glob("exit.*.json")}


def run_step(folder: str | Path, argv: list[str]) -> None:
    """One task of an ``srun`` step (``python -m hpcrl.launch.slurm_job --codes DIR -- ARGV``).

    The component's code goes to ``DIR/exit.<task>.json`` for the supervisor, which runs the ``srun``
    and reads it (:meth:`hpcrl.launch.slurm.SrunScheduler.poll`); the task then ends so that the step's
    ``sacct`` record tells the truth: 0 and 75 (stopped to be restarted) end it COMPLETED 0:0, any
    other code or signal ends it the way the component ended.
    """
    code = run_forwarding(argv, dict(os.environ))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    exit_file(folder, os.environ.get("SLURM_PROCID", "0")).write_text(json.dumps({"code": code, "time": time.time()}))
    end_like(0 if code in RESULTS else code)


def end_like(code: int) -> None:
    """End this process the way the component ended: by the same signal, or with the same exit code."""
    if code < 0:
        sig = signal.Signals(-code)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(5)  # a signal whose default action does not end a process: exit with its number instead
        os._exit(128 - code)
    os._exit(code)


def append_note(log_path: str | Path, text: str) -> None:
    """Append a line from the scheduler to a component's log (so its tail explains what Slurm did)."""
    path = Path(str(log_path).replace("{rank}", "0"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"[{time.strftime('%H:%M:%S')}] [hpcrl.launch.slurm] {text}\n")


if __name__ == "__main__":
    import sys

    args = sys.argv[1:]
    if len(args) < 4 or args[0] != "--codes" or args[2] != "--":
        raise SystemExit("usage: python -m hpcrl.launch.slurm_job --codes DIR -- COMMAND...")
    run_step(args[1], args[3:])
