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
