"""On the real local Slurm cluster: rollouts on preemptible capacity, preempted by Slurm itself.

The rollout job runs in a scavenger partition on node1 (all its CPUs), the trainer in the default partition on
node2. The test then submits jobs to the ``high`` partition on node1: Slurm's own preemption
(``PreemptType=preempt/partition_prio``, scripts/slurm_cluster.sh) takes the node from the rollout, requeueing
its job (``scavenger``: ``PreemptMode=REQUEUE``) or cancelling it (``scavenger_cancel``: ``CANCEL``). The
trainer waits without failing while no rollout runs, the rollout comes back when the node is free again (a
resubmission that is not charged as a failure, or the same job requeued by Slurm), and the run completes with
its audit clean: nothing lost, nothing trained twice.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_helpers import (ROOT, cluster_skip_reason, job_env, last_step, registry, stop_run, submit_cmd,
                           wait_for, wait_node_free, wait_not_active)

from hpcrl.audit import audit
from hpcrl.launch.control import components
from hpcrl.metrics.writer import read_metrics
from hpcrl.runtime.heartbeat import read_heartbeats

_reason = cluster_skip_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.skipif(_reason is not None, reason=_reason or "")]

STEPS = 240
PLACED = ["launch.rollout.cpus_per_task=4", "launch.rollout.extra_sbatch=[--nodelist=node1]",
          "launch.trainer.extra_sbatch=[--nodelist=node2]"]




def starts(run: Path, replica: int = 0) -> int:
    """How many times a rollout process started (each run of a requeued job, each resubmission)."""
    try:
        return (run / "logs" / f"rollout-{replica}.log").read_text(errors="replace").count(" started (writer ")
    except FileNotFoundError:
        return 0




def preempt_node1(tmp_path: Path, hold_s: int = 25) -> str:
    """A job of the high-priority partition that needs every CPU of node1: Slurm preempts what runs there."""
    return subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", "node1", "-c", "4", "-J", "hpcrl-test-high",
                           "-o", str(tmp_path / "high-%j.out"), "--wrap", f"sleep {hold_s}"],
                          capture_output=True, text=True, check=True, timeout=60).stdout.strip()


def sacct_runs(job_id: str) -> list[str]:
    """The states of every run of a job (``sacct -D``: a requeued job has one record per run)."""
    out = subprocess.run(["sacct", "-n", "-P", "-X", "-D", "-o", "JobID,State", "-j", job_id], capture_output=True,
                         text=True, timeout=30, check=True).stdout
    return [ln.split("|")[1].split(" ")[0] for ln in out.splitlines() if ln]


@pytest.mark.parametrize("partition,preemptions", [("scavenger", 1), ("scavenger_cancel", 1)])
def test_rollout_on_preemptible_partition_is_preempted_by_slurm_and_the_run_completes(tmp_path, partition,
                                                                                        preemptions) -> None:
    """Each preemption: the rollout hands its groups back and stops (SIGTERM from Slurm), comes back once the
    high-priority job is gone, and the trainer goes on. A graceful stop ends the job COMPLETED (REQUEUE) or
    PREEMPTED (CANCEL) and the supervisor starts it again free of charge; a job Slurm requeues (tested with
    ``scontrol requeue``, as a preemption that outlasts the grace time does) runs again as the same job, writing
    as a new incarnation that hands back what the run before held."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    wait_node_free("node1")  # the rollout needs all of node1: nothing an earlier test left may hold it
    cmd = submit_cmd(run, cache, f"trainer.total_steps={STEPS}", "eval.every_steps=0", "watchdog.backoff_s=0.5",
                     "watchdog.max_restarts=0", "watchdog.startup_grace_s=15", f"launch.rollout.partition={partition}",
                     "launch.queue_note_s=5", *PLACED)
    out = tmp_path / "submit.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out, "w"), env=job_env(), cwd=ROOT)
    high: list[str] = []
    requeued = ""
    try:
        for k in range(preemptions):
            wait_for(lambda: last_step(run) >= 15 + 25 * k and starts(run) == k + 1, proc, f"step {15 + 25 * k}",
                     log=out, run=run)
            high.append(preempt_node1(tmp_path))
            wait_for(lambda: starts(run) == k + 2, proc, f"the rollout back after preemption {k + 1}",
                     log=out, run=run)
            step = last_step(run)
            wait_for(lambda: last_step(run) >= step + 5, proc, f"progress after preemption {k + 1}", log=out,
                     run=run)
        if partition == "scavenger":
            requeued = registry(run)["rollout-0"]["job_id"]
            subprocess.run(["scontrol", "requeue", requeued], check=True, capture_output=True, timeout=60)
            wait_for(lambda: starts(run) == preemptions + 2, proc, "the requeued rollout job running again", log=out,
                     run=run)
        assert proc.wait(timeout=600) == 0, (tmp_path / "submit.log").read_text()[-4000:]
    finally:
        stop_run(proc, run)
        subprocess.run(["scancel", *high], capture_output=True)
    log = (run / "logs" / "rollout-0.log").read_text(errors="replace")
    assert log.count("received SIGTERM") >= preemptions, log[-3000:]
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    restarts = [e for e in events if e["action"] == "restart"]
    # watchdog.max_restarts=0: a preemption is never charged as a failure (a charged one would have failed the
    # run), nor is waiting in the queue for the node (25 s, longer than the 15 s of watchdog.startup_grace_s)
    assert [e["component"] for e in restarts] == ["rollout-0"] * preemptions, restarts
    assert all("preemption" in e["reason"] for e in restarts), restarts
    assert {s for j in high for s in sacct_runs(j)} == {"COMPLETED"}  # the high-priority jobs ran
    if requeued:  # the same job ran again: no resubmission, its earlier run's tickets handed back
        assert registry(run)["rollout-0"]["job_id"] == requeued
        assert log.count("Slurm requeued this job") == 1 and f"writer r0-{registry(run)['rollout-0']['instance']}q1" \
            in log, log[-3000:]
    # the rollout's wait for node1 (25 s, the high-priority job) said on the terminal, and its start
    said = (tmp_path / "submit.log").read_text()
    assert "rollout-0: job " in said and " s in the scheduler's queue (see: python -m hpcrl status" in said, said[-3000:]
    assert " s in the queue" in said.split("in the scheduler's queue")[-1], said[-3000:]
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == STEPS and rep.unfinished == 0
    trainer = run / "logs" / "trainer-r0.log"
    assert "resumed from" not in trainer.read_text(errors="replace")  # the trainer never stopped




