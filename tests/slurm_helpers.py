"""Shared helpers of the tests against the real local Slurm cluster (scripts/slurm_cluster.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hpcrl.metrics.writer import read_metrics

ROOT = Path(__file__).resolve().parents[1]
START = "bash scripts/slurm_cluster.sh start"

# the fast override set of tests/test_e2e.py (tiny model, no SFT)
FAST = ["model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
        "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4", "rollout.max_batch_size=8",
        "rollout.max_new_tokens=4", "eval.every_steps=4", "eval.size=40", "launch.progress_interval_s=1"]


def cluster_skip_reason() -> str | None:
    """Why the Slurm tests cannot run here, or None when the two-node cluster with sacct is up."""
    if shutil.which("sinfo") is None:
        return f"sinfo not found: no Slurm here (start the test cluster with `{START}`)"
    try:
        nodes = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=20)
        acct = subprocess.run(["sacct", "-n", "-X", "-S", "now-1minutes"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return f"Slurm does not answer (start the test cluster with `{START}`)"
    if nodes.returncode != 0:
        return f"Slurm is not up: {nodes.stderr.strip()} (start it with `{START}`)"
    up = {ln for ln in nodes.stdout.splitlines() if ln.split()[-1].rstrip("*") in ("idle", "mix", "alloc", "comp")}
    if len(up) < 2:
        return f"the Slurm test cluster needs 2 usable nodes, found: {nodes.stdout.strip()!r} (`{START}`)"
    if acct.returncode != 0:
        return f"sacct does not work (slurmdbd down?): {acct.stderr.strip()} (`{START}`)"
    return None


def job_env() -> dict[str, str]:
    """The environment a run's jobs inherit (sbatch exports it): the repo importable, no hub access."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def run_args(run_dir: Path, cache: Path, *overrides: str) -> list[str]:
    return [f"run_dir={run_dir}", f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data", *FAST,
            *overrides]


def submit_cmd(run_dir: Path, cache: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
            *run_args(run_dir, cache, "launch.scheduler=slurm", *overrides)]


