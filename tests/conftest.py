"""Runs that several test files look at, built once per session."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _slurm_jobs_cancelled(request):
    """After each test on the Slurm cluster: cancel every job of a run under the test's ``tmp_path`` still in the
    queue (the supervisor's comment names its run directory), whatever ended the test, so that one failure does
    not hold the nodes the next test needs (tests/slurm_helpers.py). Runs after the test's own checks."""
    slurm = request.node.get_closest_marker("slurm") is not None and "tmp_path" in request.fixturenames
    base = request.getfixturevalue("tmp_path").resolve() if slurm else None  # set up first: torn down after this
    yield
    if base is None:
        return
    from slurm_helpers import cancel_commented

    left = cancel_commented(f"run={base}/")
    if left:
        print(f"Slurm jobs of this test still listed after scancel: {left}", file=sys.stderr)


@pytest.fixture(scope="session")
def restarted_run(tmp_path_factory) -> Path:
    """A finished quickstart run of 30 steps whose trainer was SIGKILLed after step 8 and restarted by the
    watchdog from its step-4 or step-8 checkpoint; held-out evaluation as its own component; metrics to
    TensorBoard, W&B (offline) and an MLflow file store. Looked at by the run explorer's browser test and the
    trackers' test."""
    from chaos_script import load_chaos
    from test_e2e import submit_args

    from hpcrl.metrics.writer import read_metrics

    base = tmp_path_factory.mktemp("restarted")
    run = base / "run"
    args = submit_args(run, base / "cache", "trainer.total_steps=30", "ckpt.every_steps=4", "eval.every_steps=10",
                       "eval.mode=component", "admission.max_staleness=1",
                       "metrics.trackers=[tensorboard,wandb,mlflow]")
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                             *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT),
                                 "WANDB_SILENT": "true"})
    deadline = time.time() + 240
    while not any(r.get("step", 0) >= 8 for r in read_metrics(run / "logs/metrics.jsonl")):
        assert time.time() < deadline and proc.poll() is None, "the run did not reach step 8"
        time.sleep(0.2)
    for pid in load_chaos().run_processes(run)["trainer"]:
        os.kill(pid, signal.SIGKILL)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert '"action": "restart"' in (run / "jobs" / "events.jsonl").read_text()
    return run


@pytest.fixture(scope="session")
def agent_run(tmp_path_factory) -> Path:
    """``configs/agent_feedback.yaml`` made small (30 steps, no warm start), whose rollout job was SIGKILLed after
    step 8 while its episodes were mid-conversation and resubmitted by the watchdog. Looked at by the agent
    end-to-end test and the run explorer's browser test (an episode's masked feedback turn)."""
    import json

    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from hpcrl.metrics.writer import read_metrics

    base = tmp_path_factory.mktemp("agent")
    run, cache = base / "run", base / "cache"
    args = [f"run_dir={run}", f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data",
            "model.tiny_hidden_size=32", "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40",
            "sft.enabled=false", "admission.batch_size=4", "rollout.group_size=4", "rollout.max_batch_size=16",
            "rollout.max_new_tokens=4", "trainer.total_steps=30", "eval.every_steps=10", "eval.size=40",
            "ckpt.every_steps=5", "watchdog.backoff_s=0.5", "launch.progress_interval_s=1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    config = str(ROOT / "configs/agent_feedback.yaml")
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", config, *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        metrics, deadline = run / "logs" / "metrics.jsonl", time.time() + 240
        while not (metrics.exists() and any(r.get("step", 0) >= 8 for r in read_metrics(metrics))):
            assert proc.poll() is None and time.time() < deadline, "the agent run did not reach step 8"
            time.sleep(0.2)
        rollout = json.loads((run / "jobs" / "registry.json").read_text())["rollout-0"]
        os.killpg(int(rollout["job_id"]), signal.SIGKILL)  # episodes are mid-conversation at any moment here
        _, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-4000:]
    return run