def test_the_autoscaler_adds_a_slurm_job_when_the_trainer_waits_and_scale_drains_it(tmp_path) -> None:
    """On Slurm: the trainer waits for data (a low threshold makes that certain here), the autoscaler asks Slurm
    whether a replica would start (``sbatch --test-only``) and adds ``rollout-1`` as a job of its own, which
    contributes; ``python -m hpcrl scale <run> 1`` then drains it through Slurm (SIGUSR2): it hands its groups
    back, its job ends COMPLETED, and it is retired, not restarted. The run completes with its audit clean."""
    run, cache, out, steps = tmp_path / "run", tmp_path / "cache", tmp_path / "submit.log", 900
    cmd = submit_cmd(run, cache, f"trainer.total_steps={steps}", "eval.every_steps=0", "watchdog.max_restarts=0",
                     "launch.autoscale.enabled=true", "launch.autoscale.max_replicas=2",
                     "launch.autoscale.add_wait_share=0.01", "launch.autoscale.drain_wait_share=0",
                     "launch.autoscale.window_s=2", "launch.autoscale.min_steps=3", "launch.autoscale.interval_s=1",
                     "launch.autoscale.cooldown_s=3600")  # one decision: the drain below is the user's
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(out, "w"), env=job_env(), cwd=ROOT)

    def groups_of_replica_1() -> int:
        return sum(b.get("groups", 0) for n, b in read_heartbeats(run).items() if n.startswith("rollout-1@"))

    try:
        wait_for(lambda: groups_of_replica_1() > 0, proc, "the added replica's first groups", log=out, run=run)
        added = registry(run)["rollout-1"]["job_id"]
        down = subprocess.run([sys.executable, "-m", "hpcrl", "scale", str(run), "1"], capture_output=True,
                              text=True, timeout=120, cwd=ROOT, env=job_env())
        assert down.returncode == 0 and "2 -> 1" in down.stderr, down.stderr
        wait_for(lambda: "rollout-1" not in registry(run), proc, "the drained replica retired", log=out, run=run)
        at = last_step(run)
        assert at < steps - 20, "the run ended too soon to see it go on with one replica: raise the steps"
        assert proc.wait(timeout=300) == 0, out.read_text()[-4000:]
    finally:
        stop_run(proc, run)
    log = out.read_text()
    assert "autoscale: 1 -> 2: the trainer waited for data" in log, log[-3000:]
    events = [json.loads(x) for x in (run / "jobs" / "events.jsonl").read_text().splitlines()]
    scale = [(e["component"], e["reason"].split(":")[0]) for e in events if e["action"] == "scale"]
    assert scale == [("rollout-1", "started rollout-1"), ("rollout-1", "draining rollout-1"),
                     ("rollout-1", "rollout-1 drained and retired (exit 75)")], scale
    assert not [e for e in events if e["action"] == "restart"]
    assert wait_not_active([added])[added] == "COMPLETED"
    rollout1 = (run / "logs" / "rollout-1.log").read_text()
    assert starts(run, 1) == 1 and "received SIGUSR2" in rollout1 and "groups handed back" in rollout1
    records = [json.loads(x) for x in (run / "logs" / "fleet.jsonl").read_text().splitlines()]
    assert [r["decision"] for r in records if "decision" in r] == [2]
    # the trainer's metrics show the fleet it trained from: one replica, then two, then one again
    mixed = [r["fleet/replicas_in_batch"] for r in read_metrics(run / "logs" / "metrics.jsonl") if "samples" in r]
    assert mixed[0] == 1 and max(mixed) == 2 and mixed[-1] == 1, mixed
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == steps and rep.unfinished == 0


