"""On the real local Slurm cluster: ``scancel`` of the rollout job and of the trainer job during
a run are each followed by a resubmission by the watchdog, and the run completes with its
invariants intact (audit from the run directory)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from slurm_helpers import ROOT, cluster_skip_reason, job_env, submit_cmd

from hpcrl.audit import audit
from hpcrl.metrics.writer import read_metrics

_reason = cluster_skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_reason is not None, reason=_reason or "")]


def registry(run: Path) -> dict:
    try:
        return json.loads((run / "jobs" / "registry.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def last_step(run: Path) -> int:
    steps = [r["step"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "reward/mean" in r]
    return steps[-1] if steps else 0


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"run ended while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def test_scancel_of_rollout_and_trainer_jobs_is_survived(tmp_path) -> None:
    run, cache = tmp_path / "run", tmp_path / "cache"
    cmd = submit_cmd(run, cache, "trainer.total_steps=400", "ckpt.every_steps=10", "eval.every_steps=0",
                     "watchdog.backoff_s=0.5")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "submit.log", "w"),
                            env=job_env(), cwd=ROOT)
    try:
        wait_for(lambda: last_step(run) >= 20, proc, "step 20")
        for name in ("rollout-0", "trainer"):
            old = registry(run)[name]["job_id"]
            subprocess.run(["scancel", old], check=True)
            wait_for(lambda: registry(run).get(name, {}).get("job_id") not in (None, old), proc,
                     f"resubmission of {name}")
            step = last_step(run)
            wait_for(lambda: last_step(run) >= step + 10, proc, f"progress after {name} came back")
        assert proc.wait(timeout=600) == 0, (tmp_path / "submit.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    assert {e["component"] for e in events if e["action"] == "restart"} >= {"rollout-0", "trainer"}
    resumes = [ln for ln in (run / "logs" / "trainer-r0.log").read_text().splitlines() if "resumed from" in ln]
    assert len(resumes) == 1, resumes  # one resubmitted trainer, no second one requeued by Slurm beside it
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 400 and rep.unfinished == 0


def test_chaos_on_slurm(tmp_path) -> None:
    """A shorter chaos run with every component a Slurm job: SIGKILL through scancel, at random moments."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("chaos", ROOT / "scripts" / "chaos.py")
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    report = chaos.main(["--kills", "6", "--steps", "300", "--replicas", "1", "--run-dir", str(tmp_path / "run"),
                         "--cache", str(tmp_path / "cache"), "--seed", "5", "launch.scheduler=slurm"])
    assert report["exit_code"] == 0 and report["violations"] == []
    assert sum(report["kills"].values()) >= 6 and report["restarts"] >= 6
    assert report["steps"] == 300 and report["unfinished"] == 0 and report["quarantined"] == 0