def sacct(*job_ids: str) -> dict[str, tuple[str, str, str]]:
    """JobID -> (JobName, State, NodeList) for the jobs and their steps/het components."""
    out = subprocess.run(["sacct", "-n", "-P", "-o", "JobID,JobName,State,NodeList", "-j", ",".join(job_ids)],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    rows = [ln.split("|") for ln in out.splitlines() if ln]
    return {r[0]: (r[1], r[2].split(" ")[0], r[3]) for r in rows}


def wait_not_active(job_ids: list[str], timeout: float = 30.0) -> dict[str, str]:
    """Wait until none of the jobs pends or runs; returns their final states."""
    deadline = time.time() + timeout
    while True:
        states = {j: sacct(j).get(j, ("", "UNKNOWN", ""))[1] for j in job_ids}
        if not any(s in ("PENDING", "RUNNING", "COMPLETING", "CONFIGURING") for s in states.values()):
            return states
        if time.time() > deadline:
            return states
        time.sleep(1)


def registry(run: Path) -> dict:
    """The run's job registry (component -> job record), or {} while it is being written."""
    try:
        return json.loads((run / "jobs" / "registry.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def last_step(run: Path) -> int:
    steps = [r["step"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "reward/mean" in r]
    return steps[-1] if steps else 0


def slurm_state() -> str:
    """What Slurm shows now: every job (state, CPUs, node, why it waits) and every node (state, CPUs
    allocated/idle/other/total, why it is down). Put in a Slurm test's failure message, so that a run stuck in
    the queue says what holds it."""
    parts = []
    for cmd in (["squeue", "-a", "-o", "%.10i %.16P %.24j %.10T %.9M %.4C %.8N %r"],
                ["sinfo", "-N", "-o", "%.6N %.16P %.8t %.10C %E"]):
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
            parts.append(f"$ {cmd[0]}\n{done.stdout.rstrip()}{done.stderr.rstrip()}")
        except (OSError, subprocess.TimeoutExpired) as e:
            parts.append(f"$ {cmd[0]}: {e}")
    return "\n".join(parts)


def run_logs(run: Path, chars: int = 1500) -> str:
    """The tail of each component's log of a run (trainer, rollouts, ...), for a failure message."""
    logs = sorted(p for p in (run / "logs").glob("*.log")) if (run / "logs").is_dir() else []
    return "".join(f"\n--- {p.name} (tail)\n{p.read_text(errors='replace')[-chars:]}" for p in logs)


def diagnosis(run: Path | None) -> str:
    """What a failing wait on a run adds to its message: the components' log tails and, for a run whose jobs
    are Slurm's, Slurm's view of the jobs and nodes."""
    if run is None:
        return ""
    slurm = any(r.get("scheduler") == "slurm" for r in registry(run).values())
    return run_logs(run) + (f"\n--- Slurm now\n{slurm_state()}" if slurm else "")


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 180, log: Path | None = None,
             run: Path | None = None) -> None:
    """Wait until ``cond()``; fail when the run (``proc``) ends first or after ``timeout`` seconds, with the tail
    of the run's own output (``log``) in the message and, given the run directory, its components' log tails
    and Slurm's view of its jobs."""
    deadline = time.time() + timeout
    while not cond():
        ended, late = proc.poll() is not None, time.time() >= deadline
        if ended or late:
            tail = (log.read_text(errors="replace")[-4000:] if log is not None and log.exists() else "")
            raise AssertionError(f"{'run ended' if ended else 'timed out'} while waiting for {what}\n{tail}"
                                 f"{diagnosis(run)}")
        time.sleep(0.5)


def run_jobs(run: Path) -> list[str]:
    """The Slurm jobs (pending or running) whose comment names this run: what its supervisor submitted."""
    return jobs_commented(f"run={run.resolve()},")


def jobs_commented(mark: str) -> list[str]:
    """The Slurm jobs (pending or running, one line per array task) whose comment contains ``mark``."""
    out = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%k"], capture_output=True, text=True, timeout=30).stdout
    return [ln.split("|", 1)[0] for ln in out.splitlines() if mark in ln.split("|", 1)[-1]]


def cancel_commented(mark: str, timeout: float = 60) -> list[str]:
    """Cancel every Slurm job whose comment contains ``mark`` until none is left (a job submitted meanwhile, or
    an array task whose comment was set late, is cancelled on the next pass) or ``timeout`` seconds passed;
    returns what is still listed. Never raises: it runs after a test, whose own failure must stay the one shown."""
    deadline, jobs = time.time() + timeout, ["?"]
    while jobs and time.time() < deadline:
        try:
            jobs = jobs_commented(mark)
            if jobs:
                subprocess.run(["scancel", *jobs], capture_output=True, timeout=30)
                time.sleep(1)  # a cancelled job completes before Slurm lets go of it
        except (OSError, subprocess.SubprocessError) as e:
            print(f"cancelling the jobs of {mark}: {e}", file=sys.stderr)
            time.sleep(1)
    return jobs


def stop_run(proc: subprocess.Popen, run: Path) -> None:
    """The end of a Slurm test: a supervisor that still runs (the test failed before the run ended) is killed and
    every job of its run cancelled, so that a failed test leaves nothing in the queue holding the nodes the next
    test needs. A supervisor that already ended (or that the test stopped itself) leaves the jobs alone: the
    ``slurm`` tests' teardown (tests/conftest.py) cancels whatever is left after the test."""
    if proc.poll() is not None:
        return
    proc.kill()
    proc.wait()
    cancel_commented(f"run={run.resolve()},")


def wait_node_free(node: str, timeout: float = 120) -> None:
    """Wait until no job runs on ``node`` (a test that needs all of the node's CPUs); fail with Slurm's view
    when something else still holds it after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while subprocess.run(["squeue", "-h", "-w", node, "-o", "%i"], capture_output=True, text=True,
                         timeout=30).stdout.strip():
        assert time.time() < deadline, f"{node} is still taken after {timeout:.0f} s\n{slurm_state()}"
        time.sleep(1)