def test_has_room_asks_slurm_whether_a_rollout_job_would_start_soon(tmp_path) -> None:
    """The autoscaler's room check: ``sbatch --test-only`` on the job a replica would be; no room while a job of
    the high partition holds node1 for longer than ``within_s``."""
    from hpcrl.launch.config import ResourcesConfig
    from hpcrl.launch.scheduler import ComponentSpec
    from hpcrl.launch.slurm import SlurmScheduler

    wait_node_free("node1")
    sched = SlurmScheduler(tmp_path / "slurm")
    spec = ComponentSpec("rollout-1", ["true"], tmp_path / "rollout-1.log",
                         resources=ResourcesConfig(cpus_per_task=4, extra_sbatch=["--nodelist=node1"]))
    assert sched.has_room(spec, within_s=60)
    holder = subprocess.run(["sbatch", "--parsable", "-p", "high", "-w", "node1", "-c", "4", "-t", "10",
                             "-o", "/dev/null", "--wrap", "sleep 300"], capture_output=True, text=True, check=True,
                            timeout=60).stdout.strip()
    try:
        deadline = time.time() + 30
        while subprocess.run(["squeue", "-h", "-j", holder, "-o", "%T"], capture_output=True, text=True,
                             timeout=30).stdout.strip() != "RUNNING":
            assert time.time() < deadline, "the holder job did not start"
            time.sleep(0.5)
        assert not sched.has_room(spec, within_s=60)  # node1 is taken for 10 minutes
        assert sched.has_room(spec, within_s=3600)
        bad = ComponentSpec("rollout-1", ["true"], tmp_path / "x.log", resources=ResourcesConfig(partition="nosuch"))
        assert not sched.has_room(bad, within_s=3600)
    finally:
        subprocess.run(["scancel", holder], capture_output=True)


def test_rollout_replicas_are_one_job_array_whose_tasks_restart_alone(tmp_path) -> None:
    """``rollout.replicas=2`` under Slurm: one ``sbatch --array`` (each task its own comment); a task that is
    scancelled is resubmitted alone, as a job of its own, while the other task runs on; ``status`` shows each."""
    run, cache = tmp_path / "run", tmp_path / "cache"
    cmd = submit_cmd(run, cache, "trainer.total_steps=200", "eval.every_steps=0", "rollout.replicas=2",
                     "watchdog.backoff_s=0.5")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "submit.log", "w"),
                            env=job_env(), cwd=ROOT)
    try:
        wait_for(lambda: last_step(run) >= 15, proc, "step 15", run=run)
        first, second = registry(run)["rollout-0"]["job_id"], registry(run)["rollout-1"]["job_id"]
        array = first.split("_")[0]
        assert (first, second) == (f"{array}_0", f"{array}_1"), registry(run)
        rows = subprocess.run(["squeue", "-h", "-r", "-o", "%i|%j|%k", "-j", array], capture_output=True, text=True,
                              check=True, timeout=30).stdout.splitlines()  # (sacct has the comments once they end)
        names = {r.split("|")[0]: r.split("|")[1:] for r in rows}
        assert {j: n for j, (n, _) in names.items()} == {first: "hpcrl-rollout", second: "hpcrl-rollout"}, rows
        assert ",component=rollout-1," in names[second][1], rows
        subprocess.run(["scancel", second], check=True, timeout=60)
        wait_for(lambda: registry(run)["rollout-1"]["job_id"] != second, proc, "rollout-1 resubmitted", run=run)
        alone = registry(run)["rollout-1"]["job_id"]
        assert "_" not in alone and registry(run)["rollout-0"]["job_id"] == first  # the other task runs on
        wait_for(lambda: json.loads(subprocess.run(
            [sys.executable, "-m", "hpcrl", "status", str(run), "--json"], capture_output=True, text=True,
            timeout=120, env=job_env(), cwd=ROOT).stdout)["components"]["rollout-1"]["state"] == "RUNNING", proc,
            "status of the resubmitted task", run=run)
        st = json.loads(subprocess.run([sys.executable, "-m", "hpcrl", "status", str(run), "--json"],
                                       capture_output=True, text=True, timeout=120, env=job_env(), cwd=ROOT).stdout)
        assert {n: (c["job_id"], c["state"]) for n, c in st["components"].items() if n.startswith("rollout")} == \
            {"rollout-0": (first, "RUNNING"), "rollout-1": (alone, "RUNNING")}, st["components"]
        assert proc.wait(timeout=600) == 0, (tmp_path / "submit.log").read_text()[-4000:]
    finally:
        stop_run(proc, run)
    rep = audit(run)
    assert rep.ok, rep.violations
    assert rep.steps == 200 and rep.unfinished == 0


