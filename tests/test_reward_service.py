"""The reward service: rollouts hand their items to a reward component through the run directory.

In-process: a client and a service on the real files; the service killed (stopped) with work pending loses
nothing; a client whose service is down gets ``infra_error`` results (held and scored again by the rollout
loop), and finds the answers once a new service has scored them. End to end: a run with ``reward.service``
whose reward component is SIGKILLed three times completes with its audit clean and no infra error trained.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcrl.audit import audit
from hpcrl.reward.config import RewardConfig
from hpcrl.reward.runner import RewardRunner
from hpcrl.reward.service import RewardService, ServiceClient

ROOT = Path(__file__).resolve().parents[1]
ITEMS = [("1+1=", "2", {"answer": "2"}), ("2+2=", "5", {"answer": "4"}), ("3+3=", "6", {"answer": "6"})]


def serve(service: RewardService, stop: threading.Event) -> threading.Thread:
    def loop() -> None:
        while not stop.is_set():
            if not service.pump():
                time.sleep(0.01)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    return t


def test_two_rollouts_share_one_service(tmp_path: Path) -> None:
    cfg = RewardConfig(service=True, service_wait_s=10)
    scorer = RewardRunner(cfg)
    stop = threading.Event()
    t = serve(RewardService(tmp_path, cfg, scorer), stop)
    try:
        a, b = ServiceClient(cfg, tmp_path, "r0-x"), ServiceClient(cfg, tmp_path, "r1-y")
        assert [r.reward for r in a.score_many(ITEMS)] == [1.0, 0.0, 1.0]
        assert [r.reward for r in b.score_many(ITEMS[::-1])] == [1.0, 0.0, 1.0]
        assert a.counts == {"ok": 3} and scorer.counts["ok"] == 6
    finally:
        stop.set()
        t.join()
        scorer.close()
    assert not os.listdir(tmp_path / "reward" / "requests") and not os.listdir(tmp_path / "reward" / "results")


def test_a_service_that_is_down_gives_infra_errors_and_a_new_one_loses_nothing(tmp_path: Path) -> None:
    cfg = RewardConfig(service=True, service_wait_s=0.3)
    client = ServiceClient(cfg, tmp_path, "r0-x")
    first = client.score_many(ITEMS)  # no service yet: nothing is scored, nothing is lost
    assert [r.status for r in first] == ["infra_error"] * 3 and "reward.service_wait_s" in first[0].detail
    t0 = time.monotonic()
    assert client.score_many(ITEMS[:1])[0].status == "infra_error"
    assert time.monotonic() - t0 < 0.2  # a service that let the last call down is not waited for again
    assert len(os.listdir(tmp_path / "reward" / "requests")) == 3
    scorer = RewardRunner(cfg)
    service = RewardService(tmp_path, cfg, scorer)  # the restarted service scores what is pending
    assert service.pump() == 3 and scorer.counts["ok"] == 3
    again = client.score_many(ITEMS)  # the held group, scored again: its results are there
    assert [r.reward for r in again] == [1.0, 0.0, 1.0] and [r.status for r in again] == ["ok"] * 3
    (tmp_path / "reward" / "requests" / "forged.json").write_text("{not json")
    assert service.pump() == 1  # a file it cannot read is answered, not retried forever
    assert json.loads((tmp_path / "reward" / "results" / "forged.json").read_text())["status"] == "invalid"
    scorer.close()
    (tmp_path / "DONE").write_text("")  # the run ended: the service exits, and a rollout does not wait for it
    late = ServiceClient(RewardConfig(service=True, service_wait_s=30), tmp_path, "r1-y")
    t0 = time.monotonic()
    assert [r.status for r in late.score_many(ITEMS[:1])] == ["infra_error"] and time.monotonic() - t0 < 5
    assert late.score_many(ITEMS[:1])[0].detail == "the run ended before the reward service scored it"


@pytest.mark.slow
def test_a_run_whose_reward_job_is_killed_three_times_completes_with_its_audit_clean(tmp_path: Path) -> None:
    run, cache = tmp_path / "run", tmp_path / "cache"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"), f"run_dir={run}",
         f"model.cache_dir={cache}/models", f"data.synthetic_dir={cache}/data", "model.tiny_hidden_size=32",
         "model.tiny_layers=2", "data.n_train=2000", "data.n_eval=40", "sft.enabled=false", "admission.batch_size=4",
         "rollout.group_size=4", "rollout.max_batch_size=8", "rollout.max_new_tokens=4", "trainer.total_steps=40",
         "eval.every_steps=0", "eval.size=40", "reward.service=true", "reward.service_wait_s=1",
         "reward.infra_retry_s=0.2", "watchdog.backoff_s=0.5", "launch.heartbeat_interval_s=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    kills, pids = 0, set()
    deadline = time.time() + 500
    try:
        while kills < 3 and proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
            try:
                rec = json.loads((run / "jobs" / "registry.json").read_text()).get("reward")
            except (FileNotFoundError, ValueError):
                continue
            if not rec or rec["job_id"] in pids or not list((run / "spool" / "trained").glob("step_*")):
                continue  # not started yet, already killed, or the run has trained nothing yet
            time.sleep(1.0)
            try:
                os.kill(int(rec["job_id"]), signal.SIGKILL)
            except ProcessLookupError:
                continue
            pids.add(rec["job_id"])
            kills += 1
        out, err = proc.communicate(timeout=max(10.0, deadline - time.time()))
    finally:
        if proc.poll() is None:
            proc.kill()
    assert kills == 3, err[-3000:]
    assert proc.returncode == 0, err[-3000:]
    rep = audit(run)
    assert rep.ok and rep.steps == 40, rep.violations
    assert "infra_error" not in rep.reward_status and rep.reward_status.get("ok", 0) == 40 * 4 * 4
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    assert sum(e["action"] == "restart" and e.get("component") == "reward" for e in events) >= 3, events
    logs = (run / "logs" / "reward.log").read_text()
    assert logs.count("reward service started") >= 4, logs[-2000:]  # the first instance and its 3 restarts
    stats = json.loads((run / "logs" / "rollout-0.stats.json").read_text())
    assert stats["reward"].get("ok", 0) >= 40 * 4 * 4, stats  # the rollout scored through the service only
    # its threads' CPU since the worker started, read before closing ended the one that wrote the spool files
    assert stats["cpu_threads_s"]["MainThread"] > 0 and stats["cpu_threads_s"]["spool-publisher"] > 0, stats
    print("rollout waited on the service:", stats["samples_infra_error"], "failed scorings,",
          stats["groups_rescored"], "groups scored again")
