"""The rollout fleet's size while a run goes on (``python -m hpcrl scale``, :mod:`hpcrl.launch.fleet`): the plan
itself, and a real local run scaled from one replica to two and back, its audit clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_e2e import ROOT, cache, submit_args  # noqa: F401 (cache: the fixture of the e2e runs)

from hpcrl.audit import audit
from hpcrl.launch.fleet import plan, replica_of, request_scale, scale_requested
from hpcrl.metrics.writer import read_metrics
from hpcrl.runtime.heartbeat import read_heartbeats


def test_plan_starts_the_lowest_free_numbers_and_drains_the_highest() -> None:
    assert plan(["trainer", "rollout-0"], 3) == (["rollout-1", "rollout-2"], [])
    assert plan(["rollout-0", "rollout-2", "eval"], 3) == (["rollout-1"], [])  # a gap is filled first
    assert plan(["rollout-0", "rollout-1", "rollout-2"], 1) == ([], ["rollout-2", "rollout-1"])
    assert plan(["rollout-0"], 1) == ([], []) and plan(["rollout-0"], 0) == ([], ["rollout-0"])
    assert plan(["rollout-10", "rollout-9"], 1) == ([], ["rollout-10"])  # by number, not by name
    assert replica_of("rollout-12") == 12 and replica_of("trainer-r0") is None and replica_of("rollout-x") is None


def test_a_scale_request_is_read_back_and_a_negative_count_is_refused(tmp_path) -> None:
    assert scale_requested(tmp_path) is None
    req = request_scale(tmp_path, 3)
    assert scale_requested(tmp_path) == req and req["replicas"] == 3
    with pytest.raises(ValueError, match=">= 0"):
        request_scale(tmp_path, -1)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_for(cond, proc: subprocess.Popen, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert proc.poll() is None, f"run ended while waiting for {what}"
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)


@pytest.mark.slow
def test_scale_adds_a_replica_that_contributes_then_drains_it_and_the_run_completes(tmp_path, cache) -> None:
    run, steps = tmp_path / "run", 500
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                             *submit_args(run, cache, f"trainer.total_steps={steps}", "eval.every_steps=0")],
                            stdout=subprocess.DEVNULL, stderr=open(tmp_path / "submit.log", "w"), cwd=ROOT,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})

    def step() -> int:
        return max([r["step"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "reward/mean" in r] or [0])

    def jobs() -> dict:
        try:
            return json.loads((run / "jobs" / "registry.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def groups_of_replica_1() -> int:
        return sum(b.get("groups", 0) for n, b in read_heartbeats(run).items() if n.startswith("rollout-1@"))

    try:
        wait_for(lambda: step() >= 10, proc, "step 10")
        up = cli("scale", str(run), "2")
        assert up.returncode == 0 and "1 -> 2" in up.stderr, up.stderr
        wait_for(lambda: groups_of_replica_1() > 0, proc, "the added replica's first groups")
        st = json.loads(cli("status", str(run), "--json").stdout)
        assert st["fleet"]["wanted"] == 2 and st["fleet"]["request"]["replicas"] == 2, st["fleet"]
        assert {"rollout-0", "rollout-1"} <= set(st["components"])
        assert "rollout replicas: 2 wanted (scale 2 by" in cli("status", str(run)).stdout
        down = cli("scale", str(run), "1")
        assert down.returncode == 0 and "2 -> 1" in down.stderr, down.stderr
        wait_for(lambda: "rollout-1" not in jobs(), proc, "the drained replica retired")
        at = step()
        wait_for(lambda: step() >= at + 10, proc, "progress with one replica again")
        assert proc.wait(timeout=300) == 0, (tmp_path / "submit.log").read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    scale = [(e["component"], e["reason"].split(":")[0]) for e in events if e["action"] == "scale"]
    assert scale == [("rollout-1", "started rollout-1"), ("rollout-1", "draining rollout-1"),
                     ("rollout-1", "rollout-1 drained and retired (exit 75)")], scale
    assert not [e for e in events if e["action"] == "restart"]
    log = (run / "logs" / "rollout-1.log").read_text()
    assert "received SIGUSR2" in log and "unfinished groups handed back" in log
    assert cli("scale", str(run), "3").returncode == 2  # a finished run takes no request
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == steps and rep.unfinished == 0