def test_a_failing_wait_says_what_slurm_holds_and_a_failed_test_cancels_its_runs_jobs(tmp_path) -> None:
    """The Slurm tests' own helpers: a node taken by another job fails ``wait_node_free`` with Slurm's view; a
    wait on a run that times out adds the components' log tails and the queue; ``stop_run`` kills a supervisor
    still running and cancels every job whose comment names its run, and leaves other jobs alone."""
    from slurm_helpers import run_jobs

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "jobs").mkdir()
    (run / "logs" / "rollout-0.log").write_text("rollout started\nwaiting for the node\n")
    (run / "jobs" / "registry.json").write_text(json.dumps({"rollout-0": {"scheduler": "slurm", "job_id": "1"}}))

    def sbatch(*args: str) -> str:
        return subprocess.run(["sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "sleep 120"],
                              capture_output=True, text=True, check=True, timeout=60).stdout.strip()

    holder = sbatch("-p", "high", "-w", "node1", "-c", "4", "-J", "hpcrl-test-holder")
    other = sbatch("-J", "hpcrl-test-other", f"--comment=hpcrl,run={tmp_path / 'elsewhere'},component=x")
    mine = sbatch("-J", "hpcrl-test-mine", f"--comment=hpcrl,run={run.resolve()},component=rollout-0,epoch=1")
    wait_node_free("node1")
    proc, pending = subprocess.Popen(["sleep", "600"]), ""
    try:
        wait_for(lambda: subprocess.run(["squeue", "-h", "-j", holder, "-o", "%T"], capture_output=True,
                                        text=True, timeout=30).stdout.strip() == "RUNNING", proc, "the holder")
        with pytest.raises(AssertionError, match=r"(?s)node1 is still taken after 2 s.*hpcrl-test-holder"):
            wait_node_free("node1", timeout=2)
        with pytest.raises(AssertionError) as failed:
            wait_for(lambda: False, proc, "step 15", timeout=1, run=run)
        message = str(failed.value)
        assert message.startswith("timed out while waiting for step 15"), message
        assert "--- rollout-0.log (tail)\nrollout started\nwaiting for the node" in message, message
        assert "--- Slurm now\n$ squeue" in message and "hpcrl-test-holder" in message and "$ sinfo" in message
        # `status` says why a job of the run waits: one that needs node1 pends behind the holder
        pending = sbatch("-p", "debug", "-w", "node1", "-c", "4", "-J", "hpcrl-test-pending",
                         f"--comment=hpcrl,run={run.resolve()},component=rollout-1,epoch=1")
        (run / "jobs" / "registry.json").write_text(json.dumps({"rollout-1": {"scheduler": "slurm",
                                                                               "job_id": pending}}))
        wait_for(lambda: components(run)["rollout-1"]["waiting_for"] is not None, proc, "the pending reason")
        assert components(run)["rollout-1"]["state"] == "PENDING"
        assert components(run)["rollout-1"]["waiting_for"] in ("Resources", "Priority"), components(run)
        assert sorted(run_jobs(run)) == sorted([mine, pending])
        stop_run(proc, run)
        assert proc.poll() is not None and run_jobs(run) == []
        assert subprocess.run(["squeue", "-h", "-j", other, "-o", "%T"], capture_output=True, text=True,
                              timeout=30).stdout.strip() in ("PENDING", "RUNNING")  # not this run's: left alone
    finally:
        proc.kill()
        subprocess.run(["scancel", *filter(None, [holder, other, mine, pending])], capture_output=True, timeout=60)
