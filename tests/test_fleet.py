"""The rollout fleet's size while a run goes on (``python -m hpcrl scale``, :mod:`hpcrl.launch.fleet`): the plan
itself, and a real local run scaled from one replica to two and back, its audit clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from slurm_helpers import wait_for
from test_e2e import ROOT, cache, submit_args  # noqa: F401 (cache: the fixture of the e2e runs)

from hpcrl.audit import audit
from hpcrl.config import load_config
from hpcrl.launch.autoscale import Autoscaler, Signals, last_assessment
from hpcrl.launch.fleet import fleet_size, plan, replica_of, request_scale, scale_requested
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


def test_the_fleet_size_a_rollout_sees_follows_scale_requests_read_at_most_every_interval(tmp_path) -> None:
    cfg = load_config(ROOT / "configs" / "quickstart.yaml", ["rollout.replicas=2"])
    size = fleet_size(cfg, tmp_path, every_s=0.05)
    assert size() == 2  # no request: rollout.replicas
    request_scale(tmp_path, 5)
    assert size() == 2, "read again only after the interval"
    time.sleep(0.06)
    assert size() == 5
    request_scale(tmp_path, 0)  # drained to nothing: a share is still taken over one replica
    time.sleep(0.06)
    assert size() == 1


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})




@pytest.mark.slow
def test_scale_adds_a_replica_that_contributes_then_drains_it_and_the_run_completes(tmp_path, cache) -> None:
    run, steps = tmp_path / "run", 1500  # room for a scale-up and a drain, each a job start or stop, before the end
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


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def autoscaler(tmp_path, **over):
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), [f"run_dir={tmp_path}", "admission.batch_size=4", "admission.max_staleness=2",
                             "launch.autoscale.enabled=true", "launch.autoscale.min_replicas=1",
                             "launch.autoscale.max_replicas=3", "launch.autoscale.window_s=10",
                             "launch.autoscale.cooldown_s=30", *[f"launch.autoscale.{k}={v}" for k, v in over.items()]])
    clock = Clock()
    return Autoscaler(cfg, tmp_path, clock), clock


def signals(wait: float | None, steps: int = 20, window: float = 12.0, ready: int = 0) -> Signals:
    return Signals(wait_share=wait, steps=steps, window_s=window, ready_groups=ready, bound_groups=12)


def test_autoscaler_adds_on_waiting_drains_on_surplus_and_holds_in_between(tmp_path) -> None:
    a, clock = autoscaler(tmp_path)
    room, no_room = (lambda: True), (lambda: False)
    count, why = a.decide(1, signals(0.5), room)
    assert count == 2 and "waited for data 50% of the last 12s (20 steps) > 20%" in why
    assert a.decide(1, signals(0.5), no_room) is None  # the cluster has no room: wait
    assert a.decide(3, signals(0.9), room) is None  # at max_replicas
    assert a.decide(1, signals(0.5, steps=2), room) is None  # too few steps
    assert a.decide(1, signals(0.5, window=5.0), room) is None  # not a full window
    assert a.decide(1, signals(None), room) is None
    # the hysteresis band: neither waiting enough to add nor idle enough to drain
    assert a.decide(2, signals(0.1, ready=12), room) is None
    assert a.decide(2, signals(0.01, ready=8), room) is None  # ready groups below 75% of the bound
    count, why = a.decide(2, signals(0.01, ready=9), room)
    assert count == 1 and "9 ready groups fill >= 75% of the 12 the staleness bound allows" in why
    assert a.decide(1, signals(0.0, ready=12), room) is None  # at min_replicas
    assert a.decide(0, signals(None), room)[0] == 1 and a.decide(5, signals(None), room)[0] == 3  # the bounds


def test_autoscaler_tick_writes_a_request_logs_every_assessment_and_cools_down(tmp_path) -> None:
    (tmp_path / "logs").mkdir()
    with open(tmp_path / "logs" / "metrics.jsonl", "w") as f:
        for i in range(1, 21):  # 20 steps of 1 s, 0.7 s of each in the batch's wait, 0.1 s in the last spool pass
            f.write(json.dumps({"step": i, "time/wait_s": 0.7, "time/spool_s": 0.3, "time/spool_tail_s": 0.1,
                                "time/step_s": 1.0, "time/elapsed_s": float(i)}) + "\n")
    a, clock = autoscaler(tmp_path)
    said = a.tick(lambda: True)
    assert said.startswith("1 -> 2: the trainer waited for data 60% of the last 11s (11 steps)"), said
    req = scale_requested(tmp_path)
    assert req["replicas"] == 2 and req["user"] == "autoscaler" and "60%" in req["reason"]
    clock.t += 100  # past the cooldown, but no training since the decision: nothing to decide on
    assert a.tick(lambda: True) is None and scale_requested(tmp_path)["replicas"] == 2
    records = [json.loads(x) for x in (tmp_path / "logs" / "fleet.jsonl").read_text().splitlines()]
    assert [r.get("decision") for r in records] == [2, None] and records[1]["steps"] == 0
    assert last_assessment(tmp_path)["last_decision"]["reason"] == req["reason"]


# the same path on Slurm (room asked of sbatch --test-only, the replica a job of its own, drained by `scale`) is in
# the default suite: tests/test_slurm_elastic.py; this local run is opt-in (-m long)
@pytest.mark.long
def test_autoscaled_run_grows_to_its_maximum_when_the_trainer_waits(tmp_path, cache) -> None:
    """The trainer waits for data (a low threshold makes that certain here): the autoscaler adds a replica, the
    run never has more than max_replicas, and it completes with its audit clean."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "hpcrl.submit", "--config", str(ROOT / "configs/quickstart.yaml"),
                           *submit_args(run, cache, "trainer.total_steps=300", "eval.every_steps=0",
                                        "launch.autoscale.enabled=true", "launch.autoscale.max_replicas=2",
                                        "launch.autoscale.add_wait_share=0.01", "launch.autoscale.drain_wait_share=0",
                                        "launch.autoscale.window_s=2", "launch.autoscale.cooldown_s=2",
                                        "launch.autoscale.interval_s=1", "launch.autoscale.min_steps=3")],
                          capture_output=True, text=True, timeout=400, cwd=ROOT,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "autoscale: 1 -> 2: the trainer waited for data" in proc.stderr, proc.stderr[-3000:]
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    started = [e["component"] for e in events if e["action"] == "scale" and e["reason"].startswith("started")]
    assert started == ["rollout-1"], events
    records = [json.loads(x) for x in (run / "logs" / "fleet.jsonl").read_text().splitlines()]
    assert max(r["wanted"] for r in records) == 2 and [r["decision"] for r in records if "decision" in r] == [2]
    assert (run / "logs" / "rollout-1.log").read_text().count(" started (writer ") == 1
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 300 and rep.unfinished == 0
